"""The REAL nvidia-cuda-mps-control daemon (Debian, driver 535, legacy protocol) without a GPU."""

from __future__ import annotations

import pytest

from tests.support.mps import MpsDaemon, mps_command, mps_control_binary, start_mps_daemon


def test_daemon_answers_legacy_commands(mps_daemon: MpsDaemon) -> None:
    assert mps_daemon.is_alive()
    assert len(str(mps_daemon.pipe_dir)) <= 83
    assert mps_daemon.command("get_default_active_thread_percentage") == "100.0"
    assert mps_daemon.command("set_default_active_thread_percentage 25") == "25.0"
    assert mps_daemon.command("get_default_active_thread_percentage") == "25.0"

    assert mps_daemon.command("set_default_device_pinned_mem_limit 0 4096M") == ""
    assert mps_daemon.command("get_default_device_pinned_mem_limit 0") == "4G"  # normalised
    assert mps_daemon.command("get_default_device_pinned_mem_limit 2") == ""  # none set
    # The readback is truncated to the largest whole unit (driver 535): do not verify a limit
    # by string comparison unless it is a whole number of GiB or below 1 GiB.
    for value, readback in [("1536M", "1G"), ("19968M", "19G"), ("1023M", "1023M"), ("0", "")]:
        assert mps_daemon.command(f"set_default_device_pinned_mem_limit 1 {value}") == ""
        assert mps_daemon.command("get_default_device_pinned_mem_limit 1") == readback, value
    # out-of-range percentages are refused silently: the answer is the unchanged value
    assert mps_daemon.command("set_default_active_thread_percentage 150") == "25.0"

    assert mps_daemon.command("get_server_list") == ""  # no server without a GPU
    assert mps_daemon.command("no_such_command") == 'Unknown command "no_such_command"'
    assert "Cmd:set_default_active_thread_percentage 25" in mps_daemon.control_log()


def test_quit_stops_the_daemon() -> None:
    daemon = start_mps_daemon()
    try:
        assert daemon.is_alive()
        assert daemon.quit(timeout=5)
        assert not daemon.is_alive()
        # with the daemon gone the client itself fails (exit 1)
        res = mps_command(mps_control_binary(), daemon.pipe_dir, "get_server_list", timeout=10)
        assert res.returncode == 1
        with pytest.raises(RuntimeError, match="exited 1"):
            daemon.command("get_server_list")
    finally:
        daemon.cleanup()
    assert not daemon.pipe_dir.exists()
