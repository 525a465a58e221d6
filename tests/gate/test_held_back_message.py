"""A new pod the node agent holds pending gets no event (Warnings go only to pods that had a
marker in this boot): its gate's messages are where an operator starts, so they must say where
the agent's reason is, not only ask whether the agent runs."""

from __future__ import annotations

import io
from pathlib import Path

from kai_fractions.contract import DEFAULT_KEYS
from kai_fractions.gate import GateOptions, run_gate
from tests.agent.builders import Rig, binder_annotations, pod, result_of

from .pods import UID, bound_annotations, downward_file
from .test_gate import BOOT, FakeClock

CONDITION = "gpu-fractioning.nvidia.com/Ready"
POINTERS = ("`kai-fractions inspect pod NS/NAME`", CONDITION, "`kubectl describe node`")


def gate(annotations: dict[str, str], marker_dir: Path, uid: str, boot_id: str,
         tmp_path: Path) -> tuple[int, str, str]:
    """Runs the gate to its timeout: (exit code, termination message, stderr)."""
    (tmp_path / "annotations").write_text(downward_file(annotations))
    opts = GateOptions(marker_dir=marker_dir, annotations_file=tmp_path / "annotations",
                       pod_uid=uid, timeout=2.0, poll_interval=0.5,
                       termination_log=tmp_path / "termination-log", keys=DEFAULT_KEYS,
                       boot_id=boot_id, containers=("main",))
    clock, err = FakeClock(), io.StringIO()
    code = run_gate(opts, clock=clock, sleep=clock.sleep, stdout=io.StringIO(), stderr=err)
    return code, (tmp_path / "termination-log").read_text(), err.getvalue()


def test_waiting_for_a_first_marker_names_where_the_agents_reason_is(tmp_path: Path) -> None:
    """Before, the gate said only that the marker was not written yet, and at the timeout asked
    "is the kai-fractions node agent running on this node?", though an agent that runs and
    holds the pod back knows why. Now both the progress line (`kubectl logs`) and the
    termination message name `kai-fractions inspect pod` and the node condition, and keep an
    absent agent as one possibility."""
    (tmp_path / "markers").mkdir()
    code, log, err = gate(bound_annotations(), tmp_path / "markers" / UID, UID, BOOT, tmp_path)
    waiting = err.splitlines()[0]
    assert code == 1
    for text in (waiting, log):
        assert all(p in text for p in POINTERS), text
        assert "holds the pod pending (the pod's node not ready for it" in text
        assert "missing or Unknown where no node agent runs" in text
    assert "is the kai-fractions node agent running on this node?" not in log
    assert log.count(CONDITION) == 1  # named once, not again by the timeout


def test_a_pod_the_agent_holds_back_on_a_node_not_ready_for_it_is_pointed_to_the_reason(
        tmp_path: Path, short_tmp: Path) -> None:
    """The agent's cgroup limit sets fail (NoPermission: an agent not root): it holds a new
    pod pending MemoryLimitNotInForce and publishes the condition False,
    MemoryLimitsNotSettable, and the pod gets no event. Before, the gate's termination message
    only asked whether the agent runs; now it names the condition the agent publishes (its
    default name) and the command that shows the container's reason."""
    rig = Rig(short_tmp, sm_sharing=False)
    rig.nvml.fail("set_memory_limits", "NoPermission", times=None)
    uid = rig.add(pod("newpod", notes=binder_annotations(devices=rig.gpu0)))["metadata"]["uid"]
    for _ in range(3):
        rig.step()
    held = result_of(rig, uid)
    cond = rig.agent.condition()
    assert (held.state.value, held.reason) == ("pending", "MemoryLimitNotInForce")
    assert (cond.ready, cond.reason) == (False, "MemoryLimitsNotSettable")
    assert rig.options.condition_name == CONDITION
    assert rig.cluster.event_reasons(uid) == []  # why the gate's message must point there
    annotations = dict(rig.cluster.pods[uid]["metadata"]["annotations"])
    code, log, _ = gate(annotations, Path(rig.options.marker_dir) / uid, uid,
                        rig.reconciler.markers.boot_id, tmp_path)
    assert code == 1
    assert all(p in log for p in POINTERS), log
