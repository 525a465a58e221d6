"""The demo's session and story in this process: other node settings (from --config), and
nothing left running afterwards."""

from __future__ import annotations

import io
import re
import threading
import time
from pathlib import Path

import pytest
import yaml

from kai_fractions.contract.before_bind import FRACTION_LIMIT_NOT_BOUND
from kai_fractions.demo.config import config_from_dict
from kai_fractions.demo.kubelet import container_env
from kai_fractions.demo.scenario import Scenario
from kai_fractions.demo.session import DemoSession
from kai_fractions.node.config import WatchdogPolicy

from .expected import (
    EXAMPLES,
    PLACEMENT,
    admission_warnings,
    expected_rows,
    parse_tables,
    row_cells,
)


def run(config_data: dict, seen: list | None = None) -> tuple[str, list[str], DemoSession]:
    """`seen` gets the pods and the simulated MPS daemon's namespaces as the story ends."""
    session = DemoSession(config_from_dict(config_data))
    out = io.StringIO()
    progress: list[str] = []
    try:
        session.start()
        Scenario(session, out, progress.append).run()
        if seen is not None:
            pods = session.core.list_pod_for_all_namespaces()
            node = session.core.read_node(session.config.node)
            seen += [session.api_client.sanitize_for_serialization(pods)["items"],
                     set(session.mps.namespaces),
                     session.api_client.sanitize_for_serialization(node)]
    finally:
        session.stop()
    return out.getvalue(), progress, session


@pytest.fixture(scope="module")
def default_run():
    before = set(threading.enumerate())
    seen: list = []
    out, progress, session = run({}, seen)
    return out, progress, session, before, seen


def test_nothing_keeps_running_after_stop(default_run):
    _, _, session, before, _ = default_run
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not any(not t.daemon for t in left):
            break
        time.sleep(0.05)
    assert [t.name for t in left if not t.daemon] == []
    assert not session.workdir.exists()


def test_the_sm_sharing_container_mounts_exactly_the_namespace_it_is_given(default_run):
    """Webhook, mirror and agent agree: the namespace the webhook named as the pod was created
    is the one the agent made on the MPS daemon, the container's only MPS mount, and where its
    CUDA_MPS_PIPE_DIRECTORY points."""
    pods, namespaces, _ = default_run[4]
    mounted = [(p, c, m) for p in pods for c in p["spec"]["containers"]
               for m in c.get("volumeMounts") or [] if m["name"] == "kai-fractions-mps"]
    assert mounted  # the story has an sm-sharing container
    for pod, container, mount in mounted:
        name = pod["metadata"]["annotations"][
            f"kai-fractions.io/container.{container['name']}.mps-namespace"]
        env = container_env(pod, container["name"])
        assert mount == {"name": "kai-fractions-mps", "subPath": name,
                         "mountPath": f"/run/kai-fractions/mps/shared/{name}"}
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == mount["mountPath"]
        assert name in namespaces


def _normalized(text: str) -> str:
    """Without what changes from run to run: temp paths, ports, pod UIDs (in cgroup paths too),
    pids."""
    text = re.sub(r"/tmp/kf-demo-\w+", "/tmp/kf-demo-X", text)
    text = re.sub(r"-pod[0-9a-f_]{36}\.slice", "-podUID.slice", text)
    text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", text)
    text = re.sub(r"of pod [0-9a-f-]{36}", "of pod UID", text)
    return re.sub(r"pids? \d+(, \d+)*", "pid N", text)


def test_the_readme_shows_a_real_run(default_run):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("A real run:\n\n```\n", 1)[1].split("```", 1)[0]
    assert _normalized(block) == _normalized(default_run[0])


def test_four_gpus_place_every_example():
    placement = {**PLACEMENT, "multi-device-fraction": (1, 2), "sm-sharing": (3,)}
    out, _, _ = run({"gpus": [{"model": "H100-80GB", "count": 4}]})
    gpus, unplaced, reasons = parse_tables(out)
    expected = expected_rows(placement=placement)
    assert (unplaced, reasons) == ([], [])
    for index, (_uuid, _mode, rows) in gpus.items():
        want = sorted(row_cells(e) for e in expected if e.gpus and index in e.gpus)
        if index in (1, 2):  # the two-GPU container: 3/4 of its request on each GPU
            want = [[*cells[:2], f"{cells[2]} x2", *cells[3:]] for cells in want]
        assert rows == want, f"GPU {index}"


