"""The MPS logs stay bounded: control.log grew by ~220 bytes at every health check (every 5 s,
3.7 MiB a day) and nothing rotated it. Once over the cap, its newest part is copied to
`control.log.1` and the file is truncated in place (the daemon keeps it open with O_APPEND);
server.log the same. The real daemon writing on after a cut: test_mps_real_foreign.py."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from kai_fractions.node.mps.log_cap import DEFAULT_MAX_BYTES, LOG_FILES, LogCap
from kai_fractions.node.mps.runner import RecordingRunner
from tests.node.test_mps_daemon import BIN, LIST, FakeProcesses, make


def _lines(prefix: str, count: int) -> bytes:
    return b"".join(f"[{prefix} {i:05d}] a control daemon line\n".encode() for i in range(count))


def test_a_log_over_its_cap_keeps_its_newest_lines_in_dot_1(tmp_path):
    log = tmp_path / "control.log"
    log.write_bytes(_lines("old", 100))  # 3,400 bytes
    os.chmod(log, 0o640)
    cap = LogCap(str(tmp_path), max_bytes=1000)
    assert cap.check() == ["control.log"]
    assert log.read_bytes() == b""  # truncated in place: the same file, the daemon's
    kept = (tmp_path / "control.log.1").read_bytes()
    assert kept.endswith(b"[old 00099] a control daemon line\n")
    assert kept.startswith(b"[old ")  # from a line start
    assert len(kept) <= 1000 and len(kept) > 1000 - 34
    assert stat.S_IMODE(os.stat(tmp_path / "control.log.1").st_mode) == 0o640
    assert not (tmp_path / "control.log.1.tmp").exists()
    assert cap.check() == []  # under the cap now
    log.write_bytes(_lines("new", 50))
    assert cap.check() == ["control.log"]
    assert (tmp_path / "control.log.1").read_bytes().startswith(b"[new ")  # replaced


def test_both_logs_are_capped_and_missing_ones_are_fine(tmp_path):
    assert LOG_FILES == ("control.log", "server.log")
    assert DEFAULT_MAX_BYTES == 16 * 1024 * 1024
    (tmp_path / "server.log").write_bytes(_lines("srv", 100))
    assert LogCap(str(tmp_path), max_bytes=500).check() == ["server.log"]
    assert (tmp_path / "server.log").stat().st_size == 0
    assert LogCap(str(tmp_path / "none"), max_bytes=500).check() == []


def test_a_log_that_cannot_be_cut_is_logged_once_and_left(tmp_path, caplog):
    log = tmp_path / "control.log"
    log.write_bytes(before := _lines("old", 100))
    (tmp_path / "control.log.1.tmp").mkdir()  # the copy cannot be written
    cap = LogCap(str(tmp_path), max_bytes=1000)
    with caplog.at_level(logging.WARNING):
        assert cap.check() == [] and cap.check() == []
    assert caplog.text.count("cannot cut the MPS log") == 1
    assert "it keeps growing until this works" in caplog.text
    assert log.read_bytes() == before  # untouched, nothing lost
    (tmp_path / "control.log.1.tmp").rmdir()
    assert cap.check() == ["control.log"]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "16M"])
def test_the_cap_must_be_a_positive_whole_number(tmp_path, bad):
    with pytest.raises(ValueError, match="max_bytes must be a whole number of bytes > 0"):
        LogCap(str(tmp_path), max_bytes=bad)


def test_the_supervisor_cuts_the_logs_at_every_look(tmp_path):
    runner = RecordingRunner()
    runner.respond([BIN], "", stdin=LIST)
    logs = tmp_path / "log"
    logs.mkdir()
    daemon = make((str(tmp_path / "pipe"), str(logs)), runner,
                  processes=FakeProcesses(pid=4242), protocol_v3=False, log_max_bytes=2000)
    assert daemon.ensure_running() is True
    (logs / "control.log").write_bytes(_lines("old", 100))
    assert daemon.ensure_running() is True
    assert (logs / "control.log").stat().st_size == 0
    assert (logs / "control.log.1").stat().st_size > 0
