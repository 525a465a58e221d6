"""The watchdog over a fake /proc tree: report or kill per policy; drain before kill; never a
process of no managed container."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kai_fractions.contract import MIB
from kai_fractions.node.mps.control import MpsControl
from kai_fractions.node.mps.errors import MpsError
from kai_fractions.node.mps.runner import RecordingRunner
from kai_fractions.node.procfs import Procfs
from kai_fractions.node.watchdog import (
    ContainerUsage,
    ManagedContainer,
    SignalKiller,
    Violation,
    Watchdog,
)
from kai_fractions.sim.killer import RecordingKiller
from kai_fractions.sim.mps import FakeMpsControl

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"
POD_A = "aaaaaaaa-1111-4111-8111-aaaaaaaaaaaa"
POD_B = "bbbbbbbb-2222-4222-8222-bbbbbbbbbbbb"
CID_A = "a1" * 32
CID_A2 = "a2" * 32
CID_B = "b1" * 32
CAP = 1024 * MIB


@dataclass(frozen=True)
class Proc:
    pid: int
    used_bytes: int | None


class Clock:
    def __init__(self) -> None:
        self.now = 50.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def systemd(pod: str, cid: str) -> str:
    return (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
            f"{pod.replace('-', '_')}.slice/cri-containerd-{cid}.scope\n")


def cgroupfs(pod: str, cid: str) -> str:
    return f"0::/kubepods/besteffort/pod{pod}/{cid}\n"


class FakeProc:
    """A fake /proc: <root>/<pid>/cgroup and stat."""

    def __init__(self, root):
        self.root = root

    def add(self, pid: int, cgroup: str) -> None:
        d = self.root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup").write_text(cgroup)
        (d / "stat").write_text(f"{pid} (python3) S 1 {pid} {pid} 0 -1\n")

    def remove(self, pid: int) -> None:
        shutil.rmtree(self.root / str(pid))


@pytest.fixture
def proc(tmp_path):
    fake = FakeProc(tmp_path)
    fake.add(100, systemd(POD_A, CID_A))      # managed container A
    fake.add(101, systemd(POD_A, CID_A))      # managed container A, second process
    fake.add(200, cgroupfs(POD_B, CID_B))     # pod B: not managed
    fake.add(300, "0::/system.slice/some-daemon.service\n")  # a host process
    fake.add(400, systemd(POD_A, CID_A2))     # pod A's other container: listed on GPU1, where
    # no container of pod A is capped, it is nobody's (on GPU0 it would count for the pod's
    # fractional container: test_watchdog_listings)
    return fake


def managed() -> list[ManagedContainer]:
    return [ManagedContainer.uniform(POD_A, "trainer", f"containerd://{CID_A}", CAP, [GPU0])]


def watchdog(proc, policy, killer=None, mps=None, clock=None) -> Watchdog:
    return Watchdog(policy, Procfs(proc.root), killer or RecordingKiller(), mps, clock or Clock())


OVER = {GPU0: [Proc(100, 800 * MIB), Proc(101, 400 * MIB), Proc(200, 70000 * MIB),
               Proc(300, 70000 * MIB)],
        GPU1: [Proc(400, 70000 * MIB)]}


def test_report_returns_the_violation_and_touches_nothing(proc):
    killer = RecordingKiller()
    mps = FakeMpsControl()
    report = watchdog(proc, "report", killer, mps).check(OVER, managed())
    assert report.violations == (Violation(POD_A, "trainer", f"containerd://{CID_A}", GPU0,
                                           1200 * MIB, CAP, (100, 101)),)
    v = report.violations[0]
    assert v.reason == "GPUMemoryOverCap"
    assert v.message == (f"container trainer of pod {POD_A} uses 1200 MiB of GPU memory on "
                         f"{GPU0}, above its cap of 1024 MiB (pids 100, 101)")
    assert report.actions == ()
    assert killer.calls == [] and mps.calls == []
    assert set(report.unmanaged) == {(GPU0, 200), (GPU0, 300), (GPU1, 400)}
    assert report.checked_at == 50.0


def test_within_cap_is_no_violation_and_usage_is_reported(proc):
    procs = {GPU0: [Proc(100, 600 * MIB), Proc(101, None)], GPU1: [Proc(101, 5 * MIB)]}
    report = watchdog(proc, "kill").check(procs, managed(), sm_percent={100: 30, 101: 12})
    assert report.violations == () and report.actions == ()
    assert report.usage == (
        ContainerUsage(POD_A, "trainer", f"containerd://{CID_A}", GPU0, 600 * MIB, CAP,
                       (100, 101), 42, (101,)),
        # a GPU the container has no cap on: observed, never enforced
        ContainerUsage(POD_A, "trainer", f"containerd://{CID_A}", GPU1, 5 * MIB, None,
                       (101,), 12, ()),
    )


def test_an_idle_managed_container_reports_zero_usage(proc):
    report = watchdog(proc, "report").check({GPU0: []}, managed())
    assert report.usage == (ContainerUsage(POD_A, "trainer", f"containerd://{CID_A}", GPU0, 0,
                                           CAP),)


def test_a_gpu_not_listed_gives_no_usage_and_no_violation(proc):
    """Its listing failed: the usage there is unknown, not 0 (a 0 would end the container's
    violation episode, and the next check would start another)."""
    dog = watchdog(proc, "report")
    two_gpus = [ManagedContainer.uniform(POD_A, "trainer", f"containerd://{CID_A}", CAP,
                                         [GPU0, GPU1])]
    listed = dog.check({GPU0: [Proc(100, 10 * CAP)], GPU1: []}, two_gpus)
    assert [u.device_uuid for u in listed.usage] == [GPU0, GPU1]
    assert [v.device_uuid for v in listed.violations] == [GPU0]
    report = dog.check({GPU1: []}, two_gpus)  # GPU0 could not be listed
    assert [(u.device_uuid, u.used_bytes) for u in report.usage] == [(GPU1, 0)]
    assert report.violations == ()
    assert dog.check({}, two_gpus).usage == ()


def test_kill_drains_mps_clients_first_then_terminates(proc):
    journal: list = []
    mps = FakeMpsControl(calls=journal)
    mps.namespace_create("kf_a")
    mps.attach_client(100, "kf_a")  # 100 is an MPS client, 101 is not
    journal.clear()
    killer = RecordingKiller(journal=journal)
    report = watchdog(proc, "kill", killer, mps).check(OVER, managed())
    assert journal == [
        ("client_list", ()),
        ("client_terminate", (100,)),
        ("terminate", (100,)),
        ("terminate", (101,)),
    ]
    assert [(a.pid, a.step, a.outcome) for a in report.actions] == [
        (100, "drain", "drained"), (100, "terminate", "terminated"),
        (101, "terminate", "terminated")]
    assert killer.killed == [100, 101]
    assert mps.terminated == [100]
    # never another pod, a host process or the pod's unmanaged container
    assert not {200, 300, 400} & set(killer.calls)


def test_kill_drains_legacy_mps_clients_through_their_server(proc):
    journal: list = []
    mps = FakeMpsControl(protocol_v3=False, calls=journal)
    mps.attach_client(101, server_pid=900)
    killer = RecordingKiller(journal=journal)
    watchdog(proc, "kill", killer, mps).check(OVER, managed())
    assert journal == [
        ("get_server_list", ()),
        ("get_client_list", (900,)),
        ("terminate", (100,)),
        ("terminate_client", (900, 101)),
        ("terminate", (101,)),
    ]


def test_no_kill_when_mps_cannot_say_who_its_clients_are(proc):
    mps = FakeMpsControl()
    mps.kill()  # the control daemon is down
    killer = RecordingKiller()
    report = watchdog(proc, "kill", killer, mps).check(OVER, managed())
    assert killer.calls == []
    assert {(a.pid, a.step, a.outcome) for a in report.actions} == {
        (100, "drain", "failed"), (101, "drain", "failed")}
    assert report.actions[0].detail.startswith("MpsDaemonUnreachable: ")
    assert mps.methods_called() == ["client_list"]  # asked once per check
    assert len(report.violations) == 1


@pytest.mark.parametrize("reason", ["MpsDaemonUnreachable", "MpsDaemonBusy", "UnexpectedOutput"])
def test_no_legacy_kill_when_a_server_cannot_list_its_clients(proc, reason):
    """Only a server that exited between the two calls has no client to list; a timeout or a
    busy daemon leaves unknown whether the process is its client: no kill undrained."""
    mps = FakeMpsControl(protocol_v3=False)
    mps.attach_client(100, server_pid=7)
    mps.inject("get_client_list", MpsError(reason, "no answer"))
    killer = RecordingKiller()
    report = watchdog(proc, "kill", killer, mps).check(OVER, managed())
    assert killer.calls == [] and mps.terminated == []
    assert {(a.pid, a.step, a.outcome) for a in report.actions} == {
        (100, "drain", "failed"), (101, "drain", "failed")}


def test_a_legacy_server_that_exited_meanwhile_has_no_client_to_drain(proc):
    mps = FakeMpsControl(protocol_v3=False)
    mps.attach_client(101, server_pid=900)
    mps.inject("get_client_list", MpsError("ServerNotFound", "Server 900 not found"))
    killer = RecordingKiller()
    watchdog(proc, "kill", killer, mps).check(OVER, managed())
    assert killer.killed == [100, 101]


def test_a_time_slicing_container_is_stopped_even_while_mps_cannot_answer(proc):
    """Its processes cannot be MPS clients (it mounts no MPS pipe directory): a daemon that is
    down must not hold the kill of a container over its cap that needs no drain."""
    mps = FakeMpsControl()
    mps.kill()
    killer = RecordingKiller()
    time_slicing = [ManagedContainer.uniform(POD_A, "trainer", f"containerd://{CID_A}", CAP,
                                             [GPU0], mps_client=False)]
    watchdog(proc, "kill", killer, mps).check(OVER, time_slicing)
    assert killer.killed == [100, 101]
    assert mps.methods_called() == []  # MPS is not even asked


def test_a_failed_drain_leaves_that_process_alone(proc):
    mps = FakeMpsControl()
    mps.namespace_create("kf_a")
    mps.attach_client(100, "kf_a")
    mps.inject("client_terminate", MpsError("CommandFailed", "nope"))
    killer = RecordingKiller()
    report = watchdog(proc, "kill", killer, mps).check(OVER, managed())
    assert killer.calls == [101]
    assert (report.actions[0].pid, report.actions[0].outcome, report.actions[0].detail) == (
        100, "failed", "CommandFailed: nope")


def _legacy_control(terminate_answer: str) -> tuple[MpsControl, RecordingRunner]:
    """A real MpsControl over a legacy daemon with server 777, whose client is pid 100."""
    runner = RecordingRunner()
    runner.respond(["/bin/mps"], "777\n", stdin="get_server_list\n")
    runner.respond(["/bin/mps"], "100\n", stdin="get_client_list 777\n")
    runner.respond(["/bin/mps"], terminate_answer, stdin="terminate_client 777 100\n")
    return MpsControl("/bin/mps", "/tmp/p", "/tmp/l", runner, protocol_v3=False,
                      sleep=lambda s: None), runner


def test_a_legacy_drain_that_answers_failure_status_leaves_the_client_alone(proc):
    """The 535 daemon's failure on the server's side prints only its status `1`: that drain
    did not happen, so the client must not be killed mid-kernel."""
    control, _runner = _legacy_control("1\n")
    killer = RecordingKiller()
    report = watchdog(proc, "kill", killer, control).check(OVER, managed())
    assert killer.calls == [101]  # 101 is no client: stopped without a drain
    assert [(a.pid, a.step, a.outcome) for a in report.actions if a.pid == 100] == [
        (100, "drain", "failed")]
    assert "status 1" in report.actions[0].detail


def test_a_legacy_client_that_exited_mid_drain_is_not_a_failed_drain(proc):
    """`Invalid process N!` from terminate_client: the pid is no client any more."""
    control, _runner = _legacy_control("Invalid process 100!\n1\n")
    killer = RecordingKiller()
    report = watchdog(proc, "kill", killer, control).check(OVER, managed())
    assert killer.calls == [100, 101]
    assert [(a.pid, a.step) for a in report.actions] == [(100, "terminate"), (101, "terminate")]


def test_a_client_that_left_mps_meanwhile_is_still_stopped(proc):
    mps = FakeMpsControl()
    mps.namespace_create("kf_a")
    mps.attach_client(100, "kf_a")
    mps.inject("client_terminate", MpsError("ClientNotFound", "gone"))
    killer = RecordingKiller()
    report = watchdog(proc, "kill", killer, mps).check(OVER, managed())
    assert killer.killed == [100, 101]
    assert [(a.pid, a.step) for a in report.actions] == [(100, "terminate"), (101, "terminate")]


def test_without_mps_the_kill_goes_straight_to_terminate(proc):
    killer = RecordingKiller()
    report = watchdog(proc, "kill", killer).check(OVER, managed())
    assert killer.killed == [100, 101]
    assert all(a.step == "terminate" for a in report.actions)


def test_unmanaged_processes_are_never_touched_whatever_they_use(proc):
    killer = RecordingKiller()
    mps = FakeMpsControl()
    procs = {GPU0: [Proc(200, 10**15), Proc(300, 10**15)],
             GPU1: [Proc(200, 10**15), Proc(400, 10**15)]}
    report = watchdog(proc, "kill", killer, mps).check(procs, managed())
    assert report.violations == () and report.actions == ()
    assert killer.calls == [] and mps.calls == []
    # with no managed containers at all, nothing is even considered
    report = watchdog(proc, "kill", killer, mps).check(OVER, [])
    assert report.violations == () and killer.calls == []


def test_pid_1_and_the_agent_itself_are_never_touched(proc):
    proc.add(1, systemd(POD_A, CID_A))
    proc.add(os.getpid(), systemd(POD_A, CID_A))
    killer = RecordingKiller()
    procs = {GPU0: [Proc(1, 10 * CAP), Proc(os.getpid(), 10 * CAP)]}
    report = watchdog(proc, "kill", killer).check(procs, managed())
    assert killer.calls == [] and report.violations == ()


def test_a_pid_that_vanishes_before_the_check_is_ignored(proc):
    proc.remove(101)
    killer = RecordingKiller()
    procs = {GPU0: [Proc(100, 500 * MIB), Proc(101, 10 * CAP)]}
    report = watchdog(proc, "kill", killer).check(procs, managed())
    assert report.violations == () and killer.calls == []
    assert report.unmanaged == ()  # not even listed: it is gone


def test_a_pid_that_vanishes_mid_check_is_not_killed(proc):
    class VanishingKiller(RecordingKiller):
        def terminate(self, pid, still_ours):
            if pid == 100:
                proc.remove(101)  # 101 exits while 100 is being stopped
            return super().terminate(pid, still_ours)

    killer = VanishingKiller()
    report = watchdog(proc, "kill", killer).check(OVER, managed())
    assert killer.killed == [100]
    assert killer.calls == [100]  # 101 was re-checked before the killer got it
    assert (report.actions[-1].pid, report.actions[-1].outcome) == (101, "skipped")


def test_a_pid_reused_by_another_container_is_not_killed(proc):
    class ReusingKiller(RecordingKiller):
        def terminate(self, pid, still_ours):
            proc.add(pid, cgroupfs(POD_B, CID_B))  # the pid now belongs to pod B
            return super().terminate(pid, still_ours)

    killer = ReusingKiller()
    report = watchdog(proc, "kill", killer).check(
        {GPU0: [Proc(100, 10 * CAP)]}, managed())
    assert killer.killed == []
    assert [a.outcome for a in report.actions] == ["skipped"]


def test_policy_is_validated_and_accepts_the_config_enum(proc):
    from kai_fractions.node.config import WatchdogPolicy
    assert watchdog(proc, WatchdogPolicy.KILL).policy == "kill"
    with pytest.raises(ValueError, match="watchdog policy must be one of report, kill"):
        watchdog(proc, "shoot")


def test_the_cgroupfs_layout_and_bare_container_ids(proc):
    proc.add(500, cgroupfs(POD_B, CID_B))
    containers = [ManagedContainer(POD_B, "infer", CID_B, {GPU1: 10 * MIB})]
    report = watchdog(proc, "report").check({GPU1: [Proc(500, 11 * MIB)]}, containers)
    assert [(v.pod_uid, v.pids) for v in report.violations] == [(POD_B, (500,))]


# ---------------------------------------------------------------------------- the real killer


def spawn(code: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


IGNORES_TERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(30)")


def wait_until(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_signal_killer_terminates_with_sigterm_without_waiting():
    p = spawn("import time; print('ready', flush=True); time.sleep(30)")
    clock = Clock()
    killer = SignalKiller(clock, grace=5)
    try:
        assert killer.terminate(p.pid, lambda: True) == "signalled"
        assert clock.slept == []  # the caller is never held
        assert p.wait(timeout=5) == -signal.SIGTERM
        assert killer.progress() == [(p.pid, "terminated")]
        assert killer.progress() == [] and killer.in_progress == frozenset()
    finally:
        p.kill()
        p.wait()


def test_signal_killer_escalates_to_sigkill_at_a_later_progress():
    p = spawn(IGNORES_TERM)
    clock = Clock()
    killer = SignalKiller(clock, grace=5)
    try:
        assert killer.terminate(p.pid, lambda: True) == "signalled"
        clock.now += 4.9
        assert killer.progress() == [] and p.poll() is None  # within the grace period
        assert killer.terminate(p.pid, lambda: True) == "signalled"  # not signalled twice
        clock.now += 0.1
        assert killer.progress() == [(p.pid, "escalated")]
        assert p.wait(timeout=5) == -signal.SIGKILL
        assert killer.progress() == [(p.pid, "killed")]
        assert clock.slept == []
    finally:
        p.kill()
        p.wait()


def test_a_process_that_survives_sigkill_is_reported_once_and_never_signalled_again(
        monkeypatch):
    """A process in uninterruptible sleep (stuck in the kernel or the driver) outlives
    SIGKILL: it is reported `unkillable` (not `killed`), once, and not signalled again."""
    import kai_fractions.node.process_killer as wd

    class Stuck(wd.PidfdPin):
        def exited(self) -> bool:
            return not alive[0]

    alive = [True]
    monkeypatch.setattr(wd, "PidfdPin", Stuck)
    sent: list[int] = []
    real_send = signal.pidfd_send_signal
    monkeypatch.setattr(signal, "pidfd_send_signal",
                        lambda fd, sig: sent.append(sig) or real_send(fd, sig))
    p = spawn(IGNORES_TERM)
    clock = Clock()
    killer = SignalKiller(clock, grace=5, kill_bound=10)
    try:
        assert killer.terminate(p.pid, lambda: True) == "signalled"
        clock.now += 5
        assert killer.progress() == [(p.pid, "escalated")]
        p.wait(timeout=5)  # (really gone; the pin says otherwise, as for a D-state process)
        clock.now += 9.9
        assert killer.progress() == []
        clock.now += 0.1
        assert killer.progress() == [(p.pid, "unkillable")]
        clock.now += 100
        assert killer.progress() == []
        assert killer.terminate(p.pid, lambda: True) == "unkillable"
        assert sent == [signal.SIGTERM, signal.SIGKILL]
        alive[0] = False  # it finally exits
        assert killer.progress() == [(p.pid, "killed")]
    finally:
        p.kill()
        p.wait()


def test_signal_killer_signals_nothing_for_pids_of_another_pid_namespace(tmp_path):
    """An agent whose --proc-root is not its own namespace's /proc (no hostPID) reads pids
    that name other processes here: it stops none of them."""
    p = spawn("import time; print('ready', flush=True); time.sleep(30)")
    try:
        killer = SignalKiller(same_pid_namespace=Procfs(tmp_path).own_pid_namespace)
        assert killer.terminate(p.pid, lambda: True) == "failed"
        assert p.poll() is None  # untouched
    finally:
        p.kill()
        p.wait()


def test_signal_killer_rechecks_ownership_and_handles_gone_pids():
    p = spawn("import time; print('ready', flush=True); time.sleep(30)")
    try:
        assert SignalKiller().terminate(p.pid, lambda: False) == "skipped"
        assert p.poll() is None  # untouched
    finally:
        p.kill()
        p.wait()
    assert SignalKiller().terminate(p.pid, lambda: True) == "gone"
    assert SignalKiller().terminate(1, lambda: True) == "skipped"
    assert SignalKiller().terminate(os.getpid(), lambda: True) == "skipped"


class RealPids(Procfs):
    """The real /proc, with the given pids in container A of pod A."""

    def __init__(self, pids):
        super().__init__("/proc")
        self.pids = set(pids)

    def cgroup_path(self, pid):
        if pid in self.pids:
            return systemd(POD_A, CID_A)[3:].strip()
        return super().cgroup_path(pid)


def test_a_kill_never_holds_the_check_and_each_stop_is_followed_across_checks():
    """The check runs on the agent's one worker: it used to wait the grace period after
    SIGTERM and again after SIGKILL, per process, serially."""
    procs = [spawn(IGNORES_TERM) for _ in range(3)]
    pids = sorted(p.pid for p in procs)
    clock = Clock()
    mps = FakeMpsControl()
    mps.namespace_create("kf_a")
    mps.attach_client(pids[0], "kf_a")
    dog = Watchdog("kill", RealPids(pids), SignalKiller(clock, grace=5), mps, clock)
    listed = {GPU0: [Proc(pid, 800 * MIB) for pid in pids]}

    def outcomes(report):
        return sorted((a.pid, a.step, a.outcome) for a in report.actions)

    try:
        started = time.monotonic()
        first = dog.check(listed, managed())
        assert time.monotonic() - started < 2 and clock.slept == []
        assert outcomes(first) == sorted(
            [(pids[0], "drain", "drained")] + [(pid, "terminate", "signalled") for pid in pids])
        clock.now += 1
        assert dog.check(listed, managed()).actions == ()  # in progress: nothing again
        assert mps.terminated == [pids[0]]  # drained once
        clock.now += 4
        assert outcomes(dog.check(listed, managed())) == [
            (pid, "terminate", "escalated") for pid in pids]
        for p in procs:
            assert p.wait(timeout=5) == -signal.SIGKILL
        # Gone, and no longer listed: the outcome is still reported, for its container.
        last = dog.check({GPU0: []}, managed())
        assert outcomes(last) == [(pid, "terminate", "killed") for pid in pids]
        assert {(a.device_uuid, a.pod_uid, a.container_name) for a in last.actions} == {
            (GPU0, POD_A, "trainer")}
        assert clock.slept == []
    finally:
        for p in procs:
            p.kill()
            p.wait()


class CountingProcfs(Procfs):
    def __init__(self, root):
        super().__init__(root)
        self.reads: list[int] = []

    def cgroup_path(self, pid):
        self.reads.append(pid)
        return super().cgroup_path(pid)


def test_known_pids_are_not_read_again_and_gone_ones_are_forgotten(proc):
    procfs = CountingProcfs(proc.root)
    dog = Watchdog("report", procfs, RecordingKiller(), None, Clock())
    first = {GPU0: [Proc(100, 500 * MIB), Proc(200, MIB)]}
    dog.check(first, managed())
    dog.check(first, managed())
    assert sorted(procfs.reads) == [100, 200]  # the second check read no /proc file
    dog.check({GPU0: [Proc(100, 500 * MIB)]}, managed())  # 200 no longer on the GPU
    dog.check(first, managed())  # ... and back: read afresh, not trusted from before
    assert sorted(procfs.reads) == [100, 200, 200]


def test_a_violation_is_judged_on_owners_read_afresh_never_on_the_cache(proc):
    """A known pid reused by another container's process: the cache would charge container A
    with its memory; a violation re-reads its pids first, so none is reported or acted on."""
    killer = RecordingKiller()
    procfs = CountingProcfs(proc.root)
    dog = Watchdog("kill", procfs, killer, None, Clock())
    dog.check({GPU0: [Proc(100, 500 * MIB)]}, managed())  # 100 known, within its cap
    proc.add(100, cgroupfs(POD_B, CID_B))  # the pid now belongs to pod B
    report = dog.check({GPU0: [Proc(100, 10 * CAP)]}, managed())
    assert report.violations == () and report.actions == () and killer.calls == []
    assert report.unmanaged == ((GPU0, 100),)
    assert procfs.reads == [100, 100]  # read once more, for the violation only
    # a real violation is read once (fresh already) and acted on
    proc.add(101, systemd(POD_A, CID_A))
    report = dog.check({GPU0: [Proc(101, 10 * CAP)]}, managed())
    assert [v.pids for v in report.violations] == [(101,)] and killer.killed == [101]
    # accounting once (its read was fresh: no second one), then enforcement's own re-checks
    assert procfs.reads == [100, 100, 101, 101, 101]


class FakePin:
    def __init__(self, exited: Callable[[], bool]):
        self._exited = exited
        self.closed = False

    def exited(self) -> bool:
        return self._exited()

    def close(self) -> None:
        self.closed = True


class PinningProcfs(CountingProcfs):
    """Pins as the kernel keeps them (`Procfs.pin` over a pidfd): when a new process takes a
    pid (`reuse`), the pins of the one before say it exited."""

    def __init__(self, root, proc: FakeProc):
        super().__init__(root)
        self.proc = proc
        self.born: dict[int, int] = {}
        self.pins: list[FakePin] = []
        self.reuse_on_read: dict[int, str] = {}
        self.pin_error: OSError | None = None

    def reuse(self, pid: int, cgroup: str) -> None:
        self.born[pid] = self.born.get(pid, 0) + 1
        self.proc.add(pid, cgroup)

    def exit(self, pid: int) -> None:
        self.born[pid] = self.born.get(pid, 0) + 1
        self.proc.remove(pid)

    def pin(self, pid):
        if self.pin_error is not None:
            raise self.pin_error
        if not (self.root / str(pid)).exists():
            return None
        born = self.born.get(pid, 0)
        pin = FakePin(lambda: self.born.get(pid, 0) != born)
        self.pins.append(pin)
        return pin

    def cgroup_path(self, pid):
        path = super().cgroup_path(pid)
        if pid in self.reuse_on_read:  # the process exits as it is read; another takes the pid
            self.reuse(pid, self.reuse_on_read.pop(pid))
        return path


CAP_B = 512 * MIB


def a_and_b() -> list[ManagedContainer]:
    return [*managed(),
            ManagedContainer.uniform(POD_B, "b", f"containerd://{CID_B}", CAP_B, [GPU0])]


def test_a_pid_reused_under_a_cached_owner_is_charged_to_its_new_one(proc):
    """Container A's process 100 is known, within A's cap. It exits, and before the next check
    a process of container B takes pid 100 and uses more than B's (smaller) cap. Charged to A
    from the cache, it stays under A's cap and B's violation goes unseen for as long as NVML
    lists the pid; the pin taken when 100 was read says A's process exited, so it is read
    again and B's violation is reported."""
    procfs = PinningProcfs(proc.root, proc)
    dog = Watchdog("report", procfs, RecordingKiller(), None, Clock())
    assert dog.check({GPU0: [Proc(100, 500 * MIB)]}, a_and_b()).violations == ()
    procfs.reuse(100, systemd(POD_B, CID_B))
    report = dog.check({GPU0: [Proc(100, 800 * MIB)]}, a_and_b())
    assert [(v.pod_uid, v.used_bytes, v.pids) for v in report.violations] == [
        (POD_B, 800 * MIB, (100,))]
    assert procfs.reads == [100, 100]
    assert procfs.pins[0].closed and not procfs.pins[1].closed
    # the same process next check, within B's cap: from the cache, no read
    report = dog.check({GPU0: [Proc(100, 300 * MIB)]}, a_and_b())
    assert [(u.pod_uid, u.used_bytes) for u in report.usage] == [(POD_A, 0), (POD_B, 300 * MIB)]
    assert procfs.reads == [100, 100]
    dog.check({}, a_and_b())  # off the GPU: forgotten, its pin closed
    assert procfs.pins[1].closed


