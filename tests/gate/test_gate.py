"""The gate: release only when the agent applied the plan the pod's annotations give."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from kai_fractions import marker as marker_module
from kai_fractions.contract import DEFAULT_KEYS
from kai_fractions.gate import GateOptions, Outcome, judge, observe, run_gate
from kai_fractions.marker import ContainerMarker, Marker, write_marker

from .pods import UID, bound_annotations, downward_file, plan_of

DERIVED_LIMIT = "kai-fractions.io/container.main.memory-limit-mib"
STALE = "sha256:" + "0" * 64
BOOT = "0b0a1c2d-3e4f-4a5b-8c6d-7e8f9a0b1c2d"
"""The host's boot ID in these tests (the gate process's tests use the real one)."""
EARLIER_BOOT = "9f8e7d6c-5b4a-4c3d-8e2f-1a0b9c8d7e6f"
REASON_WHERE = (
    "the node agent's reason: `kai-fractions inspect pod NS/NAME`, and the condition "
    "gpu-fractioning.nvidia.com/Ready of the pod's node (`kubectl describe node`), which is "
    "missing or Unknown where no node agent runs")
"""Where the agent's reason for holding the pod back is: the gate names it while it waits for a
marker, and at any timeout."""
NOT_WRITTEN = (
    "the node agent has not written this pod's readiness marker yet; it writes none while it "
    "holds the pod pending (the pod's node not ready for it, its limits not in force yet) or "
    f"does not run ({REASON_WHERE})")


def marker_for(containers: dict[str, ContainerMarker], uid: str = UID,
               boot_id: str = BOOT) -> Marker:
    return Marker.build(uid, containers, boot_id=boot_id, clock=lambda: 1.7e9)


def applied(boot_id: str = BOOT) -> Marker:
    digest = plan_of(bound_annotations()).digest
    return marker_for({"main": ContainerMarker.applied(digest)}, boot_id=boot_id)


def verdict(annotations: dict[str, str] | None, marker: Marker | None,
            containers: tuple[str, ...] = ("main", "metrics")):
    return judge(annotations, marker, pod_uid=UID, keys=DEFAULT_KEYS, boot_id=BOOT,
                 containers=containers)


def test_matching_marker_and_annotations_release() -> None:
    v = verdict(bound_annotations(), applied())
    assert v.outcome is Outcome.RELEASE
    assert v.message == f"limits applied: main {plan_of(bound_annotations()).digest}"


def test_container_names_default_to_those_the_annotations_name() -> None:
    assert verdict(bound_annotations(), applied(), containers=()).outcome is Outcome.RELEASE


def test_a_marker_of_an_earlier_boot_is_no_marker() -> None:
    """A reboot clears the kernel's limits, not the marker directory on the host's disk: the
    kubelet runs the gate again in a new sandbox, and it must wait for the agent to apply the
    limits again in this boot, not release on what the marker said before."""
    v = verdict(bound_annotations(), applied(boot_id=EARLIER_BOOT))
    assert (v.outcome, v.message) == (Outcome.WAIT, (
        f"the node agent's marker was written in boot {EARLIER_BOOT}, not in this boot of the "
        f"node ({BOOT}): the limits it vouched for are gone with a restart; waiting for the "
        "agent to apply them again"))
    refused = marker_for({"main": ContainerMarker.refused("InsufficientMemory", "no room")},
                         boot_id=EARLIER_BOOT)
    assert verdict(bound_annotations(), refused).outcome is Outcome.WAIT  # nor is its refusal


def test_a_marker_without_a_boot_id_is_no_marker() -> None:
    """An agent of an earlier release wrote none: the marker cannot say which boot it is of."""
    old = Marker(pod_uid=UID, written_at="2026-12-01T10:00:00Z",
                 containers=dict(applied().containers))
    assert "boot_id" not in old.to_dict()
    v = verdict(bound_annotations(), old)
    assert (v.outcome, v.message) == (Outcome.WAIT, (
        "the node agent's marker was written by a node agent that does not record boots (an "
        f"older release), not in this boot of the node ({BOOT}): the limits it vouched for are "
        "gone with a restart; waiting for the agent to apply them again"))


def test_a_refusal_is_final_even_before_the_annotations_are_visible() -> None:
    refused = marker_for({"main": ContainerMarker.refused(
        "InsufficientMemory", "GPU-3f2a has 4096 MiB free, the container needs 8192 MiB")})
    v = verdict(None, refused)
    assert (v.outcome, v.message) == (Outcome.FAIL, (
        "container 'main' refused by the node agent: InsufficientMemory: GPU-3f2a has 4096 "
        "MiB free, the container needs 8192 MiB"))


@pytest.mark.parametrize(("change", "outcome", "message"), [
    ("no-marker", Outcome.WAIT, NOT_WRITTEN),
    ("no-annotations", Outcome.WAIT,
     "the pod's annotations are not visible yet (downward-API file missing)"),
    ("stale-digest", Outcome.WAIT,
     f"container 'main': the node agent applied plan {STALE} but the pod's annotations give "
     "{digest}"),
    ("missing-derived", Outcome.WAIT,
     f"container 'main': annotation {DERIVED_LIMIT} is missing (the workload's env reads it)"),
    ("wrong-derived", Outcome.WAIT,
     f"container 'main': annotation {DERIVED_LIMIT} is '99999' but the plan says '10240'"),
    ("no-entry", Outcome.WAIT,
     "container 'main': the node agent's marker has no entry for it"),
    ("extra-entry", Outcome.WAIT,
     "the node agent's marker names container(s) metrics that request no GPU fraction"),
    ("not-bound", Outcome.WAIT,
     "the pod's annotations do not make a complete plan yet: "
     "nvidia.com/container.main.gpus.devices: is missing: the binder has not assigned a GPU "
     "yet"),
    ("invalid", Outcome.FAIL,
     "the pod's annotations break the NvFractions contract: "
     "nvidia.com/container.main.gpu-memory.limit: must be greater than or equal to the request "
     "'8Gi' (got '1Gi')"),
    ("not-fractional", Outcome.FAIL,
     "the pod's annotations request no GPU fraction, yet the pod carries the kai-fractions "
     "gate: its GPU env would be empty"),
])
def test_every_way_of_not_releasing(change: str, outcome: Outcome, message: str) -> None:
    annotations: dict[str, str] | None = bound_annotations()
    marker: Marker | None = applied()
    digest = plan_of(bound_annotations()).digest
    assert annotations is not None and marker is not None
    if change == "no-marker":
        marker = None
    elif change == "no-annotations":
        annotations = None
    elif change == "stale-digest":
        marker = marker_for({"main": ContainerMarker.applied(STALE)})
    elif change == "missing-derived":
        del annotations[DERIVED_LIMIT]
    elif change == "wrong-derived":
        annotations[DERIVED_LIMIT] = "99999"
    elif change == "no-entry":
        marker = marker_for({})
    elif change == "extra-entry":
        marker = marker_for({**marker.containers, "metrics": ContainerMarker.applied(STALE)})
    elif change == "not-bound":
        del annotations["nvidia.com/container.main.gpus.devices"]
    elif change == "invalid":
        annotations["nvidia.com/container.main.gpu-memory.limit"] = "1Gi"
    elif change == "not-fractional":
        annotations = {"prometheus.io/scrape": "true"}
    v = verdict(annotations, marker)
    assert (v.outcome, v.message) == (outcome, message.format(digest=digest))


def test_the_plan_is_the_agents_only_for_this_pod() -> None:
    """The digest covers the pod UID (and with it the MPS namespace)."""
    other = plan_of(bound_annotations(), uid="another-pod-uid")
    assert other.digest != plan_of(bound_annotations()).digest


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []
        self.on_sleep = lambda n: None

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        self.on_sleep(len(self.sleeps))


def setup_pod(tmp_path: Path, annotations: dict[str, str] | None,
              marker: Marker | None) -> GateOptions:
    root = tmp_path / "markers"
    root.mkdir()
    if marker is not None:
        write_marker(root, marker)
    podinfo = tmp_path / "podinfo"
    podinfo.mkdir()
    if annotations is not None:
        (podinfo / "annotations").write_text(downward_file(annotations))
    return GateOptions(marker_dir=root / UID, annotations_file=podinfo / "annotations",
                       pod_uid=UID, timeout=2.0, poll_interval=0.5,
                       termination_log=tmp_path / "termination-log", keys=DEFAULT_KEYS,
                       boot_id=BOOT, containers=("main", "metrics"))


def run(opts: GateOptions, clock: FakeClock) -> tuple[int, str, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run_gate(opts, clock=clock, sleep=clock.sleep, stdout=out, stderr=err)
    log = opts.termination_log.read_text() if opts.termination_log.exists() else ""
    return code, log, out.getvalue(), err.getvalue()


def test_run_releases_at_once_when_the_marker_matches(tmp_path: Path) -> None:
    clock = FakeClock()
    code, log, out, err = run(setup_pod(tmp_path, bound_annotations(), applied()), clock)
    line = f"limits applied: main {plan_of(bound_annotations()).digest}\n"
    assert (code, log, out, err, clock.sleeps) == (0, line, line, "", [])


def test_run_waits_for_the_marker_then_releases(tmp_path: Path) -> None:
    clock = FakeClock()
    opts = setup_pod(tmp_path, bound_annotations(), None)
    clock.on_sleep = lambda n: write_marker(tmp_path / "markers", applied()) if n == 2 else None
    code, _, _, err = run(opts, clock)
    assert code == 0
    assert clock.sleeps == [0.5, 0.5]
    assert err == f"waiting: {NOT_WRITTEN}\n"


def test_a_pod_directory_the_gate_may_not_read_yet_is_a_marker_not_written_yet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kubelet makes the pod's marker directory for the gate's subPathExpr mount with the
    root's mode (0700, upstream kubelet_pods.go makeMounts: SafeMakeDir with the volume's
    mode) until the agent's first write opens it: the gate, user 65534, gets EACCES. It waits
    saying the marker is not written yet, not that a marker is invalid, and releases once the
    agent has written it."""
    clock = FakeClock()
    opts = setup_pod(tmp_path, bound_annotations(), None)
    (tmp_path / "markers" / UID).mkdir(mode=0o700)
    real = marker_module._read_regular

    def as_the_gate(path: Path) -> bytes:  # the test runs as root, which EACCES never stops
        if not (tmp_path / "markers" / UID / "marker.json").exists():
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(marker_module, "_read_regular", as_the_gate)
    clock.on_sleep = lambda n: write_marker(tmp_path / "markers", applied()) if n == 2 else None
    code, _, _, err = run(opts, clock)
    assert code == 0
    assert err == (
        f"waiting: {NOT_WRITTEN}; the pod's marker directory is not readable until the "
        f"agent's first write opens it ({tmp_path}/markers/{UID}/marker.json: cannot read: "
        "Permission denied)\n")