def test_a_node_without_sm_sharing_refuses_the_sm_sharing_pod():
    out, progress, _ = run({"sm_sharing": False})
    gpus, _, reasons = parse_tables(out)
    [row] = gpus[1][2]
    assert row[0] == "default/sm-sharing/server"
    assert (row[5], row[6]) == ("n/a", "refused (SmSharingDisabled)")
    message = ("the container asks for compute mode sm-sharing but this node runs without MPS "
               "(--no-sm-sharing): use time-slicing, or schedule it to a node with sm-sharing "
               "enabled")
    assert f"default/sm-sharing/server: SmSharingDisabled: {message}" in reasons
    assert any(line == ("gate default/sm-sharing: FAILED (exit 1): container 'server' refused "
                        f"by the node agent: SmSharingDisabled: {message}")
               for line in progress), progress


@pytest.mark.parametrize("data, error", [
    ({"gpus": []}, "gpus: must be a non-empty list of mappings such as "
                   "{model: H100-80GB, count: 2}"),
    ({"colour": "red"}, "unknown key(s) colour; known: node, gpus, driver_version, sm_sharing, "
                        "memory_enforcement, watchdog_policy, reserve_mib, namespace, examples"),
])
def test_bad_configs(data, error):
    from kai_fractions.demo.config import DemoConfigError

    with pytest.raises(DemoConfigError) as e:
        config_from_dict(data)
    assert str(e.value) == error


def test_the_watchdog_policy_is_report_unless_set():
    """`report` by default, as the node agent's --watchdog-policy."""
    assert config_from_dict({}).watchdog_policy is WatchdogPolicy.REPORT
    assert config_from_dict({"watchdog_policy": "kill"}).watchdog_policy is WatchdogPolicy.KILL


def examples(tmp_path: Path, *names: str) -> str:
    """A directory holding only these of examples/."""
    for name in names:
        (tmp_path / name).write_text((EXAMPLES / name).read_text())
    return str(tmp_path)


def test_the_verdict_over_the_cap_follows_the_tier_the_agent_applied(tmp_path: Path):
    """Only a `kill` watchdog in force: the TIER says watchdog, so the allocation succeeds and
    the watchdog stops the process afterwards (LimitEnforced), although the container's env
    carries an MPS pinned limit. The demo's killer records the stop and signals nothing, and
    the section says so."""
    out, _, session = run({"memory_enforcement": "watchdog", "watchdog_policy": "kill",
                           "examples": examples(tmp_path, "sm-sharing.yaml")})
    gpus, _, _ = parse_tables(out)
    [row] = gpus[0][2]
    assert (row[0], row[6], row[7]) == ("default/sm-sharing/server", "enforced", "watchdog")
    assert "\nCap held:\n" not in out and "mps-pinned ->" not in out
    section = out.split("\nViolation caught:\n", 1)[1].split("\n\n", 1)[0]
    pid = int(re.search(r"\(tier watchdog\): its process \(pid (\d+)\)", section)[1])
    assert "the allocation succeeds, no hard limit stops it" in section
    assert ("-> Event Warning LimitEnforced on pod default/sm-sharing: container server: "
            f"process {pid} terminated for using more GPU memory on ") in section
    assert "LimitViolation" not in out
    assert session.node_config.watchdog_policy is WatchdogPolicy.KILL  # the agent's
    assert pid in session.killer.killed  # recorded, not signalled
    assert (f"simulated: the demo's process killer recorded the stop of pid {pid} and sent "
            "no signal") in section