def test_a_pid_reused_while_its_cgroup_is_read_is_charged_to_no_one(proc):
    """The read may be of the process that took the pid after the pin: the pin held the one
    before, so the read is not trusted and the pid counts as gone for this check."""
    procfs = PinningProcfs(proc.root, proc)
    procfs.reuse_on_read[100] = systemd(POD_B, CID_B)
    dog = Watchdog("report", procfs, RecordingKiller(), None, Clock())
    report = dog.check({GPU0: [Proc(100, 10 * CAP)]}, a_and_b())
    assert report.violations == () and report.unmanaged == ()
    assert [(u.pod_uid, u.used_bytes) for u in report.usage] == [(POD_A, 0), (POD_B, 0)]
    assert procfs.pins[0].closed
    report = dog.check({GPU0: [Proc(100, 10 * CAP)]}, a_and_b())  # read again: B's now
    assert [v.pod_uid for v in report.violations] == [POD_B]


def test_no_violation_rests_on_a_cached_owner_after_the_re_read(proc):
    """Unpinned (a /proc tree of another pid namespace): both cached pids were taken by each
    other's container. The violation's re-read moves 101 to B, and B's sum then holds 100 from
    the cache; it is read again too before anything is reported."""
    proc.add(100, systemd(POD_B, CID_B))
    proc.add(101, systemd(POD_A, CID_A))
    procfs = CountingProcfs(proc.root)
    dog = Watchdog("report", procfs, RecordingKiller(), None, Clock())
    dog.check({GPU0: [Proc(100, 10 * MIB), Proc(101, 10 * MIB)]}, a_and_b())
    proc.add(100, systemd(POD_A, CID_A))
    proc.add(101, systemd(POD_B, CID_B))
    report = dog.check({GPU0: [Proc(100, 400 * MIB), Proc(101, 1100 * MIB)]}, a_and_b())
    assert [(v.pod_uid, v.used_bytes, v.pids) for v in report.violations] == [
        (POD_B, 1100 * MIB, (101,))]
    assert procfs.reads == [100, 101, 101, 100]


