"""`kai-fractions validate` and long container names: a name KAI's keys cannot hold is an error
naming the container, the key, the 63-character rule and the longest name that fits (as the
validating webhook refuses it); one only the patched binder's `.gpu-compute.portion` cannot
hold is a warning; and a protected derived key of a long-named container is reported under
that container, found by `Keys.derived` of its name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kai_fractions.contract import DEFAULT_KEYS
from kai_fractions.contract import keys as k

from .helpers import cli


def pod(containers: tuple[str, ...], annotations: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "llm", "namespace": "ns", "annotations": annotations},
            "spec": {"schedulerName": "kai-scheduler",
                     "containers": [{"name": c, "image": "registry.example.com/a:1"}
                                    for c in containers]}}


def write(tmp_path: Path, doc: dict[str, Any]) -> str:
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_a_name_kais_keys_cannot_hold_is_an_error(capsys, tmp_path: Path) -> None:
    name = "a-very-long-inference-server-container"  # 38
    manifest = write(tmp_path, pod((name,), {"gpu-fraction": "0.5"}))
    code, out, _ = cli(capsys, "validate", "-f", manifest)
    assert code == 1
    assert out == (
        f"{manifest}:1: ns/llm/{name}: nvidia.com/container.{name}.gpu-memory.request: "
        f"container {name!r} has a 38-character name, too long for this key: Kubernetes "
        "refuses an annotation key whose name (after the '/') is over 63 characters, and this "
        "one's is 67; KAI's binder writes it when it binds the pod (or the user does), so KAI "
        "cannot bind the pod. Name the fractional container with at most 34 characters\n")


def test_a_name_every_kai_takes_is_valid(capsys, tmp_path: Path) -> None:
    manifest = write(tmp_path, pod(("tensorrt-llm-inference-server",), {"gpu-fraction": "0.5"}))
    code, out, err = cli(capsys, "validate", "-f", manifest)
    assert (code, out, err) == (0, "", "1 of 1 object(s) valid\n")


def test_a_name_only_the_patched_binder_cannot_hold_is_a_warning(capsys, tmp_path: Path) -> None:
    name = "b" * 34
    manifest = write(tmp_path, pod((name,), {"gpu-fraction": "0.5"}))
    code, out, err = cli(capsys, "validate", "-f", manifest)
    assert code == 0
    assert f"nvidia.com/container.{name}.gpu-compute.portion: " in out + err
    assert "patched KAI binder" in out + err


def test_a_protected_derived_key_is_reported_under_its_long_named_container(
        capsys, tmp_path: Path) -> None:
    name = "tensorrt-llm-inference-server"
    digest = DEFAULT_KEYS.derived(name, k.DERIVED_PLAN_DIGEST)
    assert digest.startswith("kai-fractions.io/container.tensorrt-llm-in_")
    manifest = write(tmp_path, pod(("sidecar", name), {
        f"nvidia.com/container.{name}.gpu-memory.request": "8Gi", digest: "sha256:x"}))
    code, out, _ = cli(capsys, "validate", "-f", manifest)
    assert code == 1
    assert f"{manifest}:1: ns/llm/{name}: {digest}: is a protected key" in out