def test_a_report_watchdog_alone_caps_nothing_so_the_container_is_refused(tmp_path: Path):
    """The same node with the default `report` watchdog: it would stop nothing, so the agent
    refuses the container (MemoryLimitsUnsupported, saying what to change) instead of letting
    it run uncapped, its gate fails, and no container runs to be pushed over its cap. With no
    tier that caps anything, the node condition is False."""
    out, progress, session = run({"memory_enforcement": "watchdog",
                                  "examples": examples(tmp_path, "sm-sharing.yaml")})
    gpus, _, reasons = parse_tables(out)
    [row] = gpus[0][2]
    assert (row[0], row[6], row[7]) == ("default/sm-sharing/server",
                                        "refused (MemoryLimitsUnsupported)", "none")
    [reason] = reasons
    assert reason.startswith("default/sm-sharing/server: MemoryLimitsUnsupported: cannot cap "
                             "this container's GPU memory: ")
    assert "set --watchdog-policy=kill" in reason
    assert "gpu-fractioning.nvidia.com/Ready=False" in out
    assert any(line.startswith("gate default/sm-sharing: FAILED (exit 1): container 'server' "
                               "refused by the node agent: MemoryLimitsUnsupported: ")
               for line in progress), progress
    assert "\nOver the cap:\n  (no running container to push over its cap: the node agent " \
           "refused the fractional containers it could not cap, see the reasons above)\n" in out
    assert "LimitViolation" not in out and "LimitEnforced" not in out
    assert session.killer.calls == []