def test_a_marker_written_but_unreadable_to_the_gate_is_said_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EACCES on a marker file that can be looked up (its directory open to the gate) is not
    the kubelet's directory: the file's mode, owner or security label keeps the gate out, and
    the gate says that, not that the agent has not written it."""
    opts = setup_pod(tmp_path, bound_annotations(), applied())

    def as_the_gate(path: Path) -> bytes:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(marker_module, "_read_regular", as_the_gate)
    verdict = observe(opts)
    assert verdict.outcome is Outcome.WAIT
    assert verdict.message.startswith(
        f"the readiness marker is not valid: {tmp_path}/markers/{UID}/marker.json: written but "
        f"cannot be read by uid {os.getuid()} (mode 644, owner uid {os.getuid()}; check its "
        "mode and security label): Permission denied")


def test_run_fails_at_once_on_a_refusal(tmp_path: Path) -> None:
    refused = marker_for({"main": ContainerMarker.refused(
        "MixedComputeModes", "GPU-3f2a already serves a time-slicing container")})
    clock = FakeClock()
    code, log, out, err = run(setup_pod(tmp_path, bound_annotations(), refused), clock)
    line = ("container 'main' refused by the node agent: MixedComputeModes: GPU-3f2a already "
            "serves a time-slicing container\n")
    assert (code, log, out, err, clock.sleeps) == (1, line, "", line, [])


def timeout_line(reason: str, tmp_path: Path) -> str:
    """The message of a gate that waited for something other than a first marker: it adds where
    the agent's reason is (once: the wait for a first marker names it already)."""
    where = "" if reason.startswith(NOT_WRITTEN) else f"; {REASON_WHERE}"
    return (f"timed out after 2s waiting for the node agent to apply this pod's GPU limits: "
            f"{reason} (marker: {tmp_path}/markers/{UID}/marker.json{where})\n")