def test_a_process_that_exits_while_still_listed_is_not_charged(proc):
    """NVML may list a process a moment after it exited: its pin says so, and with its /proc
    entry gone it counts for no one."""
    procfs = PinningProcfs(proc.root, proc)
    dog = Watchdog("report", procfs, RecordingKiller(), None, Clock())
    dog.check({GPU0: [Proc(100, 500 * MIB)]}, a_and_b())
    procfs.exit(100)
    report = dog.check({GPU0: [Proc(100, 10 * CAP)]}, a_and_b())
    assert report.violations == () and report.unmanaged == ()
    assert [u.used_bytes for u in report.usage] == [0, 0]
    assert procfs.pins[0].closed and len(procfs.pins) == 1


def test_without_a_file_descriptor_for_a_pin_the_owner_is_read_every_check(proc):
    """Out of file descriptors (EMFILE): the process is read and accounted, and nothing is
    kept that would need one, so the next check reads it again."""
    procfs = PinningProcfs(proc.root, proc)
    procfs.pin_error = OSError(errno.EMFILE, "Too many open files")
    dog = Watchdog("report", procfs, RecordingKiller(), None, Clock())
    for _ in range(2):
        report = dog.check({GPU0: [Proc(100, 500 * MIB)]}, a_and_b())
        assert [(u.pod_uid, u.used_bytes) for u in report.usage] == [
            (POD_A, 500 * MIB), (POD_B, 0)]
    assert procfs.reads == [100, 100] and procfs.pins == []


