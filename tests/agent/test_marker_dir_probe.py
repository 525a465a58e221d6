"""The node condition while the readiness marker directory cannot be written at run time
(`marker_probe`, reason `MarkerDirectoryNotWritable`).

Before: the directory was checked at the agent's start only. A disk that filled up or a host
path remounted read-only later made each marker write fail (an error in the log, a pass error),
but the node stayed True `AgentReady`, so KAI kept placing fractional pods there whose gates
could only wait out their timeout; a node with no fractional pod said nothing at all.

Now the directory is probed every 10 s, and at once after a pass whose marker write failed: the
condition is False while the probe fails, naming the path and the error, True again after the
first probe that writes."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from kai_fractions.node.agent import marker_probe
from kai_fractions.node.agent.condition import Health, Liveness, evaluate
from kai_fractions.node.agent.marker_probe import (
    MARKER_DIR_NOT_WRITABLE,
    PROBE_FILE,
    MarkerDirProbe,
    probe_writable,
)
from kai_fractions.node.agent.options import AgentOptions
from kai_fractions.node.config import NodeConfig
from kai_fractions.node.inventory import Capabilities, Inventory
from kai_fractions.node.nvml import DeviceInfo, GpuComputeMode

from .builders import MIB, NODE, Rig, binder_annotations, pod, result_of

INVENTORY = Inventory("615.48.02", (DeviceInfo(
    index=0, uuid="GPU-1", name="NVIDIA H100 80GB HBM3", memory_total=81559 * MIB, memory_used=0,
    compute_mode=GpuComputeMode.DEFAULT, mig_enabled=False),), Capabilities(True, True))


def test_a_writable_directory_passes_and_keeps_no_probe_file(tmp_path: Path) -> None:
    assert probe_writable(tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_a_path_that_is_no_directory_fails_naming_the_path(tmp_path: Path) -> None:
    root = tmp_path / "markers"
    root.write_text("")  # what a host path replaced by a file looks like
    assert probe_writable(root) == f"{root}: Not a directory"


def test_a_full_disk_seen_only_at_the_sync_fails_and_leaves_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(marker_probe.os, "fsync", full)
    assert probe_writable(tmp_path) == f"{tmp_path / PROBE_FILE}: No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_logs_when_the_answer_changes(caplog: pytest.LogCaptureFixture) -> None:
    answers: list[str | None] = ["/m/.write-probe: Read-only file system",
                                 "/m/.write-probe: Read-only file system", None]
    watch = MarkerDirProbe("/m", lambda: 0.0, probe=lambda root: answers.pop(0))
    with caplog.at_level(logging.INFO, logger=marker_probe.__name__):
        watch.check()
        assert watch.error == "/m/.write-probe: Read-only file system"
        watch.check()  # still failing: not logged again
        watch.check()
    assert watch.error is None
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", "the readiness marker directory cannot be written (/m/.write-probe: Read-only "
                  "file system): the node is not ready for fractional pods "
                  "(MarkerDirectoryNotWritable) until a probe writes there again"),
        ("INFO", "the readiness marker directory can be written again")]


def test_its_thread_probes_every_interval_and_at_once_when_asked() -> None:
    probed = threading.Semaphore(0)

    def probe(root: object) -> None:
        probed.release()

    watch = MarkerDirProbe("/m", time.monotonic, interval=3600.0, probe=probe)
    stop = threading.Event()
    thread = threading.Thread(target=watch.run, args=(stop,), daemon=True)
    thread.start()
    assert probed.acquire(timeout=5)  # at its start
    assert not probed.acquire(timeout=0.2)  # then only every hour...
    watch.soon()  # ...or when a marker write failed
    assert probed.acquire(timeout=5)
    stop.set()
    watch.soon()
    thread.join(5)
    assert not thread.is_alive()


def test_a_probe_that_hangs_counts_as_failed_and_holds_up_nothing_else() -> None:
    """A stale network mount: the write never returns. Before, the probe ran on the worker,
    whose watchdog checks and gRPC calls then waited with it."""
    now = [100.0]
    release = threading.Event()
    entered = threading.Event()

    def hung(root: object) -> None:
        entered.set()
        release.wait(10)

    watch = MarkerDirProbe("/m", lambda: now[0], hang_after=5.0, probe=hung)
    stop = threading.Event()
    thread = threading.Thread(target=watch.run, args=(stop,), daemon=True)
    thread.start()
    assert entered.wait(5)
    assert watch.error is None  # a write may take a moment
    now[0] = 105.0
    assert watch.error == ("/m: a write and sync there has not returned for 5 s or more (a "
                           "hung file system?)")
    stop.set()
    release.set()
    watch.soon()
    thread.join(5)
    assert watch.error is None


@pytest.mark.parametrize("planted", ["symlink", "directory"])
def test_an_entry_put_in_the_probes_place_is_removed_never_followed(
        tmp_path: Path, planted: str) -> None:
    root = tmp_path / "markers"
    root.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    if planted == "symlink":
        (root / PROBE_FILE).symlink_to(target / "file")
    else:
        (root / PROBE_FILE).mkdir()
        (root / PROBE_FILE / "inside").write_text("x")
    assert probe_writable(root) is None
    assert list(root.iterdir()) == [] and list(target.iterdir()) == []


def test_the_condition_names_the_directory_and_the_remedy() -> None:
    live = Liveness(synced=True, api_down_for=None, api_error=None, busy_for=None,
                    markers_unwritable="/var/lib/kai-fractions/markers/.write-probe: Read-only "
                                       "file system")
    cond = evaluate(NodeConfig(node_name=NODE), AgentOptions(socket=None, metrics_listen=None),
                    Health(inventory=INVENTORY, passes=1, mps_namespaces=True,
                           wrong_compute_mode=(("GPU-1", "DEFAULT", "NVMLNoPermission"),)),
                    live)
    assert (cond.ready, cond.reason) == (False, MARKER_DIR_NOT_WRITABLE)
    assert cond.message == (
        "the readiness marker directory cannot be written (/var/lib/kai-fractions/markers/"
        ".write-probe: Read-only file system): the gate of every fractional pod placed here "
        "would wait until its timeout; free space on its disk or make it writable again (the "
        "node agent's --marker-dir, a host path)")


def unwritable(rig: Rig) -> Path:
    """The marker directory made a file (the agent's writes there fail as on a read-only or
    full disk; the tests may run as root, whom file modes do not stop)."""
    root = Path(rig.options.marker_dir)
    aside = root.with_name("markers.aside")
    root.rename(aside)
    root.write_text("")
    return aside


def writable_again(rig: Rig, aside: Path) -> None:
    root = Path(rig.options.marker_dir)
    root.unlink()
    aside.rename(root)


def test_the_node_is_not_ready_while_its_marker_directory_cannot_be_written(
        short_tmp: Path) -> None:
    rig = Rig(short_tmp)
    worker = rig.agent.worker
    first = rig.add(pod("first", notes=binder_annotations(devices=rig.gpu0)))["metadata"]["uid"]
    rig.sync()
    worker._step([], True)
    assert rig.marker_path(first).exists()
    cond = rig.agent.condition()
    assert cond is not None and (cond.ready, cond.reason) == (True, "AgentReady")

    aside = unwritable(rig)
    second = rig.add(pod("second", notes=binder_annotations(devices=rig.gpu1)))["metadata"]["uid"]
    rig.sync()
    asked = []
    worker.marker_probe.soon = lambda: asked.append(True)  # (its thread runs only in start())
    worker._step([], True)  # its marker write fails: the probe is asked to look at once
    assert "MarkerNotWritten" in worker.last_pass.errors and asked
    worker.marker_probe.check()
    cond = rig.agent.condition()
    assert cond is not None and (cond.ready, cond.reason) == (False, MARKER_DIR_NOT_WRITABLE)
    assert f"({rig.options.marker_dir}: Not a directory)" in cond.message

    writable_again(rig, aside)
    worker.marker_probe.check()
    worker._step([], True)
    assert rig.marker_path(second).exists()
    assert result_of(rig, second).state.value == "applied"
    cond = rig.agent.condition()
    assert cond is not None and (cond.ready, cond.reason) == (True, "AgentReady")


def test_a_node_without_fractional_pods_says_so_too(short_tmp: Path) -> None:
    """No marker write fails where none is written: the probe alone finds it."""
    rig = Rig(short_tmp)
    rig.sync()
    rig.agent.worker._step([], True)
    Path(rig.options.marker_dir).mkdir(exist_ok=True)
    unwritable(rig)
    rig.agent.worker.marker_probe.check()
    cond = rig.agent.condition()
    assert cond is not None and (cond.ready, cond.reason) == (False, MARKER_DIR_NOT_WRITABLE)


def test_a_probe_that_raises_counts_as_failed_and_the_probes_go_on() -> None:
    """A directory planted in the probe's place too deep to remove raised RecursionError, not
    an OSError: the thread died and its last answer, writable, stood for the agent's life."""
    answers: list[object] = [RecursionError("maximum recursion depth exceeded"), None]
    probed = threading.Semaphore(0)

    def probe(root: object) -> None:
        answer = answers.pop(0) if answers else None
        probed.release()
        if isinstance(answer, BaseException):
            raise answer

    watch = MarkerDirProbe("/m", time.monotonic, interval=3600.0, probe=probe)
    stop = threading.Event()
    thread = threading.Thread(target=watch.run, args=(stop,), daemon=True)
    thread.start()
    assert probed.acquire(timeout=5)
    deadline = time.monotonic() + 5
    while watch.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch.error == "/m: the probe failed (RecursionError)" and thread.is_alive()
    watch.soon()
    assert probed.acquire(timeout=5)
    deadline = time.monotonic() + 5
    while watch.error is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch.error is None
    stop.set()
    watch.soon()
    thread.join(5)