def test_run_fails_on_a_digest_mismatch_that_does_not_clear(tmp_path: Path) -> None:
    stale = marker_for({"main": ContainerMarker.applied(STALE)})
    clock = FakeClock()
    code, log, _, err = run(setup_pod(tmp_path, bound_annotations(), stale), clock)
    reason = (f"container 'main': the node agent applied plan {STALE} but the pod's "
              f"annotations give {plan_of(bound_annotations()).digest}")
    assert code == 1
    assert log == timeout_line(reason, tmp_path)
    assert err == f"waiting: {reason}\n" + timeout_line(reason, tmp_path)
    assert clock.sleeps == [0.5, 0.5, 0.5, 0.5]


def test_run_fails_when_a_derived_annotation_never_appears(tmp_path: Path) -> None:
    annotations = bound_annotations()
    del annotations[DERIVED_LIMIT]
    code, log, _, _ = run(setup_pod(tmp_path, annotations, applied()), FakeClock())
    assert code == 1
    assert log == timeout_line(f"container 'main': annotation {DERIVED_LIMIT} is missing (the "
                               "workload's env reads it)", tmp_path)


def test_run_times_out_without_a_marker(tmp_path: Path) -> None:
    code, log, _, _ = run(setup_pod(tmp_path, bound_annotations(), None), FakeClock())
    assert code == 1
    assert log == timeout_line(NOT_WRITTEN, tmp_path)


