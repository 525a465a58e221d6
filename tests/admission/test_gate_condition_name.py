"""The gate is told the node condition the node agent publishes.

The chart lets an operator rename the condition (`nodeCondition.name`), but the webhook had no
setting for it, so every gate pointed at gpu-fractioning.nvidia.com/Ready: missing on every node
of such a cluster, which the gate's line reads as "no node agent runs". Now the admission server
takes `--condition-name` and passes it to the gate, only when it is not the default: a default
install's gates (and the validating webhook's check of them) stay byte-identical.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import jsonpatch
import pytest

from kai_fractions.admission import server, tls
from kai_fractions.admission.config import AdmissionConfig
from kai_fractions.admission.mutate import mutate
from kai_fractions.admission.validate import validate
from kai_fractions.cli import main

from .reviews import CONFIG, SM, pod, request

RENAMED = "example.com/Ready"
DEFAULT_COMMAND = [
    "kai-fractions", "gate", "--marker-dir", "/kai-fractions/marker",
    "--annotations-file", "/kai-fractions/podinfo/annotations",
    "--termination-log", "/dev/termination-log", "--annotation-prefix", "nvidia.com/container.",
    "--containers", "main,side"]
"""The gate's command as the webhook has always wired it (before the condition was passed)."""


def renamed() -> AdmissionConfig:
    """The webhook's config with the condition renamed (built in each test: before the fix the
    field did not exist, and each test fails on its own)."""
    return dataclasses.replace(CONFIG, condition_name=RENAMED)


def mutated(config: AdmissionConfig) -> dict[str, Any]:
    obj = pod(SM, containers=("main", "side"))
    decision = mutate(request(obj), config)
    assert decision.allowed, decision.message
    return jsonpatch.apply_patch(copy.deepcopy(obj), list(decision.patch))


def gate_command(obj: dict[str, Any]) -> list[str]:
    gate = obj["spec"]["initContainers"][0]
    assert gate["name"] == "kai-fractions-gate"
    return gate["command"]


def test_a_renamed_condition_reaches_the_gate_and_the_pod_is_admitted() -> None:
    """Before, the config had no condition and the gate's command none: the gate named the
    default. Now the command carries it, and the validating webhook admits the pod so wired."""
    obj = mutated(renamed())
    assert gate_command(obj) == [*DEFAULT_COMMAND, "--condition-name", RENAMED]
    assert validate(request(obj), renamed()).allowed


def test_with_the_default_condition_the_gate_command_is_unchanged() -> None:
    """No `--condition-name` for the default: pods a default install wires stay as they were,
    and one wired by an earlier webhook still passes the validating webhook's exact check."""
    config = dataclasses.replace(CONFIG, condition_name="gpu-fractioning.nvidia.com/Ready")
    obj = mutated(config)
    assert gate_command(obj) == DEFAULT_COMMAND
    assert gate_command(obj) == gate_command(mutated(CONFIG))
    assert validate(request(obj), config).allowed


def test_a_gate_wired_before_the_rename_is_still_admitted() -> None:
    """A webhook not yet told of the renamed condition (an earlier release, a replica mid-way
    through a rollout) wires the gate without the flag: it checks the same, only its line names
    the default condition, so the validating webhook does not refuse the pod for it."""
    obj = mutated(CONFIG)
    assert validate(request(obj), renamed()).allowed


@pytest.mark.parametrize("config", [CONFIG, None], ids=["default", "renamed to Y"])
def test_a_gate_told_another_valid_condition_is_admitted(config) -> None:
    """A second look: `/mutate` and `/validate` may reach different replicas mid-way through a
    rollout (or a rollback) of a rename, each told another name; the gate waits and judges the
    same whichever it names, so a gate wired for X is admitted by a webhook told the default,
    or Y. Before, such pods were refused while the rollout lasted."""
    obj = mutated(renamed())
    validator = config if config is not None else dataclasses.replace(
        renamed(), condition_name="y.example.com/Ready")
    assert validate(request(obj), validator).allowed


@pytest.mark.parametrize("edit", ["bad name", "--other"], ids=["invalid name", "other flag"])
def test_a_gate_whose_condition_flag_is_not_a_valid_name_is_refused(edit: str) -> None:
    """Only a valid condition name is let through (the chart's rule), and only in the place
    the webhook puts it; a gate with no command at all is still refused."""
    obj = mutated(renamed())
    command = obj["spec"]["initContainers"][0]["command"]
    if edit == "--other":
        command[-2] = "--other"
    else:
        command[-1] = edit
    decision = validate(request(obj), renamed())
    assert not decision.allowed
    assert "spec.initContainers[0].command: must be exactly what the admission webhook " \
        "injects into kai-fractions-gate" in decision.message
    del obj["spec"]["initContainers"][0]["command"]  # the image's own entrypoint: no gate
    decision = validate(request(obj), renamed())
    assert not decision.allowed
    assert "spec.initContainers[0].command: must be exactly" in decision.message


@pytest.mark.parametrize("name", ["", "Ready", "example.com/", "Example.com/Ready",
                                  "example.com/Ready now", "example/Ready"])
def test_the_config_refuses_a_name_that_is_no_domain_prefixed_condition(name: str) -> None:
    with pytest.raises(ValueError, match=r"^condition_name: "):
        AdmissionConfig(gate_image="img", condition_name=name)


def test_the_admission_server_takes_the_condition_from_its_flag(monkeypatch, capsys) -> None:
    """`--condition-name` (the chart passes `nodeCondition.name`) sets the config; a bad one is
    a usage error naming the flag."""
    seen: list[AdmissionConfig] = []

    def make_server(listen: str, config: AdmissionConfig, *_: Any) -> None:
        seen.append(config)
        raise OSError("stopped here by the test")

    monkeypatch.setattr(tls, "ReloadingContext", lambda *_: None)
    monkeypatch.setattr(server, "make_server", make_server)
    argv = ["admission", "--tls-cert", "/nonexistent/c", "--tls-key", "/nonexistent/k",
            "--gate-image", "img"]
    assert main([*argv, "--condition-name", RENAMED]) == 2
    assert main(argv) == 2
    assert [c.condition_name for c in seen] == [RENAMED, "gpu-fractioning.nvidia.com/Ready"]
    capsys.readouterr()
    assert main([*argv, "--condition-name", "Ready"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kai-fractions admission: --condition-name: "), err
    assert len(seen) == 2
