"""The gate makes itself undumpable before it waits.

A process of the gate's user in its process namespace (`kubectl exec` into it, which the
validating webhook refuses, or a namespace the webhook skips) could otherwise ptrace it and make
it exit 0 before the node agent applied the pod's limits. An undumpable process can be traced
only with CAP_SYS_PTRACE, which no container of a fractional pod may add (`admission.isolation`).
"""

from __future__ import annotations

import ctypes
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