def test_a_marker_for_another_pod_is_not_trusted(tmp_path: Path) -> None:
    opts = setup_pod(tmp_path, bound_annotations(), None)
    # Another pod's marker placed in this pod's directory (it cannot happen through the
    # subPathExpr mount, but the gate checks anyway).
    other = Marker.build("another-pod-uid", dict(applied().containers), boot_id=BOOT,
                         clock=lambda: 1.7e9)
    write_marker(tmp_path / "markers", other)
    (tmp_path / "markers" / "another-pod-uid").rename(tmp_path / "markers" / UID)
    code, log, _, _ = run(opts, FakeClock())
    assert code == 1
    assert log == timeout_line(
        f"the readiness marker is not valid: {tmp_path}/markers/{UID}/marker.json: pod_uid: "
        f"is 'another-pod-uid', expected this pod's '{UID}'", tmp_path)


def test_an_unwritable_termination_log_is_reported_not_fatal(tmp_path: Path) -> None:
    opts = setup_pod(tmp_path, bound_annotations(), applied())
    opts = GateOptions(**{**{f: getattr(opts, f) for f in opts.__slots__},
                          "termination_log": tmp_path / "no-such-dir" / "log"})
    code, _, _, err = run(opts, FakeClock())
    assert code == 0
    assert err == (f"kai-fractions gate: cannot write the termination message to {tmp_path}/"
                   "no-such-dir/log: No such file or directory\n")


SET_ASIDE_REASON = (
    "the node agent set this pod's readiness marker aside: a limit it had vouched for is not in "
    "force now (such as an MPS cap after an MPS daemon restart); it writes the marker again "
    "once the limit is back (the reason: `kai-fractions inspect pod NS/NAME` or the pod's "
    "events)")


def set_aside_verdict(set_aside: Marker | None, marker: Marker | None = None):
    return judge(bound_annotations(), marker, pod_uid=UID, keys=DEFAULT_KEYS, boot_id=BOOT,
                 containers=("main", "metrics"), set_aside=set_aside)


def test_a_marker_set_aside_in_this_boot_is_named_while_the_gate_waits() -> None:
    """The agent moved the pod's marker aside on purpose (an MPS cap it relies on is not in
    force): the gate waits, and says so rather than "not written yet"."""
    v = set_aside_verdict(applied())
    assert (v.outcome, v.message, v.set_aside) == (Outcome.WAIT, SET_ASIDE_REASON, True)


