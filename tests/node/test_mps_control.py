"""MpsControl through the argv-recording runner: exact argv, stdin and env of every command, and
the parsing of each answer (the client exits 0 on errors, so stdout decides)."""

from __future__ import annotations

import pytest

from kai_fractions.node.mps import errors as e
from kai_fractions.node.mps.control import (
    MpsClient,
    MpsControl,
    classify_answer,
    displayed_mem_limit,
    parse_mem_limit,
)
from kai_fractions.node.mps.errors import MpsError
from kai_fractions.node.mps.runner import (
    CommandNotFound,
    CommandResult,
    CommandTimeout,
    RecordingRunner,
)

BIN = "/usr/bin/nvidia-cuda-mps-control"
PIPE = "/run/kf/mps"
LOGS = "/var/log/kf/mps"
ENV = {"CUDA_MPS_PIPE_DIRECTORY": PIPE, "CUDA_MPS_LOG_DIRECTORY": LOGS,
       "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # the pinned limit's device index is NVML's
V3_HELP = ("Usage: nvidia-cuda-mps-control [OPTIONS] [MODULE VERB ...]\n"
           "  -p, --protocol <2|3>   Protocol 2 (legacy, default) or 3.\n")
OLD_HELP = ("CUDA MPS Control for Linux/Unix.\nCopyright (C) 2003 - 2023 NVIDIA Corporation.\n\n"
            "  This program allows multiple CUDA processes to share a single GPU context.\n")


def control(runner: RecordingRunner, **kw) -> MpsControl:
    return MpsControl(BIN, PIPE, LOGS, runner, **kw)


def v3(runner: RecordingRunner | None = None) -> tuple[MpsControl, RecordingRunner]:
    runner = runner or RecordingRunner()
    runner.respond([BIN, "--help"], V3_HELP)
    return control(runner), runner


# ---------------------------------------------------------------------------- legacy commands


def test_set_default_pinned_limit_writes_the_command_then_reads_it_back():
    runner = RecordingRunner()
    runner.respond([BIN], "4G\n", stdin="get_default_device_pinned_mem_limit 0\n")
    got = control(runner).set_default_pinned_mem_limit(0, 4096)
    assert got == "4G"
    assert [(c.argv, c.stdin, c.env) for c in runner.calls] == [
        ((BIN,), "set_default_device_pinned_mem_limit 0 4096M\n", ENV),
        ((BIN,), "get_default_device_pinned_mem_limit 0\n", ENV),
    ]


def test_pinned_limit_readback_that_disagrees_is_not_applied():
    # The daemon logs "Invalid device ordinal!" but prints nothing to the client.
    runner = RecordingRunner()
    with pytest.raises(MpsError) as exc:
        control(runner).set_default_pinned_mem_limit(7, 2048)
    assert exc.value.reason == e.NOT_APPLIED == "NotApplied"
    assert exc.value.message == (
        "after 'set_default_device_pinned_mem_limit 7 2048M' the daemon reads back '(unset)', "
        f"not '2G': GPU index 7 may not exist (see {LOGS}/control.log)")


def test_pinned_limit_readback_is_truncated_to_whole_gib_by_the_daemon():
    runner = RecordingRunner()
    runner.respond([BIN], "19G\n", stdin="get_default_device_pinned_mem_limit 1\n")
    assert control(runner).set_default_pinned_mem_limit(1, 19968) == "19G"


@pytest.mark.parametrize(("mib", "shown"), [
    (7, "7M"), (1023, "1023M"), (1024, "1G"), (1025, "1G"), (1536, "1G"), (4096, "4G"),
    (19968, "19G"), (1048576, "1024G"),
])
def test_displayed_mem_limit_matches_what_the_daemon_prints(mib, shown):
    assert displayed_mem_limit(mib) == shown


@pytest.mark.parametrize(("text", "mib"), [("4G", 4096), ("7M", 7), ("", None), ("\n", None),
                                           ("1024G", 1048576)])
def test_parse_mem_limit(text, mib):
    assert parse_mem_limit(text) == mib


@pytest.mark.parametrize("text", ["4", "4T", "1.5G", "G", "-1M", "Unknown command"])
def test_parse_mem_limit_rejects_garbage(text):
    with pytest.raises(ValueError, match="not a pinned memory limit"):
        parse_mem_limit(text)


def test_get_default_pinned_limit_text_and_mib():
    runner = RecordingRunner()
    runner.respond([BIN], "4G\n", stdin="get_default_device_pinned_mem_limit 2\n")
    runner.respond([BIN], "", stdin="get_default_device_pinned_mem_limit 3\n")
    runner.respond([BIN], "lots\n", stdin="get_default_device_pinned_mem_limit 4\n")
    c = control(runner)
    assert c.get_default_pinned_mem_limit(2) == "4G"
    assert c.get_default_pinned_mem_limit_mib(2) == 4096
    assert c.get_default_pinned_mem_limit(3) == ""
    assert c.get_default_pinned_mem_limit_mib(3) is None
    with pytest.raises(MpsError) as exc:
        c.get_default_pinned_mem_limit_mib(4)
    assert exc.value.reason == "UnexpectedOutput"


def test_default_active_thread_percentage_is_checked_against_the_echo():
    runner = RecordingRunner()
    runner.respond([BIN], "25.0\n", stdin="set_default_active_thread_percentage 25\n")
    runner.respond([BIN], "25.0\n", stdin="get_default_active_thread_percentage\n")
    c = control(runner)
    assert c.set_default_active_thread_percentage(25) == "25.0"
    assert c.get_default_active_thread_percentage() == "25.0"
    assert c.get_default_active_thread_percentage_value() == 25.0
    assert runner.stdins == ["set_default_active_thread_percentage 25\n",
                             "get_default_active_thread_percentage\n",
                             "get_default_active_thread_percentage\n"]


def test_default_active_thread_percentage_echoing_the_old_value_is_not_applied():
    runner = RecordingRunner()
    runner.respond([BIN], "100.0\n", stdin="set_default_active_thread_percentage 40\n")
    with pytest.raises(MpsError) as exc:
        control(runner).set_default_active_thread_percentage(40)
    assert (exc.value.reason, exc.value.message) == (
        "NotApplied", "after 'set_default_active_thread_percentage 40' the daemon reports '100.0'")


def test_server_list_parses_pids():
    runner = RecordingRunner()
    runner.respond([BIN], "1234\n5678\n", stdin="get_server_list\n")
    assert control(runner).get_server_list() == [1234, 5678]
    runner.respond([BIN], "", stdin="get_server_list\n")
    assert control(runner).get_server_list() == []


def test_server_list_with_garbage_is_unexpected_output():
    runner = RecordingRunner().respond([BIN], "12ab\n", stdin="get_server_list\n")
    with pytest.raises(MpsError) as exc:
        control(runner).get_server_list()
    assert exc.value.reason == "UnexpectedOutput"


@pytest.mark.parametrize(("call", "stdin"), [
    (lambda c: c.set_active_thread_percentage(1234, 50), "set_active_thread_percentage 1234 50\n"),
    (lambda c: c.set_device_pinned_mem_limit(1234, 0, 1024),
     "set_device_pinned_mem_limit 1234 0 1024M\n"),
    (lambda c: c.get_client_list(1234), "get_client_list 1234\n"),
    (lambda c: c.terminate_client(1234, 99), "terminate_client 1234 99\n"),
])
def test_per_server_commands_report_a_missing_server(call, stdin):
    # What the real 535 daemon prints for a server pid it does not have.
    runner = RecordingRunner().respond([BIN], "Server 1234 not found\n", stdin=stdin)
    with pytest.raises(MpsError) as exc:
        call(control(runner))
    assert exc.value.reason == e.SERVER_NOT_FOUND == "ServerNotFound"
    assert exc.value.message == ("the MPS control daemon rejected "
                                 f"{stdin.strip()!r}: Server 1234 not found")
    assert runner.stdins == [stdin]


def test_legacy_client_list_and_terminate():
    runner = RecordingRunner()
    runner.respond([BIN], "11\n12\n", stdin="get_client_list 7\n")
    c = control(runner)
    assert c.get_client_list(7) == [11, 12]
    c.terminate_client(7, 11)
    assert runner.stdins[-1] == "terminate_client 7 11\n"


# What the real 535 daemon prints for `terminate_client` on a server it does not have: the
# text twice, then its status line.
SERVER_GONE = "Server 900 not found\nServer 900 not found!\n1\n"


@pytest.mark.parametrize("said", ["", "0\n"])
def test_legacy_terminate_client_success_prints_nothing_or_status_0(said):
    """Which of the two the daemon prints on success cannot be seen without a GPU."""
    runner = RecordingRunner().respond([BIN], said, stdin="terminate_client 900 11\n")
    control(runner).terminate_client(900, 11)


def test_legacy_terminate_client_failure_status_alone_is_a_failure():
    """A failure on the server's side prints only the status `1`: read as success, a drain
    that did not happen counted as done (and the watchdog went on to kill the client)."""
    runner = RecordingRunner().respond([BIN], "1\n", stdin="terminate_client 900 11\n")
    with pytest.raises(MpsError) as exc:
        control(runner).terminate_client(900, 11)
    assert exc.value.reason == "CommandFailed"
    assert exc.value.message == (
        f"the MPS control daemon answered 'terminate_client 900 11' with status 1: the "
        f"client's work was not ended (see {LOGS}/control.log)")


@pytest.mark.parametrize(("said", "reason"), [
    (SERVER_GONE, "ServerNotFound"),
    # the client exited mid-drain: nothing left to drain, not a bad argument
    ("Invalid process 11!\n1\n", "ClientNotFound"),
    ("Invalid process 11!\n", "ClientNotFound"),
    ("Server 900 is <busy>\n1\n", "NamespaceBusy"),
    ("something new\n0\n", "CommandFailed"),
    ("2\n", "CommandFailed"),
])
def test_legacy_terminate_client_failures_keep_their_reasons(said, reason):
    runner = RecordingRunner().respond([BIN], said, stdin="terminate_client 900 11\n")
    with pytest.raises(MpsError) as exc:
        control(runner).terminate_client(900, 11)
    assert exc.value.reason == reason
    assert "terminate_client 900 11" in exc.value.message


def test_unknown_command_is_reported_with_the_daemon_text():
    runner = RecordingRunner().respond([BIN], 'Unknown command "foo"\n', stdin="foo\n")
    with pytest.raises(MpsError) as exc:
        control(runner).command("foo")
    assert exc.value.reason == e.UNKNOWN_COMMAND == "UnknownCommand"
    assert exc.value.message == ("the MPS control daemon does not know 'foo' (Unknown command "
                                 "\"foo\"): a command this driver's MPS does not have (upgrade "
                                 "the NVIDIA driver)")


def test_quit_and_no_daemon():
    runner = RecordingRunner()
    control(runner).quit()
    assert runner.calls[0].stdin == "quit\n"
    runner = RecordingRunner(CommandResult(1, "", "Cannot find MPS control daemon process\n"))
    with pytest.raises(MpsError) as exc:
        control(runner).quit()
    assert exc.value.reason == e.MPS_DAEMON_UNREACHABLE == "MpsDaemonUnreachable"
    assert exc.value.message == (f"no MPS control daemon answers on {PIPE} ('quit': Cannot find "
                                 "MPS control daemon process); the supervisor starts it")


def test_timeout_is_an_unreachable_daemon_and_binary_missing_has_its_own_reason():
    runner = RecordingRunner(CommandTimeout([BIN], 2))
    with pytest.raises(MpsError) as exc:
        control(runner).get_server_list(timeout=2)
    assert exc.value.reason == "MpsDaemonUnreachable"
    assert "did not answer 'get_server_list' within 2s" in exc.value.message
    assert runner.calls[0].timeout == 2
    runner = RecordingRunner(CommandNotFound([BIN], f"cannot execute {BIN}: No such file"))
    with pytest.raises(MpsError) as exc:
        control(runner).get_server_list()
    assert exc.value.reason == e.MPS_BINARY_NOT_FOUND == "MpsBinaryNotFound"
    assert "--mps-control-binary" in exc.value.message


BUSY = CommandResult(1, "Cannot send command to MPS control daemon process\n", "")


def test_a_daemon_busy_with_another_client_is_asked_again():
    runner = RecordingRunner()
    runner.respond([BIN], BUSY, BUSY, "12345\n", stdin="get_server_list\n")
    pauses: list[float] = []
    assert control(runner, sleep=pauses.append).get_server_list() == [12345]
    assert len(runner.calls) == 3 and pauses == [0.02, 0.04]


def test_a_silent_exit_1_is_a_busy_daemon_too():
    runner = RecordingRunner()
    runner.respond([BIN], CommandResult(1, "", ""), "4G\n",
                   stdin="get_default_device_pinned_mem_limit 0\n")
    assert control(runner, sleep=lambda _: None).get_default_pinned_mem_limit(0) == "4G"
    assert len(runner.calls) == 2


def test_a_daemon_that_stays_busy_is_busy_not_unreachable():
    runner = RecordingRunner(BUSY)
    pauses: list[float] = []
    with pytest.raises(MpsError) as exc:
        control(runner, sleep=pauses.append).set_default_active_thread_percentage(50)
    assert exc.value.reason == e.MPS_DAEMON_BUSY == "MpsDaemonBusy"
    assert exc.value.message == (
        f"the MPS control daemon on {PIPE} is serving another client "
        "('set_default_active_thread_percentage 50': Cannot send command to MPS control daemon "
        "process); it is alive, try again")
    assert len(runner.calls) == 7 and sum(pauses) == pytest.approx(1.26)


def test_other_exit_codes_are_command_failed():
    runner = RecordingRunner(CommandResult(3, "", "boom\n"))
    with pytest.raises(MpsError) as exc:
        control(runner).get_server_list()
    assert (exc.value.reason, exc.value.message) == (
        "CommandFailed", f"{BIN} 'get_server_list' exited 3: boom")


@pytest.mark.parametrize("call", [
    lambda c: c.set_default_pinned_mem_limit(0, 0),
    lambda c: c.set_default_pinned_mem_limit(0, -5),
    lambda c: c.set_default_pinned_mem_limit(-1, 10),
    lambda c: c.set_default_pinned_mem_limit(True, 10),
    lambda c: c.set_default_pinned_mem_limit(0, 1.5),
    lambda c: c.set_default_active_thread_percentage(0),
    lambda c: c.set_default_active_thread_percentage(101),
    lambda c: c.set_default_active_thread_percentage(12.5),
    lambda c: c.set_active_thread_percentage(0, 50),
    lambda c: c.set_device_pinned_mem_limit(5, 0, 0),
    lambda c: c.command("get_server_list\nquit"),
    lambda c: c.namespace_create("Bad-Name"),
    lambda c: c.namespace_create(""),
    lambda c: c.namespace_create("kf_abc; rm"),
    lambda c: c.namespace_set_active_thread_percentage("kf_abc", 0),
    lambda c: c.namespace_delete("../x"),
    lambda c: c.client_terminate(-3),
])
def test_bad_input_runs_nothing(call):
    runner = RecordingRunner()
    with pytest.raises(MpsError) as exc:
        call(control(runner, protocol_v3=True))
    assert exc.value.reason == e.INVALID_ARGUMENT == "InvalidArgument"
    assert runner.calls == []


def test_validation_messages():
    c = control(RecordingRunner(), protocol_v3=True)
    with pytest.raises(MpsError, match=r"active thread percentage must be a whole number "
                                       r"1\.\.100, got 101"):
        c.set_default_active_thread_percentage(101)
    with pytest.raises(MpsError, match=r"mib must be a whole number > 0, got 0"):
        c.set_default_pinned_mem_limit(0, 0)
    with pytest.raises(MpsError, match=r"MPS namespace name 'Bad-Name' must match \[a-z0-9_\]\+"):
        c.namespace_create("Bad-Name")


def test_namespace_whose_pipe_directory_would_not_fit_a_socket_path_is_refused():
    runner = RecordingRunner()
    c = MpsControl(BIN, "/run/" + "p" * 60, LOGS, runner, protocol_v3=True)
    with pytest.raises(MpsError) as exc:
        c.namespace_create("kf_0123456789abcdef0123")
    assert exc.value.reason == "InvalidArgument"
    assert "longer than 83 bytes" in exc.value.message
    assert runner.calls == []


# ---------------------------------------------------------------------------- v3 commands


def test_v3_namespace_commands_exact_argv_and_env():
    c, runner = v3()
    runner.respond([BIN, "-p", "3", "namespace", "get", "kf_abc", "shared", "pipe-directory"],
                   f"{PIPE}/shared/kf_abc\n")
    runner.respond([BIN, "-p", "3", "namespace", "get", "kf_abc", "shared",
                    "active-thread-percentage"], "50\n")
    c.namespace_create("kf_abc")
    c.namespace_set_active_thread_percentage("kf_abc", 50)
    assert c.namespace_get_pipe_directory("kf_abc") == f"{PIPE}/shared/kf_abc"
    c.namespace_delete("kf_abc")
    assert c.namespace_list() == []
    assert c.client_list() == []
    c.client_terminate(4321)
    assert runner.argvs == [
        (BIN, "--help"),
        (BIN, "-p", "3", "namespace", "create", "kf_abc", "--server=shared"),
        (BIN, "-p", "3", "namespace", "set", "kf_abc", "--server=shared",
         "--active-thread-percentage=50"),
        (BIN, "-p", "3", "namespace", "get", "kf_abc", "shared", "active-thread-percentage"),
        (BIN, "-p", "3", "namespace", "get", "kf_abc", "shared", "pipe-directory"),
        (BIN, "-p", "3", "namespace", "delete", "kf_abc", "--server=shared"),
        (BIN, "-p", "3", "namespace", "list", "--server=shared"),
        (BIN, "client", "list", "--format=csv,noheader"),
        (BIN, "client", "terminate", "4321"),  # silence: done, nothing read back
    ]
    assert all(call.env == ENV for call in runner.calls)
    # v3 commands take their command from argv: nothing on stdin
    assert all(call.stdin is None for call in runner.calls)


GET_ATP = [BIN, "-p", "3", "namespace", "get", "kf_abc", "shared", "active-thread-percentage"]


@pytest.mark.parametrize("said", ["50\n", "50.0\n", "50%\n", " 50 \n"])
def test_namespace_percentage_is_read_back_in_the_forms_a_daemon_may_print(said):
    c, runner = v3()
    runner.respond(GET_ATP, said)
    c.namespace_set_active_thread_percentage("kf_abc", 50)
    assert runner.argvs[-1] == tuple(GET_ATP)
    assert c.namespace_get_active_thread_percentage("kf_abc") == 50.0


@pytest.mark.parametrize(("said", "got"), [("100\n", "100"), ("", "(unset)"), ("-\n", "(unset)"),
                                           ("25.0\n", "25")])
def test_namespace_percentage_the_daemon_did_not_take_is_not_applied(said, got):
    """The daemon may report a rejected `namespace set` (clients already attached, a bad value)
    only in its log: the readback is what says whether the cap is in force."""
    c, runner = v3()
    runner.respond(GET_ATP, said)
    with pytest.raises(MpsError) as exc:
        c.namespace_set_active_thread_percentage("kf_abc", 50)
    assert (exc.value.reason, exc.value.message) == (
        "NotApplied",
        "after 'namespace set kf_abc --server=shared --active-thread-percentage=50' the daemon "
        f"reads back {got} for namespace kf_abc, not 50 (see {LOGS}/control.log)")


def test_namespace_percentage_readback_that_is_no_percentage_is_unexpected():
    c, runner = v3()
    runner.respond(GET_ATP, "fifty\n")
    with pytest.raises(MpsError) as exc:
        c.namespace_set_active_thread_percentage("kf_abc", 50)
    assert (exc.value.reason, exc.value.message) == (
        "UnexpectedOutput",
        "namespace get kf_abc shared active-thread-percentage printed 'fifty', not a percentage")
    runner.respond(GET_ATP, "Error: namespace kf_abc not found\n")
    with pytest.raises(MpsError) as exc:
        c.namespace_set_active_thread_percentage("kf_abc", 50)
    assert exc.value.reason == "NamespaceNotFound"


def test_v3_server_name_is_configurable():
    runner = RecordingRunner().respond([BIN, "--help"], V3_HELP)
    c = MpsControl(BIN, PIPE, LOGS, runner, server="gpu0")
    c.namespace_create("kf_x")
    assert runner.argvs[-1] == (BIN, "-p", "3", "namespace", "create", "kf_x", "--server=gpu0")
    with pytest.raises(MpsError, match="server name"):
        MpsControl(BIN, PIPE, LOGS, runner, server="bad name")


def test_protocol_probe_runs_once_and_an_old_binary_is_protocol_unsupported():
    runner = RecordingRunner().respond([BIN, "--help"], OLD_HELP)
    c = control(runner)
    for call in (lambda: c.namespace_create("kf_abc"), c.namespace_list, c.client_list,
                 lambda: c.client_terminate(5)):
        with pytest.raises(MpsError) as exc:
            call()
        assert exc.value.reason == e.PROTOCOL_UNSUPPORTED == "ProtocolUnsupported"
    assert runner.argvs == [(BIN, "--help")]
    assert exc.value.message == (
        f"{BIN} has no v3 control protocol (-p 3, NVIDIA driver r615 or newer), needed for "
        "'client terminate 5': per-container MPS namespaces are unavailable on this node; "
        "upgrade the driver or run the agent with --no-sm-sharing")


def test_protocol_can_be_declared_without_probing():
    runner = RecordingRunner()
    control(runner, protocol_v3=True).namespace_list()
    assert runner.argvs == [(BIN, "-p", "3", "namespace", "list", "--server=shared")]
    with pytest.raises(MpsError, match="no v3 control protocol"):
        control(runner, protocol_v3=False).namespace_list()


@pytest.mark.parametrize(("stdout", "reason"), [
    ('Unknown command "namespace"', "UnknownCommand"),
    ("Error: namespace kf_abc not found", "NamespaceNotFound"),
    ("No such namespace: kf_abc", "NamespaceNotFound"),
    ("namespace kf_abc does not exist", "NamespaceNotFound"),
    ("Error: namespace kf_abc already exists", "NamespaceExists"),
    ("Cannot delete namespace kf_abc: 2 clients attached", "NamespaceBusy"),
    ("namespace kf_abc is busy", "NamespaceBusy"),
    ("Server shared not found", "ServerNotFound"),
    ("Error: server 'shared' does not exist", "ServerNotFound"),
    ("Invalid value for --active-thread-percentage", "InvalidArgument"),
    ("Error: permission denied", "CommandFailed"),
    ("Failed to create namespace", "CommandFailed"),
])
def test_v3_error_texts(stdout, reason):
    c, runner = v3()
    runner.respond([BIN, "-p", "3", "namespace", "delete", "kf_abc", "--server=shared"],
                   stdout + "\n")
    with pytest.raises(MpsError) as exc:
        c.namespace_delete("kf_abc")
    assert exc.value.reason == reason
    assert stdout in exc.value.message


def test_namespace_busy_on_delete_tells_the_caller_to_retry():
    c, runner = v3()
    runner.respond([BIN, "-p", "3", "namespace", "delete", "kf_abc", "--server=shared"],
                   "Namespace kf_abc has clients attached\n", "")
    with pytest.raises(MpsError) as exc:
        c.namespace_delete("kf_abc")
    assert exc.value.reason == "NamespaceBusy"
    c.namespace_delete("kf_abc")  # the client left: the retry succeeds


def test_create_exist_ok_and_delete_missing_ok():
    c, runner = v3()
    runner.respond([BIN, "-p", "3", "namespace", "create", "kf_a", "--server=shared"],
                   "namespace kf_a already exists\n")
    runner.respond([BIN, "-p", "3", "namespace", "delete", "kf_a", "--server=shared"],
                   "namespace kf_a not found\n")
    c.namespace_create("kf_a", exist_ok=True)
    c.namespace_delete("kf_a", missing_ok=True)
    with pytest.raises(MpsError, match="already exists"):
        c.namespace_create("kf_a")
    with pytest.raises(MpsError, match="not found"):
        c.namespace_delete("kf_a")


def test_namespace_list_parsing():
    c, runner = v3()
    argv = [BIN, "-p", "3", "namespace", "list", "--server=shared"]
    runner.respond(argv, "NAME\ndefault\nkf_abc\nkf_def  50\n\n", "garbage-name!\n")
    assert c.namespace_list() == ["default", "kf_abc", "kf_def"]
    with pytest.raises(MpsError) as exc:
        c.namespace_list()
    assert exc.value.reason == "UnexpectedOutput"


def test_pipe_directory_parsing():
    c, runner = v3()
    argv = [BIN, "-p", "3", "namespace", "get", "kf_a", "shared", "pipe-directory"]
    runner.respond(argv, "pipe-directory: /run/kf/mps/shared/kf_a\n", "/a\n/b\n", "",
                   "/tmp/error/shared/kf_a\n")
    assert c.namespace_get_pipe_directory("kf_a") == "/run/kf/mps/shared/kf_a"
    for _ in range(2):
        with pytest.raises(MpsError) as exc:
            c.namespace_get_pipe_directory("kf_a")
        assert exc.value.reason == "UnexpectedOutput"
    # a bare path is an answer even when it contains an error word
    assert c.namespace_get_pipe_directory("kf_a") == "/tmp/error/shared/kf_a"


def test_client_list_csv_parsing():
    c, runner = v3()
    runner.respond([BIN, "client", "list", "--format=csv,noheader"],
                   "4321, shared, kf_abc\n4400,shared,\n77\n", "pid,x\n")
    assert c.client_list() == [MpsClient(4321, "kf_abc"), MpsClient(4400, None),
                               MpsClient(77, None)]
    with pytest.raises(MpsError) as exc:
        c.client_list()
    assert exc.value.reason == "UnexpectedOutput"


def test_client_list_in_the_columns_nvidia_documents():
    """`pid,server,device,namespace,cmd` (NVIDIA's MPS v3 interface page): the namespace is
    the fourth column, the third the device; a command may hold commas."""
    c, runner = v3()
    runner.respond([BIN, "client", "list", "--format=csv,noheader"],
                   "51023,shared,0,default,python train.py\n"
                   "51087,shared,1,kf_abc,python eval.py --a,b\n"
                   "51090,shared,GPU-74d43ed3-cdf7-e667-3644-bf5b4f46ed65,kf_def,x\n"
                   "51091,shared,0,,x\n")
    assert c.client_list() == [MpsClient(51023, "default"), MpsClient(51087, "kf_abc"),
                               MpsClient(51090, "kf_def"), MpsClient(51091, None)]


def test_a_tenants_command_line_is_never_read_as_the_daemons_error():
    """A client's row ends with its command line, which its tenant chooses: words the daemon's
    errors use there (busy, invalid, error) must not fail the list (and with it every drain,
    and the watchdog's kills, on the node). A line that is no row still can."""
    c, runner = v3()
    runner.respond([BIN, "client", "list", "--format=csv,noheader"],
                   "51023,shared,0,kf_abc,python train.py --on-error=skip --model busy-bee\n"
                   "51024,shared,0,kf_def,python x.py --invalid-ok\n",
                   "Error: the server is busy\n")
    assert c.client_list() == [MpsClient(51023, "kf_abc"), MpsClient(51024, "kf_def")]
    with pytest.raises(MpsError) as exc:
        c.client_list()
    assert exc.value.reason == "NamespaceBusy"


def test_client_terminate_of_a_non_client():
    c, runner = v3()
    runner.respond([BIN, "client", "terminate", "99"], "Error: client 99 not found\n")
    with pytest.raises(MpsError) as exc:
        c.client_terminate(99)
    assert exc.value.reason == e.CLIENT_NOT_FOUND == "ClientNotFound"


KNOWN_FAILURES = [
    "Could not terminate client 4242: limit reached",
    "couldn't terminate client 4242: timed out waiting for server",
    "Request rejected by server shared",
    "Unsupported option --server",
    "Operation not allowed while the server is starting",
    "Namespace kf_abc refused: server shared is shutting down",
]
UNKNOWN_WORDINGS = [
    "Namespace kf_abc has 2 processes attached; deletion deferred",
    "Client 4242 will be terminated later",
    "Sent terminate request to client 4242",
    # they name the deed, and say it failed in words no failure pattern knows: read back
    "Client 4242 terminated with errors", "Client 4242: nothing terminated",
    "Namespace kf_abc: 0 clients terminated, 1 remaining", "Client 4242 terminated partially",
    "Namespace kf_abc deleted: 1 client still remains", "Terminated 0 clients in namespace x",
]
V3_SUCCESS_SHAPES = [
    "", "OK\n", "Client 4242 terminated\n", "Client 4242 terminated successfully.\n",
    "Terminated client 4242\n", "Namespace kf_abc deleted.\n",
    "Namespace kf_abc deleted successfully\n", "Deleted namespace kf_abc\n",
]
TERMINATE = [BIN, "client", "terminate", "4242"]
CLIENT_LIST = [BIN, "client", "list", "--format=csv,noheader"]
DELETE = [BIN, "-p", "3", "namespace", "delete", "kf_abc", "--server=shared"]
NAMESPACE_LIST = [BIN, "-p", "3", "namespace", "list", "--server=shared"]


@pytest.mark.parametrize("said", KNOWN_FAILURES)
def test_v3_terminate_and_delete_answered_with_a_known_failure_fail_unread(said):
    """A failure text is a failure, whatever a readback would show: nothing is read back."""
    c, runner = v3()
    runner.respond(TERMINATE, said + "\n")
    runner.respond(DELETE, said + "\n")
    for call, what in ((lambda: c.client_terminate(4242), "'client terminate 4242'"),
                       (lambda: c.namespace_delete("kf_abc", missing_ok=True),
                        "'namespace delete kf_abc --server=shared'")):
        with pytest.raises(MpsError) as exc:
            call()
        assert exc.value.reason == "CommandFailed"
        assert what in exc.value.message and said in exc.value.message
    assert tuple(CLIENT_LIST) not in runner.argvs and tuple(NAMESPACE_LIST) not in runner.argvs


@pytest.mark.parametrize("said", V3_SUCCESS_SHAPES)
def test_v3_terminate_and_delete_answered_as_done_succeed_unread(said):
    """Silence or an answer that reads as done is success, with nothing read back: a
    terminated client may stay connected, and listed, until its process exits (the kill
    after the drain ends it), so a readback would fail every drain."""
    c, runner = v3()
    runner.respond(TERMINATE, said)
    runner.respond(DELETE, said)
    c.client_terminate(4242)
    c.namespace_delete("kf_abc")
    assert tuple(CLIENT_LIST) not in runner.argvs and tuple(NAMESPACE_LIST) not in runner.argvs


@pytest.mark.parametrize("said", UNKNOWN_WORDINGS)
def test_v3_client_terminate_is_judged_by_the_client_list_read_back(said):
    """An answer no pattern knows, done or failed: the client still listed after it is a
    failure (taken as done, a failed drain let the watchdog kill the client mid-kernel), one
    that is gone is a success, whatever the words."""
    c, runner = v3()
    runner.respond(TERMINATE, said)
    runner.respond(CLIENT_LIST, "4242,shared,0,kf_abc,python x.py\n4243,shared,0,kf_abc,y\n",
                   "4243,shared,0,kf_abc,y\n")
    with pytest.raises(MpsError) as exc:
        c.client_terminate(4242)
    assert exc.value.reason == "CommandFailed"
    assert "'client terminate 4242'" in exc.value.message
    assert "still lists client 4242" in exc.value.message
    assert said.strip() in exc.value.message
    c.client_terminate(4242)  # the next readback shows it gone
    assert runner.argvs.count(tuple(CLIENT_LIST)) == 2


@pytest.mark.parametrize("said", UNKNOWN_WORDINGS)
def test_v3_namespace_delete_is_judged_by_the_namespace_list_read_back(said):
    c, runner = v3()
    runner.respond(DELETE, said)
    runner.respond(NAMESPACE_LIST, "default\nkf_abc\nkf_def\n", "default\nkf_def\n")
    with pytest.raises(MpsError) as exc:
        c.namespace_delete("kf_abc", missing_ok=True)
    assert exc.value.reason == "CommandFailed"
    assert "'namespace delete kf_abc --server=shared'" in exc.value.message
    assert "still lists namespace kf_abc" in exc.value.message
    c.namespace_delete("kf_abc")  # the next readback shows it gone
    assert runner.argvs.count(tuple(NAMESPACE_LIST)) == 2


def test_a_readback_that_fails_fails_the_command():
    """Nobody can tell whether the client was drained: not done."""
    c, runner = v3()
    runner.respond(TERMINATE, "Sent terminate request to client 4242\n")
    runner.respond(CLIENT_LIST, "Error: the server is busy\n")
    with pytest.raises(MpsError) as exc:
        c.client_terminate(4242)
    assert exc.value.reason == "NamespaceBusy"


def test_an_unknown_answer_is_quoted_in_a_bounded_excerpt():
    c, runner = v3()
    runner.respond(TERMINATE, "deferred " * 100)
    runner.respond(CLIENT_LIST, "4242,shared,0,kf_abc,python x.py\n")
    with pytest.raises(MpsError) as exc:
        c.client_terminate(4242)
    assert len(exc.value.message) < 400 and exc.value.message.count("deferred") < 30


def test_classify_answer_is_clean_for_values():
    for text in ["", "4G", "25.0", "1234\n5678", "kf_abc\nkf_def", "4321,shared,kf_abc",
                 "/run/kf/mps/shared/kf_abc"]:
        assert classify_answer(text) is None, text


def test_every_reason_is_registered():
    assert {"MpsDaemonUnreachable", "UnknownCommand", "NamespaceBusy", "NamespaceNotFound",
            "InvalidArgument", "ProtocolUnsupported"} <= e.REASONS
    err = MpsError("NamespaceBusy", "x")
    assert (err.reason, err.message, str(err)) == ("NamespaceBusy", "x", "x")
    assert err == MpsError("NamespaceBusy", "x")


def test_protocol_probe_reads_help_whatever_its_exit_status():
    runner = RecordingRunner().respond([BIN, "--help"], CommandResult(1, "", V3_HELP))
    c = control(runner)
    assert c.supports_protocol_v3() is True
    assert runner.calls[0].env == ENV and runner.calls[0].stdin is None
    runner = RecordingRunner(CommandNotFound([BIN], f"cannot execute {BIN}: No such file"))
    with pytest.raises(MpsError) as exc:
        control(runner).supports_protocol_v3()
    assert exc.value.reason == "MpsBinaryNotFound"


def test_quit_of_a_v3_daemon_uses_the_quit_option():
    runner = RecordingRunner()
    control(runner, protocol_v3=True).quit(timeout=3)
    assert [(c.argv, c.stdin, c.timeout) for c in runner.calls] == [((BIN, "-q"), None, 3)]


def test_a_rejection_with_a_non_zero_exit_keeps_its_reason():
    c, runner = v3()
    runner.respond([BIN, "-p", "3", "namespace", "delete", "kf_abc", "--server=shared"],
                   CommandResult(1, "", "Error: namespace kf_abc has 1 client attached\n"))
    with pytest.raises(MpsError) as exc:
        c.namespace_delete("kf_abc")
    assert exc.value.reason == "NamespaceBusy"
    assert exc.value.message == ("the MPS control daemon rejected 'namespace delete kf_abc "
                                 "--server=shared': Error: namespace kf_abc has 1 client "
                                 "attached")