def test_what_nothing_caps_is_said_as_it_is(tmp_path: Path, monkeypatch):
    """Were a running row's cap held by nothing (the agent never applies a container so: a
    `report` watchdog is no limit in force; here the demo is made to forget the mps-pinned
    limit the agent reports), the section would say that nothing stops it, under "Over the
    cap", not that a tier held or the watchdog caught it."""
    from kai_fractions.demo import scenario

    held_by = scenario._held_by
    monkeypatch.setattr(scenario, "_held_by",
                        lambda report, row: held_by(report, row) - {"mps-pinned"})
    out, _, session = run({"memory_enforcement": "mps-pinned,watchdog",
                           "examples": examples(tmp_path, "sm-sharing.yaml")})
    section = out.split("\nOver the cap:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    [line] = section
    assert line.startswith("  default/sm-sharing/server on GPU 0 (tier mps-pinned): ")
    assert line.endswith(": the allocation succeeds and nothing stops it: no limit the node "
                         "agent reports in force for it (none) caps it")
    assert "Violation caught" not in out and "Cap held" not in out
    assert session.killer.calls == []


def test_the_report_waits_for_the_node_condition(tmp_path: Path):
    """Nothing runs on the node (the only pod does not fit), so nothing else makes the story
    wait for the agent: the report must still show the condition it publishes."""
    out, _, _ = run({"gpus": [{"count": 1}],
                     "examples": examples(tmp_path, "multi-device-fraction.yaml")})
    assert ("\nnode demo-node  nvidia.com/gpu.memory=81559  "
            "gpu-fractioning.nvidia.com/Ready=True\n") in out
    assert "no node agent has reported" not in out


def test_a_node_with_two_models(tmp_path: Path):
    seen: list = []
    out, _, _ = run({"gpus": [{"model": "H100-80GB"}, {"model": "T4"}],
                     "examples": examples(tmp_path, "memory-request.yaml")}, seen)
    assert out.startswith("kai-fractions demo: 1 fractional containers from "
                          f"{tmp_path.name}/ on node demo-node (1 x NVIDIA H100 80GB HBM3, "
                          "1 x Tesla T4, simulated)\n")
    labels = seen[2]["metadata"]["labels"]
    # GPU feature discovery labels one model on a mixed node: the one the memory label names.
    assert {key: labels[key] for key in ("nvidia.com/gpu.memory", "nvidia.com/gpu.product",
                                         "nvidia.com/gpu.count")} == {
        "nvidia.com/gpu.memory": "15360", "nvidia.com/gpu.product": "Tesla-T4",
        "nvidia.com/gpu.count": "1"}
    assert seen[2]["status"]["capacity"]["nvidia.com/gpu"] == "2"


def test_the_demos_nvml_takes_limits_only_on_the_nodes_cgroups(default_run):
    from kai_fractions.node.errors import NvmlUnknown

    session = default_run[2]
    nvml = session.nvml
    assert (nvml.cgroup_root, nvml.cgroup_tree) == ("/sys/fs/cgroup", session.cgroup_fs)
    nvml.init()
    try:
        with pytest.raises(NvmlUnknown, match="is not a cgroup"):
            nvml.set_memory_limits(nvml.gpus[0].uuid, "/kubepods.slice/x.slice", 1, 2)
    finally:
        nvml.shutdown()


PATCHED = "; the demo binds it as a patched KAI would"


def test_the_admission_warning_is_printed_under_its_row(default_run):
    """Before, the demo bound examples/gpu-fraction-with-limit.yaml and showed it enforced while
    dropping the warning its admission gave (upstream KAI main may never bind it): the progress
    line printed only what the webhook wired. Now the warning is a `!` line under its GPU, and
    says that the demo binds it as a patched KAI would; the progress line counts it."""
    out, progress = default_run[0], default_run[1]
    assert admission_warnings(out) == {"GPU 0": [
        f"default/gpu-fraction-with-limit/worker: admission warning: gpu-fraction.limit: "
        f"{FRACTION_LIMIT_NOT_BOUND} (got '0.5'){PATCHED}"]}
    [admitted] = [line for line in progress
                  if line.startswith("admitted default/gpu-fraction-with-limit ")]
    assert admitted.endswith("; 1 admission warning (printed with the report)")
    assert not any("admission warning" in line for line in progress if line != admitted)
    assert "\nAdmitted with warnings:\n" not in out


def _manifest(tmp_path: Path, name: str, doc: dict) -> None:
    (tmp_path / name).write_text(yaml.safe_dump(doc))


def test_every_admission_warning_is_printed(tmp_path: Path):
    """Each warning of either webhook is printed, for every pod: the mutating webhook's own
    (here: no schedulerName), which the demo dropped before as well, under the row; on a pod
    the demo could not bind, with no word of a patched KAI (it bound nothing); and for a pod
    with no row (not fractional), in a section of its own after the table."""
    memory = yaml.safe_load((EXAMPLES / "memory-request.yaml").read_text())
    del memory["spec"]["schedulerName"]
    _manifest(tmp_path, "memory-request.yaml", memory)
    two = yaml.safe_load((EXAMPLES / "gpu-fraction-with-limit.yaml").read_text())
    two["metadata"]["name"] = "two-gpus"
    two["metadata"]["annotations"]["gpu-fraction-num-devices"] = "2"
    _manifest(tmp_path, "two-gpus.yaml", two)
    _manifest(tmp_path, "plain.yaml", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "plain", "annotations": {"gpu-fraction-container-name": ""}},
        "spec": {"containers": [{"name": "main", "image": "busybox"}]}})
    out, progress, _ = run({"gpus": [{"count": 1}], "examples": str(tmp_path)})
    found = admission_warnings(out)
    [scheduler] = found["GPU 0"]
    assert scheduler.startswith("default/memory-request/trainer: admission warning: "
                                "spec.schedulerName: absent, so the default scheduler places "
                                "the pod")
    assert PATCHED not in scheduler
    assert found["not on a GPU"] == [
        f"default/two-gpus/worker: admission warning: gpu-fraction.limit: "
        f"{FRACTION_LIMIT_NOT_BOUND} (got '0.5')"]
    section = out.split("\nAdmitted with warnings:\n", 1)[1].split("\n\n", 1)[0]
    assert section.splitlines() == [
        "  pod default/plain (plain.yaml): gpu-fraction-container-name: is empty and has no "
        "effect: KAI resolves the fraction's container only in a pod that requests a GPU "
        "fraction (gpu-fraction, gpu-memory, or an NvFractions memory request or limit), and "
        "this pod requests none (got '')"]
    assert out.index("\nAdmitted with warnings:\n") < out.index("\nRejected by admission:\n")
    assert sum(line.endswith("; 1 admission warning (printed with the report)")
               for line in progress) == 3


def test_the_cap_held_line_says_the_refusal_is_simulated(default_run):
    """Before, "Cap held" said that the NVML cgroup hard limit held the allocation without a
    word that the NVML refusing it is the demo's (the kill path says `simulated: ...`). Now it
    says so."""
    section = default_run[0].split("\nCap held:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert section[1].startswith("  cgroup -> the allocation fails (out of memory): the NVML "
                                 "cgroup hard limit of 12288 MiB on /sys/fs/cgroup/")
    assert section[1].endswith(" holds it (simulated NVML, as an r615 driver refuses it)")


def test_a_ready_node_gets_no_word_of_binding_to_a_node_kai_would_not(default_run):
    """The note of test_drivers' False nodes is only for them."""
    assert "KAI places no fractional pod" not in default_run[0]
