"""The agent's record of the cgroup limits it set (`kai_fractions.node.limit_ledger`): written
whole or not at all, for this boot only, and never a reason to stop."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kai_fractions.node.limit_ledger import LEDGER_FILE, FileLimitLedger

GPU = "GPU-00000000-0000-0000-0000-000000000000"
ENTRIES = {(GPU, "/sys/fs/cgroup/kubepods.slice/a"), (GPU, "/sys/fs/cgroup/kubepods.slice/a/b")}


def test_it_keeps_its_entries_for_the_next_agent_of_the_same_boot(tmp_path: Path) -> None:
    root = tmp_path / "markers"
    FileLimitLedger(root, "boot-1").save(ENTRIES)
    assert FileLimitLedger(root, "boot-1").load() == ENTRIES
    assert os.stat(root / LEDGER_FILE).st_mode & 0o777 == 0o600  # root only on the host
    assert os.listdir(root) == [LEDGER_FILE]  # no temp file left
    FileLimitLedger(root, "boot-1").save(set())
    assert FileLimitLedger(root, "boot-1").load() == set()


def test_another_boots_record_is_no_record(tmp_path: Path) -> None:
    FileLimitLedger(tmp_path, "boot-1").save(ENTRIES)
    assert FileLimitLedger(tmp_path, "boot-2").load() == set()  # a reboot took the limits


@pytest.mark.parametrize("text", [b"{not json", b"[]", b'{"boot_id": "boot-1", "limits": 3}',
                                  b"\xff\xfe"])
def test_an_unreadable_record_is_started_without(tmp_path: Path, text: bytes,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / LEDGER_FILE).write_bytes(text)
    with caplog.at_level(logging.WARNING):
        assert FileLimitLedger(tmp_path, "boot-1").load() == set()


def test_malformed_entries_are_skipped(tmp_path: Path) -> None:
    (tmp_path / LEDGER_FILE).write_text(
        '{"boot_id": "boot-1", "limits": [["g", "/p"], ["g"], [1, "/q"], "x"]}')
    assert FileLimitLedger(tmp_path, "boot-1").load() == {("g", "/p")}


def test_a_record_that_cannot_be_written_raises_os_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        FileLimitLedger(tmp_path / "file", "boot-1").save(ENTRIES)


def test_a_save_an_earlier_agent_did_not_finish_leaves_nothing_behind(tmp_path: Path) -> None:
    FileLimitLedger(tmp_path, "boot-1").save(ENTRIES)
    (tmp_path / ".limits.json.k_hr5ip1.tmp").write_text('{"boot_id": "boot-1", "lim')
    (tmp_path / ".marker.json.abc.tmp").write_text("")  # not the ledger's: left alone
    assert FileLimitLedger(tmp_path, "boot-1").load() == ENTRIES
    assert sorted(os.listdir(tmp_path)) == [".limits.json", ".marker.json.abc.tmp"]
