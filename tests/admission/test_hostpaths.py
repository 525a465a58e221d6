"""`hostpaths.canonical`: the path the kernel would open, with the known symlinks and /proc."""

from __future__ import annotations

import pytest

from kai_fractions.admission.hostpaths import canonical, overlaps, same


@pytest.mark.parametrize(("path", "expected"), [
    ("/var/lib/kai-fractions", "/var/lib/kai-fractions"),
    ("//var///lib/./kai-fractions/", "/var/lib/kai-fractions"),
    ("var/lib", "/var/lib"),  # relative: from the root
    ("/../../var/lib", "/var/lib"),
    ("/var/run/kai-fractions", "/run/kai-fractions"),
    ("/var/run/../lib", "/lib"),  # `..` climbs from the symlink's target, as the kernel does
    ("/var/lock", "/run/lock"),
    ("/proc/1/root/var/lib", "/var/lib"),
    ("/proc/self/root/proc/1/root/run", "/run"),
    ("/proc/1/task/1/root/var/run", "/run"),
    ("/proc/thread-self/root", "/"),
    ("/proc", "/"), ("/proc/", "/"), ("/proc/1", "/"), ("/proc/1/cwd", "/"),
    ("/proc/self/fd/3", "/"), ("/proc/1/task", "/"), ("/proc/1/map_files/x", "/"),
    ("/proc/meminfo", "/proc/meminfo"), ("/proc/sys/kernel", "/proc/sys/kernel"),
    ("/var/run-x", "/var/run-x"),
    # systemd's /dev/fd -> /proc/self/fd: the opening process's file, anywhere
    ("/dev/fd/3", "/"), ("/dev/fd", "/"), ("/dev/stdin", "/"), ("/dev/stderr/x", "/"),
    ("/dev/fdx", "/dev/fdx"), ("/dev/null", "/dev/null"),
    # the kernel's /proc/net -> self/net and /proc/mounts -> self/mounts: `..` after them
    # climbs to the opening process, whose root is the host's for a host process
    ("/proc/net/../root/var/lib/kai-fractions/markers", "/var/lib/kai-fractions/markers"),
    ("/proc/mounts/../root/var/run", "/run"), ("/proc/net/../cwd", "/"),
    ("/proc/net/..", "/"), ("/proc/self/net/stat/../..", "/"),
    # ... while the files themselves lead nowhere: a network namespace's tables, a mount table
    ("/proc/net", "/proc/self/net"), ("/proc/net/dev", "/proc/self/net/dev"),
    ("/proc/mounts", "/proc/self/mounts"), ("/proc/1/net/tcp", "/proc/1/net/tcp"),
    ("/proc/netx", "/proc/netx"),
    # a path that ends at a process's directory after a `..` is that directory: anywhere
    ("/proc/1/task/1/..", "/"), ("/proc/1/task/1/net/../..", "/"), ("/proc/1/cwd/..", "/"),
])
def test_canonical(path: str, expected: str) -> None:
    assert canonical(path) == expected


def test_a_hostile_path_costs_bounded_work_and_reaches_everything() -> None:
    assert canonical("/var/run/.." * 5000) == "/"


def test_overlaps_and_same() -> None:
    assert overlaps("/", "/var/lib/x") and overlaps("/var/lib/x/y", "/var/lib/x")
    assert not overlaps("/var/lib/xy", "/var/lib/x")
    assert same("/var/run/kai-fractions/mps", "/run/kai-fractions/mps/")
