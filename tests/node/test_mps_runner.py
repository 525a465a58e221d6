"""The command seam: the real subprocess runner and the recording fake."""

from __future__ import annotations

import json
import sys

import pytest

from kai_fractions.node.mps.runner import (
    CommandNotFound,
    CommandResult,
    CommandTimeout,
    RecordedCall,
    RecordingRunner,
    SubprocessRunner,
)

PY = sys.executable


def test_subprocess_runner_passes_stdin_and_captures_both_streams():
    code = "import sys; d = sys.stdin.read(); print(d.upper(), end=''); print('e', file=sys.stderr)"
    result = SubprocessRunner().run([PY, "-c", code], stdin="get_server_list\n")
    assert result == CommandResult(0, "GET_SERVER_LIST\n", "e\n")


def test_subprocess_runner_never_lends_its_own_stdin():
    # No stdin given: the child reads EOF at once (a client waiting for commands would hang).
    result = SubprocessRunner().run([PY, "-c", "import sys; print(repr(sys.stdin.read()))"],
                                    timeout=5)
    assert result.stdout == "''\n"


def test_subprocess_runner_env_is_only_what_is_asked_plus_path(monkeypatch):
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    code = "import os, json; print(json.dumps(sorted(os.environ)))"
    result = SubprocessRunner().run([PY, "-c", code], env={"CUDA_MPS_PIPE_DIRECTORY": "/x"})
    names = set(json.loads(result.stdout))
    assert "CUDA_MPS_PIPE_DIRECTORY" in names
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in names
    assert "CUDA_VISIBLE_DEVICES" not in names
    assert names <= {"CUDA_MPS_PIPE_DIRECTORY", "PATH", "LANG", "LC_ALL", "LC_CTYPE"}


def test_subprocess_runner_exit_status_is_returned_not_raised():
    result = SubprocessRunner().run([PY, "-c", "raise SystemExit(3)"])
    assert result.returncode == 3


def test_subprocess_runner_timeout_and_missing_binary():
    with pytest.raises(CommandTimeout) as exc:
        SubprocessRunner().run([PY, "-c", "import time; time.sleep(5)"], timeout=0.2)
    assert exc.value.timeout == 0.2
    assert exc.value.message == f"{PY} did not finish within 0.2s"
    with pytest.raises(CommandNotFound) as exc2:
        SubprocessRunner().run(["/nonexistent/nvidia-cuda-mps-control"])
    assert exc2.value.message.startswith("cannot execute /nonexistent/nvidia-cuda-mps-control")


def test_recording_runner_records_and_answers_in_order():
    runner = RecordingRunner()
    runner.respond(["b"], "one", CommandResult(1, "", "two"), stdin="q\n")
    runner.respond(["b"], "any stdin")
    runner.respond(["c"], lambda call: CommandResult(0, call.argv[-1], ""))
    assert runner.run(["b"], stdin="q\n") == CommandResult(0, "one", "")
    assert runner.run(["b"], stdin="q\n") == CommandResult(1, "", "two")
    assert runner.run(["b"], stdin="q\n") == CommandResult(1, "", "two")  # the last one repeats
    assert runner.run(["b"], stdin="other\n").stdout == "any stdin"
    assert runner.run(["c"]).stdout == "c"
    assert runner.run(["unscripted"], env={"A": "1"}, timeout=3) == CommandResult(0, "", "")
    assert runner.calls[-1] == RecordedCall(("unscripted",), None, {"A": "1"}, 3)
    assert runner.argvs == [("b",)] * 4 + [("c",), ("unscripted",)]


def test_recording_runner_raises_scripted_exceptions():
    runner = RecordingRunner(CommandTimeout(["x"], 1))
    with pytest.raises(CommandTimeout):
        runner.run(["x"])
    assert len(runner.calls) == 1
    with pytest.raises(ValueError, match="at least one response"):
        runner.respond(["x"])
