"""`kai-fractions demo` stopped by a signal while a library is running: the exit code says
stopped, not failed, whatever the library made of the exception the handler raised.

CI once saw SIGTERM land while the kubernetes client's pydantic built a validator; pydantic
wrapped the handler's exception in a SchemaError and the run exited 1 instead of 143."""

from __future__ import annotations

import argparse
import os
import signal

import pytest

from kai_fractions.cli import demo as demo_cli
from kai_fractions.demo import session as demo_session


class WrappingSession:
    """Stands in for DemoSession: starting it delivers `sig` to this process inside a library
    call that turns anything raised into its own error, as pydantic-core does."""

    sig = signal.SIGTERM
    stopped = False

    def __init__(self, config, progress) -> None:
        self.progress = progress

    def start(self) -> None:
        try:
            os.kill(os.getpid(), self.sig)
            for _ in range(1000):  # a few bytecodes: the handler runs in one of them
                pass
        except BaseException as e:
            raise RuntimeError(f"Error building validator: {e!r}") from e

    def stop(self) -> None:
        type(self).stopped = True


@pytest.fixture(autouse=True)
def _sigint_not_ignored():
    """A test run started in the background (`nohup`, `&` in a script) inherits SIGINT ignored,
    and Python then leaves it so: the SIGINT case needs Python's own handler, as a terminal's
    run has it."""
    inherited = signal.getsignal(signal.SIGINT)
    if inherited is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, inherited)


def _run(monkeypatch, sig: int) -> int:
    monkeypatch.setattr(demo_session, "DemoSession", WrappingSession)
    monkeypatch.setattr(WrappingSession, "sig", sig)
    monkeypatch.setattr(WrappingSession, "stopped", False)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    code = demo_cli.run(argparse.Namespace(config=None, keep=False, verbose=False))
    assert {s: signal.getsignal(s) for s in before} == before  # handlers put back
    assert WrappingSession.stopped
    return code


@pytest.mark.parametrize("sig, code, said", [
    (signal.SIGTERM, 143, ["kai-fractions demo: terminated (SIGTERM) before the end"]),
    (signal.SIGINT, 130, []),
], ids=["SIGTERM", "SIGINT"])
def test_a_signal_wrapped_by_a_library_still_ends_as_stopped(monkeypatch, capsys, sig, code,
                                                             said):
    assert _run(monkeypatch, sig) == code
    lines = capsys.readouterr().err.splitlines()
    assert lines[:-2] == said  # nothing of the library's error
    assert lines[-2].endswith("] stopping") and lines[-1].endswith("] stopped")