# ---------------------------------------------------------------------------- blind spots


def test_cgroupfs_paths_seen_from_the_agents_cgroup_namespace_are_placed(proc):
    """A non-privileged agent on cgroup v2 has a cgroup namespace of its own: /proc shows the
    workloads' cgroups relative to the agent's, kubepods elided (cgroupfs driver). They were
    read as no pod's: nothing over its cap was seen, reported or stopped."""
    proc.add(100, f"0::/../../pod{POD_A}/{CID_A}\n")
    proc.add(101, f"0::/../../../besteffort/pod{POD_A}/{CID_A}\n")
    proc.add(200, f"0::/../../../pod{POD_B}/{CID_B}\n")
    killer = RecordingKiller()
    report = watchdog(proc, "kill", killer).check(OVER, managed())
    assert [(v.pod_uid, v.used_bytes, v.pids) for v in report.violations] == [
        (POD_A, 1200 * MIB, (100, 101))]
    assert killer.killed == [100, 101]
    assert (GPU0, 200) in report.unmanaged and report.unplaced == ()


def test_a_process_whose_container_cannot_be_told_is_unplaced_not_nobodys(proc):
    """A pod-shaped cgroup path relative to the agent's cgroup namespace that names no pod the
    parse can place may be a managed container's: listed as unplaced (the agent counts the
    watchdog blind there), never touched. One with nothing pod-shaped (the host's own cgroups,
    a runtime's own container) is a host process."""
    proc.add(100, f"0::/../../../../custom-root/pod{POD_A}/{CID_A}\n")  # a layout not parsed
    proc.add(101, "0::/../../../../system.slice/nvidia-persistenced.service\n")
    proc.add(102, f"0::/../../../../docker/{CID_A}\n")  # Docker with cgroupfs: no kubelet's
    killer = RecordingKiller()
    dog = watchdog(proc, "kill", killer)
    procs = {GPU0: [Proc(100, 10 * CAP), Proc(101, 10 * CAP), Proc(102, 10 * CAP)]}
    report = dog.check(procs, managed())
    assert [(device, pid) for device, pid, _why in report.unplaced] == [(GPU0, 100)]
    assert "relative to the agent's cgroup namespace" in report.unplaced[0][2]
    assert report.unmanaged == ((GPU0, 101), (GPU0, 102))
    assert report.violations == () and killer.calls == []
    assert dog.check(procs, managed()).unplaced == report.unplaced  # every check


