"""The agent's metrics over in-memory fakes: the gpu-fractioning series (one per pod and GPU,
upstream's labels only, SM use clamped and normalized as upstream metricsd does), the
per-container kai_fractions series they aggregate, refusals, GPU memory and node readiness.

Upstream facts: NVIDIA gpu-fractioning, `fractioning-manager/metricsd/internal/metrics/
exporter.go` (names, help, labels `namespace, pod, pod_uuid, gpu_uuid, gpu`; `gpu` is the GPU
index) and its collector (SM use summed over the pod's processes and clamped to [0,100];
normalized = SM use / (memory limit / GPU memory), clamped; raw SM use when the fraction is
unknown). Names and label sets are written out literally.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from kai_fractions.node.agent.grpc_service import node_state
from kai_fractions.node.agent.metrics import Usage
from kai_fractions.node.desired import ContainerKey

from .builders import GIB, MIB, Rig, binder_annotations
from .test_reconcile import _running, add_pod, leaf_of

UPSTREAM = {"namespace", "pod", "pod_uuid", "gpu_uuid", "gpu"}
PER_CONTAINER = UPSTREAM | {"node", "container"}
H100_BYTES = 81559 * (1 << 20)


def samples(rig: Rig, name: str) -> dict[frozenset, float]:
    """label set (as items) -> value, for every sample of `name`."""
    out = {}
    for family in rig.agent.metrics.registry.collect():
        for s in family.samples:
            if s.name == name:
                out[frozenset(s.labels.items())] = s.value
    return out


def label_names(rig: Rig, name: str) -> set[frozenset[str]]:
    return {frozenset(k for k, _ in labels) for labels in samples(rig, name)}


def run(rig: Rig, uid: str, pid: int, used: int, sm: int) -> None:
    rig.proc_entry(pid, leaf_of(uid)[len("/sys/fs/cgroup"):])
    rig.nvml.add_process(pid, rig.gpu0, used, sm_percent=sm)


def test_one_upstream_series_per_pod_and_gpu_with_upstream_labels_only(
        short_tmp: Path) -> None:
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig, namespace="team-a")
    assert rig.step().converged
    run(rig, uid, 100, 3 * GIB, 10)
    run(rig, uid, 200, 5 * GIB, 15)
    rig.reconciler.check_usage()

    pod = {"namespace": "team-a", "pod": "p", "pod_uuid": uid, "gpu_uuid": rig.gpu0, "gpu": "0"}
    key = frozenset(pod.items())
    for name in ("gpu_fractioning_gpu_memory_used_bytes",
                 "gpu_fractioning_gpu_sm_utilization_percent",
                 "gpu_fractioning_gpu_sm_utilization_percent_normalized"):
        assert label_names(rig, name) == {frozenset(UPSTREAM)}, name
    assert samples(rig, "gpu_fractioning_gpu_memory_used_bytes") == {key: 8 * GIB}
    assert samples(rig, "gpu_fractioning_gpu_sm_utilization_percent") == {key: 25}
    # the pod's fraction: a 20 GiB limit of an 81559 MiB GPU
    assert samples(rig, "gpu_fractioning_gpu_sm_utilization_percent_normalized") == {
        key: round(25 / (20 * GIB / H100_BYTES), 3)}

    ours = frozenset({**pod, "node": "node-a", "container": "main"}.items())
    for name, want in (("kai_fractions_container_gpu_memory_requested_bytes", 10 * GIB),
                       ("kai_fractions_container_gpu_memory_limit_bytes", 20 * GIB),
                       ("kai_fractions_container_gpu_memory_used_bytes", 8 * GIB),
                       ("kai_fractions_container_gpu_sm_utilization_percent", 25),
                       ("kai_fractions_container_gpu_memory_limit_violations_total", 0)):
        assert label_names(rig, name) == {frozenset(PER_CONTAINER)}, name
        assert samples(rig, name) == {ours: want}, name
    assert samples(rig, "kai_fractions_container_gpu_sm_share_percent") == {}  # time-slicing


def test_pod_series_add_up_its_containers_and_clamp(short_tmp: Path) -> None:
    """KAI gives a pod one fractional container; the pod series would still add up several
    (as upstream adds up a pod's processes): shown on a desired state with a second one."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    rig.step()
    view = rig.reconciler.view
    assert view.desired is not None and view.inventory is not None
    (main,) = view.desired.containers
    side = dataclasses.replace(main, key=ContainerKey(uid, "side"))
    desired = dataclasses.replace(view.desired, containers=(main, side))
    usage = {(main.key, rig.gpu0): Usage(GIB, 70), (side.key, rig.gpu0): Usage(2 * GIB, 60)}
    metrics = rig.agent.metrics
    metrics.update(desired, usage, view.inventory)

    pod = {"namespace": "default", "pod": "p", "pod_uuid": uid, "gpu_uuid": rig.gpu0,
           "gpu": "0"}
    key = frozenset(pod.items())
    assert samples(rig, "gpu_fractioning_gpu_memory_used_bytes") == {key: 3 * GIB}
    assert samples(rig, "gpu_fractioning_gpu_sm_utilization_percent") == {key: 100}  # 130
    assert samples(rig, "gpu_fractioning_gpu_sm_utilization_percent_normalized") == {key: 100}
    # the per-container series keep their own values and sum to the pod's by upstream's labels
    used = samples(rig, "kai_fractions_container_gpu_memory_used_bytes")
    assert {dict(k)["container"]: v for k, v in used.items()} == {"main": GIB, "side": 2 * GIB}
    assert sorted(samples(rig, "kai_fractions_container_gpu_sm_utilization_percent")
                  .values()) == [60, 70]

    # 20 on two 20 GiB limits; then a GPU whose memory is unknown: no fraction, so the raw SM
    # use, as upstream falls back
    usage = {(main.key, rig.gpu0): Usage(GIB, 20)}
    metrics.update(desired, usage, view.inventory)
    assert samples(rig, "gpu_fractioning_gpu_sm_utilization_percent_normalized") == {
        key: round(20 / (40 * GIB / H100_BYTES), 3)}
    blind = dataclasses.replace(view.inventory, devices=tuple(
        dataclasses.replace(d, memory_total=0) for d in view.inventory.devices))
    metrics.update(desired, usage, blind)
    assert samples(rig, "gpu_fractioning_gpu_sm_utilization_percent_normalized") == {key: 20}


def test_idle_containers_read_zero_and_series_go_with_the_pod(short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    uid = add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    rig.step()
    rig.reconciler.check_usage()
    for name in ("gpu_fractioning_gpu_memory_used_bytes",
                 "gpu_fractioning_gpu_sm_utilization_percent",
                 "gpu_fractioning_gpu_sm_utilization_percent_normalized",
                 "kai_fractions_container_gpu_memory_used_bytes",
                 "kai_fractions_container_gpu_sm_utilization_percent",
                 "kai_fractions_container_gpu_memory_limit_violations_total"):
        assert list(samples(rig, name).values()) == [0], name
    assert list(samples(rig, "kai_fractions_container_gpu_sm_share_percent").values()) == [50]
    rig.cluster.delete_pod(uid)
    rig.step()
    for family in rig.agent.metrics.registry.collect():
        for s in family.samples:
            assert uid not in s.labels.values(), s


def test_final_refusals_are_series_with_their_reason(short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    add_pod(rig, "first", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    rig.step()
    late = add_pod(rig, "second", notes=binder_annotations(devices=rig.gpu0,
                                                            mode="time-slicing"))
    rig.step()
    refused = samples(rig, "kai_fractions_container_refused")
    assert refused == {frozenset({
        "node": "node-a", "namespace": "default", "pod": "second", "pod_uuid": late,
        "container": "main", "reason": "ComputeModeMix"}.items()): 1}
    assert samples(rig, "kai_fractions_containers")[
        frozenset({"node": "node-a", "state": "refused"}.items())] == 1
    rig.cluster.delete_pod(late)
    rig.step()
    assert samples(rig, "kai_fractions_container_refused") == {}


def test_refusals_and_violations_are_counted_per_node_and_outlive_the_pod(
        short_tmp: Path) -> None:
    """A Job's pod that its gate fails, or that goes over its cap and dies, goes within
    seconds and takes its per-container series with it, often before a scrape: the per-node
    counters (from 0, for an alert's increase()) keep the count."""
    rig = Rig(short_tmp, sm_sharing=False)
    node = {"node": "node-a"}
    refusals = "kai_fractions_node_container_refusals_total"
    violations = "kai_fractions_node_gpu_memory_limit_violations_total"
    zero = {frozenset({**node, "reason": r}.items()): 0 for r in (
        "ContractInvalid", "DeviceNotOnNode", "ComputeModeMix", "MemoryOvercommitted",
        "SmSharingDisabled", "MemoryLimitsUnsupported", "MigNotSupported", "MpsNamespaceTaken",
        "MpsMountMismatch", "PlanChangeRefused", "SignatureInvalid", "SignatureKeyUnknown")}
    # NotBound and SignatureMissing are waits, never counted
    assert samples(rig, refusals) == zero
    assert samples(rig, violations) == {frozenset(node.items()): 0}

    refused = add_pod(rig, "refused", notes=binder_annotations(devices=rig.gpu0,
                                                                mode="sm-sharing"))
    for _ in range(3):  # one refusal, however many passes see it
        rig.step()
    disabled = frozenset({**node, "reason": "SmSharingDisabled"}.items())
    assert samples(rig, refusals) == {**zero, disabled: 1}
    uid = add_pod(rig)
    rig.step()
    _running(rig, uid, 4242, 25 * GIB)
    for _ in range(3):  # one episode, however many checks see it
        rig.reconciler.check_usage()
    assert samples(rig, violations) == {frozenset(node.items()): 1}

    rig.cluster.delete_pod(refused)
    rig.cluster.delete_pod(uid)
    rig.nvml.remove_process(4242)
    rig.step()
    rig.reconciler.check_usage()
    for family in rig.agent.metrics.registry.collect():  # the pods' own series are gone
        for s in family.samples:
            assert refused not in s.labels.values() and uid not in s.labels.values(), s
    assert samples(rig, refusals) == {**zero, disabled: 1}
    assert samples(rig, violations) == {frozenset(node.items()): 1}
    add_pod(rig, "again", notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    rig.step()
    assert samples(rig, refusals) == {**zero, disabled: 2}


def test_usage_is_not_shown_past_what_nvml_can_read(short_tmp: Path) -> None:
    """While NVML does not work nothing is read: the last check's usage could be long over (a
    process that ended), so the gauges and GetNodeState read 0, as for a GPU whose processes
    cannot be listed, until a check reads it again. The plan's request and limit stay."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    assert rig.step().converged
    run(rig, uid, 100, 3 * GIB, 10)
    rig.reconciler.check_usage()
    used = "kai_fractions_container_gpu_memory_used_bytes"
    limit = "kai_fractions_container_gpu_memory_limit_bytes"
    assert list(samples(rig, used).values()) == [3 * GIB]

    def node_used() -> list[int]:
        state = node_state(rig.reconciler.view, "node-a", None, "Ready")
        return [a.memory_used_bytes for a in state.allocations]

    assert node_used() == [3 * GIB]
    rig.nvml.fail("init", "DriverNotLoaded", times=None)
    rig.nvml.fail("driver_version", "DriverNotLoaded", times=None)
    rig.step()
    rig.reconciler.check_usage()  # no inventory: the check reads nothing
    assert list(samples(rig, used).values()) == [0]
    assert list(samples(rig, "kai_fractions_container_gpu_sm_utilization_percent").values()) \
        == [0]
    assert list(samples(rig, "gpu_fractioning_gpu_memory_used_bytes").values()) == [0]
    assert list(samples(rig, limit).values()) == [20 * GIB]
    assert node_used() == [0]

    rig.nvml.clear_failures()  # the driver is back
    assert rig.step().converged
    rig.reconciler.check_usage()
    assert list(samples(rig, used).values()) == [3 * GIB]
    assert node_used() == [3 * GIB]


def test_node_readiness_and_gpu_memory(short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    assert samples(rig, "kai_fractions_node_ready") == {}  # no condition before the first pass
    rig.step()
    assert samples(rig, "kai_fractions_node_ready") == {
        frozenset({"node": "node-a", "reason": "AgentReady"}.items()): 1}
    assert samples(rig, "kai_fractions_gpu_memory_total_bytes") == {
        frozenset({"node": "node-a", "gpu_uuid": g, "gpu": str(i)}.items()): H100_BYTES
        for i, g in enumerate((rig.gpu0, rig.gpu1))}
    rig.nvml.fail("init", "DriverNotLoaded", times=None)
    rig.nvml.fail("driver_version", "DriverNotLoaded", times=None)
    rig.step()
    assert samples(rig, "kai_fractions_node_ready") == {
        frozenset({"node": "node-a", "reason": "NVMLUnavailable"}.items()): 0}


def test_a_process_nvml_lists_without_its_memory_is_counted_and_logged_once(
        short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The watchdog sums a container's processes; one NVML reports no memory for counts as 0,
    so a container over its cap could pass unseen: that must show too."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    assert rig.step().converged
    run(rig, uid, 100, 3 * GIB, 10)
    run(rig, uid, 200, None, 15)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="kai_fractions.node.agent.usage"):
        rig.reconciler.check_usage()
        rig.reconciler.check_usage()
        rig.nvml.processes[-1].used_bytes = GIB  # readable again
        rig.reconciler.check_usage()
    assert samples(rig, "kai_fractions_agent_gpu_usage_unreadable_total") == {
        frozenset({"node": "node-a", "gpu_uuid": rig.gpu0,
                   "reason": "ProcessMemoryUnknown"}.items()): 2}
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]  # began, and ended
    assert caplog.records[0].getMessage() == (
        f"NVML reports no memory for 1 process(es) of managed containers on GPU {rig.gpu0} "
        "(pids 200): the watchdog counts them as 0 until it does")


def test_a_gpu_whose_processes_cannot_be_listed_is_counted_and_logged_once(
        short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A watchdog that cannot see a GPU's processes reads no usage there: that must show, not
    pass for "nothing used" (found by the fail-closed audit)."""
    rig = Rig(short_tmp, sm_sharing=False)
    add_pod(rig)
    assert rig.step().converged
    rig.nvml.fail("running_processes", "Unknown", times=2, device=rig.gpu0)
    with caplog.at_level(logging.INFO, logger="kai_fractions.node.agent.usage"):
        for _ in range(3):
            rig.reconciler.check_usage()
    assert samples(rig, "kai_fractions_agent_gpu_usage_unreadable_total") == {
        frozenset({"node": "node-a", "gpu_uuid": rig.gpu0, "reason": "NVMLError"}.items()): 2}
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]  # began, and ended
    assert caplog.records[0].getMessage().startswith(
        f"cannot list the processes of GPU {rig.gpu0} (NVMLError): ")


def hide(rig: Rig, *pids: int) -> None:
    """NVML lists these pids no more, as for an agent outside the host's pid namespace (NVML
    shows only the caller's); the GPU's memory still counts them."""
    listed = type(rig.nvml).running_processes

    def running_processes(uuid: str):
        return tuple(p for p in listed(rig.nvml, uuid) if p.pid not in pids)

    rig.nvml.running_processes = running_processes  # type: ignore[method-assign]


def unseen_samples(rig: Rig) -> dict[str, float]:
    return {dict(k)["gpu_uuid"]: v for k, v in
            samples(rig, "kai_fractions_agent_gpu_usage_unreadable_total").items()
            if dict(k)["reason"] == "NoProcessesVisible"}


def test_memory_used_by_processes_nvml_does_not_list_is_counted_and_logged_once(
        short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Without the host's pid namespace NVML lists no process of the GPU, with no error: the
    watchdog reads 0 and a container over its cap passes unseen. The GPU's used memory says
    someone is there: that must show, like a GPU whose processes cannot be listed."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    assert rig.step().converged
    run(rig, uid, 100, 30 * GIB, 10)  # over its 20 GiB cap
    hide(rig, 100)
    with caplog.at_level(logging.INFO, logger="kai_fractions.node.agent.usage"):
        rig.reconciler.check_usage()
        rig.reconciler.check_usage()
        assert samples(rig, "kai_fractions_container_gpu_memory_used_bytes") == {
            frozenset({"node": "node-a", "namespace": "default", "pod": "p", "pod_uuid": uid,
                       "container": "main", "gpu_uuid": rig.gpu0, "gpu": "0"}.items()): 0}
        del rig.nvml.running_processes  # listed again
        rig.reconciler.check_usage()
    assert unseen_samples(rig) == {rig.gpu0: 2}
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]  # began, and ended
    assert caplog.records[0].getMessage() == (
        f"GPU {rig.gpu0} has 30720 MiB of memory in use that no process NVML lists accounts "
        "for, and NVML lists no process of its managed containers: the agent may not run in "
        "the host's pid namespace (hostPID), where NVML and /proc show every GPU process; the "
        "watchdog sees no usage there until it does")
    assert caplog.records[1].getMessage() == (
        f"the processes using the memory of GPU {rig.gpu0} are listed again")


def test_hidden_clients_next_to_a_listed_mps_server_are_counted(short_tmp: Path) -> None:
    """sm-sharing: the MPS server the agent's daemon started is in the agent's own pid
    namespace and listed; the containers' clients are not."""
    rig = Rig(short_tmp)
    uid = add_pod(rig, notes=binder_annotations(devices=rig.gpu0, mode="sm-sharing"))
    assert rig.step().converged
    rig.proc_entry(50, "/system.slice/kai-fractions-agent.scope")
    rig.nvml.add_process(50, rig.gpu0, 400 * MIB)  # the MPS server
    run(rig, uid, 100, 6 * GIB, 10)
    hide(rig, 100)
    rig.reconciler.check_usage()
    assert unseen_samples(rig) == {rig.gpu0: 1}


def test_only_memory_of_processes_nvml_does_not_list_is_counted_as_unseen(
        short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Not an idle GPU, processes NVML lists (whoever's), a few hundred MiB of overhead, nor a
    GPU without managed containers."""
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add_pod(rig)
    assert rig.step().converged
    with caplog.at_level(logging.INFO, logger="kai_fractions.node.agent.usage"):
        rig.reconciler.check_usage()  # idle: nothing used, nothing listed
        rig.proc_entry(300, "/system.slice/some-daemon.service")
        rig.nvml.add_process(300, rig.gpu0, 8 * GIB)  # listed, of no managed container
        rig.reconciler.check_usage()
        run(rig, uid, 100, 3 * GIB, 10)  # the container's own, listed
        rig.nvml.add_process(400, rig.gpu0, 4 * GIB)  # one not listed, next to it
        hide(rig, 400)
        rig.reconciler.check_usage()
        rig.nvml.remove_process(100)
        rig.nvml.remove_process(400)
        rig.nvml.add_process(400, rig.gpu0, 512 * MIB)  # hidden, but no more than overhead
        rig.reconciler.check_usage()
        rig.nvml.add_process(500, rig.gpu1, 4 * GIB)  # hidden on a GPU with no managed one
        hide(rig, 400, 500)
        rig.reconciler.check_usage()
        assert unseen_samples(rig) == {} and caplog.records == []
        rig.nvml.add_process(600, rig.gpu0, 2 * GIB)  # now hidden memory, beyond overhead
        hide(rig, 400, 500, 600)
        rig.reconciler.check_usage()
    assert unseen_samples(rig) == {rig.gpu0: 1}
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert caplog.records[0].getMessage().startswith(
        f"GPU {rig.gpu0} has 2560 MiB of memory in use that no process NVML lists accounts for")
