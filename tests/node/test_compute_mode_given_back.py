"""A GPU the agent put in EXCLUSIVE_PROCESS for sm-sharing gets its earlier mode back once no
fractional container is left on it (`kai_fractions.node.engine_compute_modes`): a whole-GPU pod
placed there next may need more than one CUDA context. Only a mode the agent changed, only
while no process runs there, and across an agent restart of the same boot (the ledger)."""

from __future__ import annotations

from pathlib import Path

from kai_fractions.node.engine_compute_modes import MODE_NOT_RECORDED, MODE_NOT_RESTORED
from kai_fractions.node.limit_ledger import FileLimitLedger
from kai_fractions.node.nvml import GpuComputeMode

from .nodepods import GPU0, GPU1
from .test_engine import Node, sm_pod, ts_pod

EXCLUSIVE, DEFAULT = GpuComputeMode.EXCLUSIVE_PROCESS, GpuComputeMode.DEFAULT


def sets(node: Node) -> list[tuple]:
    return [c.args for c in node.nvml.calls_of("set_compute_mode")]


def test_the_mode_comes_back_when_the_last_sm_sharing_container_leaves(tmp_path: Path) -> None:
    node = Node(tmp_path / "cgroup")
    node.apply(sm_pod())
    assert node.nvml.gpu(GPU0).compute_mode is EXCLUSIVE
    assert node.ledger.modes == {GPU0: "DEFAULT"}  # recorded before the switch

    report = node.apply()  # the pod is gone
    assert node.nvml.gpu(GPU0).compute_mode is DEFAULT
    assert report.compute_modes_set == ((GPU0, DEFAULT),)
    assert node.ledger.modes == {}
    assert sets(node) == [(GPU0, EXCLUSIVE), (GPU0, DEFAULT)]
    node.apply()
    assert len(sets(node)) == 2  # nothing more to do


def test_a_mode_the_agent_did_not_set_is_left_as_it_is(tmp_path: Path) -> None:
    node = Node(tmp_path / "cgroup")
    node.nvml.gpu(GPU0).compute_mode = EXCLUSIVE  # an administrator's choice
    node.apply(sm_pod())
    node.apply()
    assert node.nvml.gpu(GPU0).compute_mode is EXCLUSIVE and sets(node) == []
    assert node.ledger.modes == {}


def test_a_restarted_agent_still_gives_it_back(tmp_path: Path) -> None:
    node = Node(tmp_path / "cgroup")
    node.apply(sm_pod())
    node.engine = node.new_engine()  # same ledger: the host's record of this boot
    node.apply()
    assert node.nvml.gpu(GPU0).compute_mode is DEFAULT


def test_not_while_a_process_still_runs_on_the_gpu(tmp_path: Path) -> None:
    node = Node(tmp_path / "cgroup")
    node.apply(sm_pod())
    node.nvml.add_process(4242, GPU0, 1 << 30)  # an MPS server not gone yet, or a new workload
    node.apply()
    assert node.nvml.gpu(GPU0).compute_mode is EXCLUSIVE and node.ledger.modes == {
        GPU0: "DEFAULT"}
    node.nvml.remove_process(4242)
    node.apply()
    assert node.nvml.gpu(GPU0).compute_mode is DEFAULT


def test_a_failed_give_back_is_an_issue_and_tried_again(tmp_path: Path) -> None:
    node = Node(tmp_path / "cgroup")
    node.apply(sm_pod())
    node.nvml.fail("set_compute_mode", "NoPermission", times=1)
    report = node.apply()
    [issue] = [i for i in report.issues if i.reason == MODE_NOT_RESTORED]
    assert GPU0 in issue.message and f"nvidia-smi -i {GPU0} -c DEFAULT" in issue.message
    assert node.nvml.gpu(GPU0).compute_mode is EXCLUSIVE
    report = node.apply()
    assert node.nvml.gpu(GPU0).compute_mode is DEFAULT
    assert not [i for i in report.issues if i.reason == MODE_NOT_RESTORED]


def test_a_mode_changed_by_someone_else_since_is_theirs(tmp_path: Path) -> None:
    node = Node(tmp_path / "cgroup")
    node.apply(sm_pod())
    node.nvml.gpu(GPU0).compute_mode = GpuComputeMode.PROHIBITED  # by hand, meanwhile
    node.apply()
    assert node.ledger.modes == {}
    node.nvml.gpu(GPU0).compute_mode = EXCLUSIVE  # and later an administrator's choice
    node.apply()
    assert node.nvml.gpu(GPU0).compute_mode is EXCLUSIVE


def test_a_time_slicing_container_placed_there_next_ends_the_record(tmp_path: Path) -> None:
    node = Node(tmp_path / "cgroup")
    node.apply(sm_pod())
    node.apply(ts_pod(device=GPU0))  # the plan itself wants DEFAULT there now
    assert node.nvml.gpu(GPU0).compute_mode is DEFAULT and node.ledger.modes == {}


def test_a_record_that_cannot_be_saved_does_not_hold_sm_sharing_back(tmp_path: Path) -> None:
    node = Node(tmp_path / "cgroup")

    def refuse(switched) -> None:
        raise OSError(28, "No space left on device")

    node.ledger.save_modes = refuse
    report = node.apply(sm_pod())
    assert node.nvml.gpu(GPU0).compute_mode is EXCLUSIVE
    [issue] = [i for i in report.issues if i.reason == MODE_NOT_RECORDED]
    assert "No space left on device" in issue.message
    assert report.containers[(sm_pod().uid, "main")].state.value == "applied"


def test_the_file_ledger_keeps_the_modes_for_this_boot_only(tmp_path: Path) -> None:
    FileLimitLedger(tmp_path, "boot-1").save_modes({GPU1: "DEFAULT", GPU0: "PROHIBITED"})
    assert FileLimitLedger(tmp_path, "boot-1").load_modes() == {
        GPU0: "PROHIBITED", GPU1: "DEFAULT"}
    assert FileLimitLedger(tmp_path, "boot-2").load_modes() == {}  # a reboot resets modes
    assert FileLimitLedger(tmp_path, "boot-1").load() == set()  # the limits' file is apart