class DeniedProcfs(Procfs):
    """A /proc tree whose cgroup files of `denied` pids cannot be read (hidepid=1, an LSM)."""

    def __init__(self, root, denied):
        super().__init__(root)
        self.denied = set(denied)

    def cgroup_path(self, pid):
        if pid in self.denied:
            raise PermissionError(errno.EACCES, "Permission denied")
        return super().cgroup_path(pid)


def test_an_unreadable_cgroup_is_an_unknown_owner_not_an_aborted_check(proc):
    """A PermissionError reading one process's cgroup aborted every check, every interval."""
    proc.add(500, systemd(POD_B, CID_B))
    killer = RecordingKiller()
    dog = Watchdog("kill", DeniedProcfs(proc.root, {101}), killer, None, Clock())
    report = dog.check({GPU0: [Proc(101, 10 * CAP)], GPU1: [Proc(500, 10 * CAP)]}, [
        *managed(), ManagedContainer.uniform(POD_B, "b", CID_B, CAP, [GPU1])])
    assert report.unplaced == (
        (GPU0, 101, "its cgroup cannot be read: EACCES (Permission denied)"),)
    assert [v.pod_uid for v in report.violations] == [POD_B]  # the others are still judged
    assert killer.calls == [500]


def test_a_live_process_without_a_proc_entry_is_hidden_not_gone(proc):
    """Pinned alive by its pidfd, yet no cgroup to read: /proc hides it (hidepid=2), so whose
    it is is unknown; not read as a process that exited."""
    procfs = PinningProcfs(proc.root, proc)
    (proc.root / "100" / "cgroup").unlink()
    report = Watchdog("report", procfs, RecordingKiller(), None, Clock()).check(
        {GPU0: [Proc(100, 10 * CAP)]}, managed())
    assert report.unplaced == ((GPU0, 100, "its /proc entry is hidden from the agent"),)
    assert procfs.pins[0].closed  # not kept: read again at the next check
    procfs.exit(101)  # exited: gone, whatever its /proc says
    report = Watchdog("report", procfs, RecordingKiller(), None, Clock()).check(
        {GPU0: [Proc(101, 10 * CAP)]}, managed())
    assert report.unplaced == () and report.violations == ()


