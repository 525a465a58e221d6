"""The REAL `nvidia-cuda-mps-control` (Debian's driver 535 build, legacy protocol, no GPU needed
for the control daemon), started and supervised by MpsDaemon with the real subprocess runner.

Fetched by scripts/test-tools.sh into .tools/mps/; a missing binary is a test error, not a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kai_fractions.node.mps.control import MpsControl
from kai_fractions.node.mps.daemon import MpsDaemon, SystemClock
from kai_fractions.node.mps.errors import MpsError
from kai_fractions.node.mps.runner import SubprocessRunner
from kai_fractions.node.procfs import Procfs
from tests.support import tools

pytestmark = pytest.mark.integration

PINNED_MIB = 4096
ATP = 25


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def reapply(control: MpsControl) -> None:
    """What the agent's on_restart does: the node's MPS defaults back in place."""
    control.set_default_pinned_mem_limit(0, PINNED_MIB)
    control.set_default_active_thread_percentage(ATP)


@pytest.fixture
def binary() -> str:
    return str(tools.mps_control())


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Unix socket paths are at most 107 bytes: pytest's tmp_path is too long for a pipe dir.
    path = Path(tempfile.mkdtemp(prefix="kf", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon(binary, short_dir) -> Iterator[MpsDaemon]:
    reapplied: list[MpsControl] = []

    def on_restart(control: MpsControl) -> None:
        reapply(control)
        reapplied.append(control)

    d = MpsDaemon(binary, str(short_dir / "p"), str(short_dir / "l"), SubprocessRunner(),
                  SystemClock(), on_restart=on_restart, health_timeout=1.0, stop_grace=2.0)
    d.reapplied = reapplied  # type: ignore[attr-defined]
    try:
        yield d
    finally:
        pid = d.pid()
        if not d.stop(grace=2.0) and pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def control_log(d: MpsDaemon) -> str:
    path = Path(d.log_dir) / "control.log"
    return path.read_text(errors="replace") if path.exists() else ""


def test_start_set_and_read_back(daemon):
    assert daemon.healthy() is False  # nothing there yet
    assert daemon.ensure_running() is True
    assert daemon.protocol_v3 is False  # the 535 binary
    pid = daemon.pid()
    assert pid is not None and Procfs().is_alive(pid)
    assert Procfs().comm(pid) == "nvidia-cuda-mps"
    assert f"Control {pid:>5}] Starting control daemon" in control_log(daemon)
    # the daemon writes no pid file: its pipe dir has sockets, the lock and the log fifo only
    assert not [p for p in os.listdir(daemon.pipe_dir) if p.endswith(".pid")]
    assert {"control", "control_lock"} <= set(os.listdir(daemon.pipe_dir))
    for d in (daemon.pipe_dir, daemon.log_dir):
        assert (os.stat(d).st_mode & 0o777) == 0o755
    c = daemon.control
    assert c.get_server_list() == []  # no MPS server without a GPU client
    assert c.get_default_pinned_mem_limit(0) == "4G"  # on_restart ran after the first start
    assert c.set_default_pinned_mem_limit(0, 1536) == "1G"  # the daemon truncates to GiB
    assert c.get_default_pinned_mem_limit_mib(0) == 1024
    assert c.set_default_pinned_mem_limit(1, 700) == "700M"
    assert c.get_default_pinned_mem_limit(1) == "700M"
    assert c.get_default_pinned_mem_limit(2) == ""  # unset
    assert c.get_default_pinned_mem_limit_mib(2) is None
    assert c.set_default_active_thread_percentage(40) == "40.0"
    assert c.get_default_active_thread_percentage() == "40.0"
    assert c.get_default_active_thread_percentage_value() == 40.0


def test_concurrent_clients_are_served_and_never_taken_for_a_dead_daemon(daemon):
    """The real 535 daemon turns a client away while it serves another ("Cannot send command",
    exit 1). Commands from many threads at once all succeed (asked again), and a supervisor
    checking in the middle of a storm of other clients neither restarts nor kills it."""
    assert daemon.ensure_running() is True
    pid = daemon.pid()
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: daemon.control.get_default_pinned_mem_limit(0),
                                range(24)))
    assert answers == ["4G"] * 24
    command = Path(daemon.log_dir) / "storm-command"
    command.write_text("get_server_list\n")
    storm = []
    try:
        for _ in range(16):  # other clients, all at once: most of them are turned away
            with open(command) as stdin:
                storm.append(subprocess.Popen(
                    [daemon.binary], stdin=stdin, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, env=daemon.control.env))
        for _ in range(5):
            assert daemon.ensure_running() is True
    finally:
        for client in storm:
            client.wait(10)
    assert (daemon.pid(), daemon.restarts) == (pid, 0)
    assert "Starting control daemon" in control_log(daemon)
    assert control_log(daemon).count("Starting control daemon") == 1


def test_killed_daemon_is_restarted_and_state_reapplied(daemon):
    assert daemon.ensure_running() is True
    assert len(daemon.reapplied) == 1
    daemon.control.set_default_active_thread_percentage(60)
    old = daemon.pid()
    os.kill(old, signal.SIGKILL)
    assert wait_until(lambda: not Procfs().is_alive(old))
    assert daemon.healthy() is False
    assert daemon.last_health_error.reason == "MpsDaemonUnreachable"
    assert daemon.ensure_running() is True
    assert daemon.restarts == 1
    new = daemon.pid()
    assert new is not None and new != old
    assert len(daemon.reapplied) == 2
    # read back from the NEW daemon: the state was applied again (60 died with the old one)
    assert daemon.control.get_default_pinned_mem_limit(0) == "4G"
    assert daemon.control.get_default_active_thread_percentage() == "25.0"


def test_wedged_daemon_is_killed_and_replaced(daemon):
    assert daemon.ensure_running() is True
    old = daemon.pid()
    os.kill(old, signal.SIGSTOP)  # holds its lock, answers nothing
    try:
        daemon.health_timeout = 0.3
        daemon.wedged_checks, daemon.wedged_after = 2, 0.5
        assert daemon.healthy() is False
        assert "did not answer 'get_server_list' within 0.3s" in daemon.last_health_error.message
        assert daemon.ensure_running() is False  # silent once: maybe only slow
        assert daemon.last_error.reason == "MpsDaemonNotAnswering"
        assert Procfs().is_alive(old)
        time.sleep(0.5)
        assert daemon.ensure_running() is True  # silent twice over 0.5 s: wedged
        assert daemon.pid() not in (None, old)
        assert not Procfs().is_alive(old)
        assert daemon.control.get_default_active_thread_percentage() == "25.0"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(old, signal.SIGKILL)


def test_a_daemon_stalled_for_a_moment_is_not_killed(daemon):
    """One missed health answer (the daemon stopped for longer than the timeout, then going
    on) must not cost every tenant its MPS clients."""
    assert daemon.ensure_running() is True
    pid = daemon.pid()
    daemon.health_timeout = 0.3
    os.kill(pid, signal.SIGSTOP)
    try:
        assert daemon.ensure_running() is False
        assert daemon.last_error.reason == "MpsDaemonNotAnswering"
    finally:
        os.kill(pid, signal.SIGCONT)
    assert daemon.ensure_running() is True
    assert daemon.pid() == pid and daemon.restarts == 0


def test_stop_sends_quit_and_the_process_is_gone(daemon):
    assert daemon.ensure_running() is True
    pid = daemon.pid()
    started = time.monotonic()
    assert daemon.stop() is True
    assert time.monotonic() - started < 2.0  # quit, not the SIGKILL after the grace period
    assert not Procfs().is_alive(pid)
    assert daemon.pid() is None
    assert "Cmd:quit" in control_log(daemon)
    with pytest.raises(MpsError) as exc:
        daemon.control.get_server_list()
    assert exc.value.reason == "MpsDaemonUnreachable"
    assert "Cannot find MPS control daemon process" in exc.value.message


def test_unknown_and_rejected_commands(daemon):
    assert daemon.ensure_running() is True
    c = daemon.control
    with pytest.raises(MpsError) as exc:
        c.command("foo")
    assert exc.value.reason == "UnknownCommand"
    assert '(Unknown command "foo")' in exc.value.message
    # a bad GPU index: the daemon prints nothing and only logs it; the readback catches it
    with pytest.raises(MpsError) as exc:
        c.set_default_pinned_mem_limit(99, 1024)
    assert exc.value.reason == "NotApplied"
    assert "Invalid device ordinal!" in control_log(daemon)
    for call in (lambda: c.set_active_thread_percentage(1234, 50),
                 lambda: c.set_device_pinned_mem_limit(1234, 0, 1024),
                 lambda: c.get_client_list(1234),
                 lambda: c.terminate_client(1234, 99)):
        with pytest.raises(MpsError) as exc:
            call()
        assert exc.value.reason == "ServerNotFound"
        assert exc.value.message.endswith("Server 1234 not found")


def test_second_daemon_on_the_same_pipe_dir(daemon):
    assert daemon.ensure_running() is True
    result = SubprocessRunner().run([daemon.binary, "-d"], env=daemon.control.env)
    assert (result.returncode, result.stdout.strip()) == (
        1, "An instance of this daemon is already running")


def test_protocol_3_on_the_old_binary(daemon):
    """What the 535 binary does with `-p 3 ...`: it ignores the argv, runs its interactive
    client on stdin (empty here), sends the daemon no command and exits 0 with no output. So
    the v3 methods must not trust an empty answer: `--help` tells the protocols apart."""
    assert daemon.ensure_running() is True
    result = SubprocessRunner().run(
        [daemon.binary, "-p", "3", "namespace", "create", "kf_abc", "--server=shared"],
        env=daemon.control.env)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    # The daemon logs each command it gets ("Cmd: ..."), some time after it answers: those of
    # ensure_running's own checks can land after this call. None may name this one.
    time.sleep(0.3)
    assert not [line for line in control_log(daemon).splitlines()
                if "Cmd:" in line and ("namespace" in line or "kf_abc" in line)]
    help_text = SubprocessRunner().run([daemon.binary, "--help"]).stdout
    assert "CUDA MPS Control" in help_text and "--protocol" not in help_text
    # `-d -p 3` is not a daemon start for this binary either: it is the client again
    assert daemon.start_argv() == [daemon.binary, "-d"]
    c = daemon.control
    assert c.supports_protocol_v3() is False
    for call in (lambda: c.namespace_create("kf_abc"),
                 lambda: c.namespace_set_active_thread_percentage("kf_abc", 50),
                 lambda: c.namespace_get_pipe_directory("kf_abc"),
                 lambda: c.namespace_delete("kf_abc"), c.namespace_list, c.client_list,
                 lambda: c.client_terminate(1234)):
        with pytest.raises(MpsError) as exc:
            call()
        assert exc.value.reason == "ProtocolUnsupported"
