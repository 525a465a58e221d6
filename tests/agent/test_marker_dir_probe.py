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
    assert probe_writable(root) == f"{root / PROBE_FILE}: Not a directory"


def test_a_full_disk_seen_only_at_the_sync_fails_and_leaves_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(marker_probe.os, "fsync", full)
    assert probe_writable(tmp_path) == f"{tmp_path / PROBE_FILE}: No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_probes_every_interval_or_sooner_when_asked(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    answers: list[str | None] = ["/m/.write-probe: Read-only file system", None]
    probed: list[float] = []

    def probe(root: object) -> str | None:
        probed.append(now[0])
        return answers[0]

    watch = MarkerDirProbe("/m", lambda: now[0], interval=10.0, probe=probe)
    with caplog.at_level(logging.INFO, logger=marker_probe.__name__):
        watch.check_if_due()  # the first step probes
        assert watch.error == "/m/.write-probe: Read-only file system"
        now[0] = 105.0
        watch.check_if_due()  # not due
        watch.check_if_due()
        assert probed == [100.0]
        now[0] = 110.0
        watch.check_if_due()  # due: still failing, not logged again
        answers.pop(0)
        now[0] = 111.0
        watch.soon()  # a marker write just failed: probe now
        watch.check_if_due()
    assert probed == [100.0, 110.0, 111.0]
    assert watch.error is None
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", "the readiness marker directory cannot be written (/m/.write-probe: Read-only "
                  "file system): the node is not ready for fractional pods "
                  "(MarkerDirectoryNotWritable) until a probe writes there again"),
        ("INFO", "the readiness marker directory can be written again")]


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
    worker._step([], True)  # its marker write fails: the directory is probed at once
    assert "MarkerNotWritten" in worker.last_pass.errors
    cond = rig.agent.condition()
    assert cond is not None and (cond.ready, cond.reason) == (False, MARKER_DIR_NOT_WRITABLE)
    assert f"{Path(rig.options.marker_dir) / PROBE_FILE}: Not a directory" in cond.message

    writable_again(rig, aside)
    worker.marker_probe.soon()
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
    rig.agent.worker.marker_probe.soon()
    rig.agent.worker._step([], False)
    cond = rig.agent.condition()
    assert cond is not None and (cond.ready, cond.reason) == (False, MARKER_DIR_NOT_WRITABLE)