class SlowKiller(RecordingKiller):
    """Every stop stays in progress (SIGTERM sent, the grace period running)."""

    def terminate(self, pid, still_ours):
        super().terminate(pid, still_ours)
        return "signalled"


def test_a_process_started_during_anothers_grace_period_is_judged_without_its_memory(proc):
    """Container A's 100 is over the cap and being stopped; 101 starts meanwhile with a little
    memory. Judged with 100's, it would be stopped for memory that is on its way out."""
    killer = SlowKiller()
    dog = watchdog(proc, "kill", killer)
    first = dog.check({GPU0: [Proc(100, 2000 * MIB)]}, managed())
    assert [(a.pid, a.outcome) for a in first.actions] == [(100, "signalled")]
    second = dog.check({GPU0: [Proc(100, 2000 * MIB), Proc(101, 100 * MIB)]}, managed())
    assert [v.used_bytes for v in second.violations] == [2100 * MIB]  # still reported
    assert second.actions == () and killer.calls == [100]
    # over the cap on its own: stopped, 100 still not signalled twice
    third = dog.check({GPU0: [Proc(100, 2000 * MIB), Proc(101, 1100 * MIB)]}, managed())
    assert [(a.pid, a.outcome) for a in third.actions] == [(101, "signalled")]
    assert killer.calls == [100, 101]


