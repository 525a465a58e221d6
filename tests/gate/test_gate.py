"""The gate: release only when the agent applied the plan the pod's annotations give."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from kai_fractions.contract import DEFAULT_KEYS
from kai_fractions.gate import GateOptions, Outcome, judge, run_gate
from kai_fractions.marker import ContainerMarker, Marker, write_marker

from .pods import UID, bound_annotations, downward_file, plan_of

DERIVED_LIMIT = "kai-fractions.io/container.main.memory-limit-mib"
STALE = "sha256:" + "0" * 64
BOOT = "0b0a1c2d-3e4f-4a5b-8c6d-7e8f9a0b1c2d"
"""The host's boot ID in these tests (the gate process's tests use the real one)."""
EARLIER_BOOT = "9f8e7d6c-5b4a-4c3d-8e2f-1a0b9c8d7e6f"


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
    ("no-marker", Outcome.WAIT,
     "the node agent has not written this pod's readiness marker yet"),
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
    assert err == "waiting: the node agent has not written this pod's readiness marker yet\n"


def test_run_fails_at_once_on_a_refusal(tmp_path: Path) -> None:
    refused = marker_for({"main": ContainerMarker.refused(
        "MixedComputeModes", "GPU-3f2a already serves a time-slicing container")})
    clock = FakeClock()
    code, log, out, err = run(setup_pod(tmp_path, bound_annotations(), refused), clock)
    line = ("container 'main' refused by the node agent: MixedComputeModes: GPU-3f2a already "
            "serves a time-slicing container\n")
    assert (code, log, out, err, clock.sleeps) == (1, line, "", line, [])


def timeout_line(reason: str, tmp_path: Path) -> str:
    return (f"timed out after 2s waiting for the node agent to apply this pod's GPU limits: "
            f"{reason} (marker: {tmp_path}/markers/{UID}/marker.json; is the kai-fractions "
            "node agent running on this node?)\n")


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
    assert log == timeout_line("the node agent has not written this pod's readiness marker "
                               "yet", tmp_path)


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
