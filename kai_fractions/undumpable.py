"""The gate makes itself undumpable first thing (`cli.main`, before the commands are even
imported), so no process can attach to it while it starts.

A process of the gate's user in its process namespace (`kubectl exec` into it, which the
validating webhook refuses, or a namespace the webhook skips) could otherwise ptrace it and make
it exit 0 before the node agent applied the pod's limits. An undumpable process can be traced
only with CAP_SYS_PTRACE, which no container of a fractional pod may add (`admission.isolation`).
"""

from __future__ import annotations

import ctypes
import functools
import os

PR_SET_DUMPABLE = 4


def make_undumpable() -> str | None:
    """prctl(PR_SET_DUMPABLE, 0); the reason when the kernel (or the platform) refuses it."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):
        return "prctl is not available on this platform"
    if prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        return os.strerror(ctypes.get_errno())
    return None


@functools.cache
def undumpable_once() -> str | None:
    """`make_undumpable`, done once per process: the CLI calls it as it starts the gate, and
    the gate's command reads the outcome to warn about a refusal."""
    return make_undumpable()