class ScriptedKiller(RecordingKiller):
    """Every stop stays in progress until a test moves it on (`then`): the outcomes its next
    `progress` reports."""

    def __init__(self):
        super().__init__()
        self.next: list[tuple[int, str]] = []

    def terminate(self, pid, still_ours):
        super().terminate(pid, still_ours)
        return "signalled"

    def then(self, *changes: tuple[int, str]) -> None:
        self.next = list(changes)

    def progress(self):
        changes, self.next = self.next, []
        return changes


def test_an_unkillable_process_s_memory_counts_again_in_judging_the_others(proc):
    """100 survives SIGKILL (stuck in the kernel): `unkillable`, never signalled again, and its
    memory stays in use for as long as it runs. Left out of the judgement as if on its way
    out, it let any other process of the container use up to the whole cap beside it, for
    ever: 101, over the cap with it, was never stopped."""
    killer = ScriptedKiller()
    dog = watchdog(proc, "kill", killer)
    stuck = Proc(100, 2000 * MIB)
    assert [(a.pid, a.outcome) for a in dog.check({GPU0: [stuck]}, managed()).actions] == [
        (100, "signalled")]
    # within the grace period, then the SIGKILL bound: its memory is on its way out
    for outcome in (None, "escalated"):
        if outcome is not None:
            killer.then((100, outcome))
        report = dog.check({GPU0: [stuck, Proc(101, 1000 * MIB)]}, managed())
        assert [(a.pid, a.outcome) for a in report.actions] == (
            [(100, outcome)] if outcome else [])
        assert killer.calls == [100]
    killer.then((100, "unkillable"))
    report = dog.check({GPU0: [stuck, Proc(101, 1000 * MIB)]}, managed())
    assert [v.used_bytes for v in report.violations] == [3000 * MIB]
    assert [(a.pid, a.outcome) for a in report.actions] == [
        (100, "unkillable"), (101, "signalled")]
    assert killer.calls == [100, 101]  # 101 stopped; 100 never signalled again
    # 101 on its way out: nothing new is stopped, the unkillable 100 is not signalled again
    report = dog.check({GPU0: [stuck, Proc(101, 1000 * MIB)]}, managed())
    assert report.actions == () and killer.calls == [100, 101]
    # once both exit, their stops are over: a process that gets pid 100 again and goes over
    # the cap is a new one, stopped as any other
    killer.then((100, "killed"), (101, "terminated"))
    assert [(a.pid, a.outcome) for a in dog.check({GPU0: []}, managed()).actions] == [
        (100, "killed"), (101, "terminated")]
    report = dog.check({GPU0: [Proc(100, 2000 * MIB)]}, managed())
    assert [(a.pid, a.outcome) for a in report.actions] == [(100, "signalled")]
    assert killer.calls == [100, 101, 100]