@pytest.mark.parametrize("kept", ["applied", "refused"])
def test_a_set_aside_marker_is_never_taken_for_a_marker(kept: str) -> None:
    """It vouches for nothing: its applied plan releases nothing, its refusal fails nothing."""
    set_aside = applied() if kept == "applied" else marker_for(
        {"main": ContainerMarker.refused("InsufficientMemory", "no room")})
    assert set_aside_verdict(set_aside).outcome is Outcome.WAIT
    # once the agent writes the marker again, it alone decides
    assert set_aside_verdict(set_aside, applied()).outcome is Outcome.RELEASE


@pytest.mark.parametrize("whose", ["another-pod", "earlier-boot", "no-boot-id"])
def test_a_set_aside_marker_of_another_pod_or_boot_is_ignored(whose: str) -> None:
    """An earlier boot's marker is set aside at the agent's start (the reboot cleared its
    limits; nothing was taken away in this boot), and another pod's is none of this gate's."""
    containers = dict(applied().containers)
    set_aside = {
        "another-pod": marker_for(containers, uid="another-pod-uid"),
        "earlier-boot": marker_for(containers, boot_id=EARLIER_BOOT),
        "no-boot-id": Marker(pod_uid=UID, written_at="2026-12-01T10:00:00Z",
                             containers=containers),
    }[whose]
    v = set_aside_verdict(set_aside)
    assert (v.outcome, v.message, v.set_aside) == (
        Outcome.WAIT, NOT_WRITTEN, False)


def set_aside_file(tmp_path: Path, marker: Marker) -> Path:
    """The agent's move: marker.json renamed to set-aside.json in the pod's directory."""
    path = write_marker(tmp_path / "markers", marker)
    return path.rename(path.with_name("set-aside.json"))


def test_run_names_the_set_aside_marker_then_releases_when_it_is_written_again(
        tmp_path: Path) -> None:
    clock = FakeClock()
    opts = setup_pod(tmp_path, bound_annotations(), None)
    set_aside_file(tmp_path, applied())

    def agent(n: int) -> None:  # the cap is back: the agent writes the marker again
        if n == 2:
            write_marker(tmp_path / "markers", applied())
            (opts.marker_dir / "set-aside.json").unlink()

    clock.on_sleep = agent
    code, _, _, err = run(opts, clock)
    assert (code, err, clock.sleeps) == (0, f"waiting: {SET_ASIDE_REASON}\n", [0.5, 0.5])


def test_run_times_out_on_a_set_aside_marker_without_doubting_the_agent(tmp_path: Path) -> None:
    opts = setup_pod(tmp_path, bound_annotations(), None)
    set_aside_file(tmp_path, applied())
    code, log, _, err = run(opts, FakeClock())
    line = (f"timed out after 2s waiting for the node agent to apply this pod's GPU limits: "
            f"{SET_ASIDE_REASON} (marker: {tmp_path}/markers/{UID}/marker.json, set aside as "
            f"{tmp_path}/markers/{UID}/set-aside.json)\n")
    assert code == 1
    assert log == line
    assert err == f"waiting: {SET_ASIDE_REASON}\n" + line


@pytest.mark.parametrize("content", ["another-pod", "earlier-boot", "malformed", "directory"])
def test_run_ignores_a_set_aside_file_it_cannot_take_for_this_pods(tmp_path: Path,
                                                                   content: str) -> None:
    """Not this pod's, not this boot's, or no marker at all: the message is the plain one (the
    file is not a marker, so nothing about it is worth a "not valid")."""
    opts = setup_pod(tmp_path, bound_annotations(), None)
    opts.marker_dir.mkdir()  # the kubelet's, for the gate's mount
    path = opts.marker_dir / "set-aside.json"
    if content == "another-pod":
        set_aside_file(tmp_path, marker_for(dict(applied().containers), uid="another-pod-uid"))
        (tmp_path / "markers" / "another-pod-uid" / "set-aside.json").rename(path)
    elif content == "earlier-boot":
        set_aside_file(tmp_path, applied(boot_id=EARLIER_BOOT))
    elif content == "malformed":
        path.write_text("{not json")
    else:
        path.mkdir()
    code, log, _, _ = run(opts, FakeClock())
    assert code == 1
    assert log == timeout_line(NOT_WRITTEN, tmp_path)