def test_an_unkillable_process_alone_over_the_cap_is_not_signalled_again(proc):
    """Its memory counts again, but it is never signalled again: a container over its cap with
    nothing but the unkillable process stays a violation with no action."""
    killer = ScriptedKiller()
    dog = watchdog(proc, "kill", killer)
    stuck = {GPU0: [Proc(100, 2000 * MIB), Proc(101, 10 * MIB)]}
    dog.check({GPU0: [Proc(100, 2000 * MIB)]}, managed())
    killer.then((100, "escalated"))
    dog.check({GPU0: [Proc(100, 2000 * MIB)]}, managed())
    killer.then((100, "unkillable"))
    dog.check({GPU0: [Proc(100, 2000 * MIB)]}, managed())
    for _ in range(3):
        report = dog.check({GPU0: [Proc(100, 2000 * MIB)]}, managed())
        assert report.violations and report.actions == ()
    assert killer.calls == [100]
    # a small process beside it takes the container over its cap only with the stuck one's
    # memory, which is there to stay: it is stopped
    report = dog.check(stuck, managed())
    assert [(a.pid, a.outcome) for a in report.actions] == [(101, "signalled")]


def deny_signals_to(monkeypatch, denied: set[int], sig: int | None = None) -> list:
    """pidfd_send_signal refuses (EPERM, as an LSM may) the given pids (only `sig`, if given)."""
    real = signal.pidfd_send_signal
    sent: list = []

    def send(fd, s, *args):
        with open(f"/proc/self/fdinfo/{fd}") as f:
            pid = int(next(line for line in f if line.startswith("Pid:")).split()[1])
        if pid in denied and (sig is None or s == sig):
            raise PermissionError(errno.EPERM, "Operation not permitted")
        sent.append((pid, s))
        return real(fd, s, *args)

    monkeypatch.setattr(signal, "pidfd_send_signal", send)
    return sent


def test_a_refused_signal_fails_that_stop_and_the_check_goes_on(monkeypatch, caplog):
    """A PermissionError from pidfd_send_signal (AppArmor, SELinux) aborted the check: no other
    container's process was stopped, at any check."""
    pa, pb = spawn(IGNORES_TERM), spawn(IGNORES_TERM)
    deny_signals_to(monkeypatch, {pa.pid})
    clock = Clock()

    class Owners(Procfs):
        def cgroup_path(self, pid):
            if pid in (pa.pid, pb.pid):
                return systemd(POD_A if pid == pa.pid else POD_B, CID_A if pid == pa.pid
                               else CID_B)[3:].strip()
            return super().cgroup_path(pid)

    killer = SignalKiller(clock, grace=5)
    dog = Watchdog("kill", Owners("/proc"), killer, None, clock)
    both = [*managed(), ManagedContainer.uniform(POD_B, "b", CID_B, CAP, [GPU0])]
    listed = {GPU0: [Proc(pa.pid, 2000 * MIB), Proc(pb.pid, 2000 * MIB)]}
    try:
        with caplog.at_level(logging.DEBUG, logger="kai_fractions.node.watchdog"):
            first = dog.check(listed, both)
            second = dog.check(listed, both)
        assert [(a.pid, a.outcome, a.detail) for a in first.actions] == [
            (pa.pid, "failed", "SIGTERM: EPERM (Operation not permitted)"),
            (pb.pid, "signalled", "")]
        assert [(a.pid, a.outcome) for a in second.actions] == [(pa.pid, "failed")]  # retried
        assert killer.in_progress == frozenset({pb.pid})  # no stop kept for A: its pin closed
        assert pa.poll() is None
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
                  and str(pa.pid) in r.getMessage()]
        assert warned == [  # once, with the errno, however many checks retry it
            f"cannot stop pid {pa.pid}: SIGTERM: EPERM (Operation not permitted)",
            f"watchdog terminate pid {pa.pid} of {POD_A}/trainer on {GPU0}: failed "
            "SIGTERM: EPERM (Operation not permitted)"]
    finally:
        for p in (pa, pb):
            p.kill()
            p.wait()


def test_a_refused_sigkill_fails_the_stop_which_starts_over(monkeypatch):
    p = spawn(IGNORES_TERM)
    sent = deny_signals_to(monkeypatch, {p.pid}, signal.SIGKILL)
    clock = Clock()
    killer = SignalKiller(clock, grace=5)
    try:
        assert killer.terminate(p.pid, lambda: True) == "signalled"
        clock.now += 5
        assert killer.progress() == [(p.pid, "failed")]
        assert killer.why(p.pid) == "SIGKILL: EPERM (Operation not permitted)"
        assert killer.why(p.pid) == ""  # told once
        assert killer.in_progress == frozenset() and killer.progress() == []
        assert sent == [(p.pid, signal.SIGTERM)] and p.poll() is None
        assert killer.terminate(p.pid, lambda: True) == "signalled"  # a later check's stop
    finally:
        p.kill()
        p.wait()
