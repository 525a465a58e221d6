"""Host paths compared as the node resolves them, not as they are spelled.

The kubelet hands a hostPath to the kernel, so `//var/lib/x`, `/var/lib/./x`, `/var/log/../lib/x`,
`/proc/1/root/var/lib/x` and, through the symlink every distribution ships, `/var/run/x` for
`/run/x` all open the same directory. `canonical` resolves a path component by component with
the known symlinks (so `..` after a symlink climbs from its target, as the kernel does), and
treats a `/proc` entry that can lead anywhere (a process's directory, `cwd`, `fd`, ...) as `/`:
it reaches every directory. A symlink that a writable hostPath lets a pod create on the host is
beyond any spelling check (SECURITY.md).
"""

from __future__ import annotations

import re
from collections import deque

KNOWN_SYMLINKS = {
    "/var/run": "/run",
    "/var/lock": "/run/lock",
    "/dev/fd": "/proc/self/fd",
    "/dev/stdin": "/proc/self/fd/0",
    "/dev/stdout": "/proc/self/fd/1",
    "/dev/stderr": "/proc/self/fd/2",
    "/proc/net": "/proc/self/net",
    "/proc/mounts": "/proc/self/mounts",
}
"""Symlinks on every systemd host (FHS 3.0; systemd and udev make the /dev ones; the kernel
makes the /proc ones): either spelling reaches the same directory. A /dev/fd path is the
opening process's file: anywhere. `/proc/net/..` is `/proc/self`, so `/proc/net/../root` is
the opening process's root."""
_SYMLINK_DEPTHS = frozenset(link.count("/") for link in KNOWN_SYMLINKS)

_PROCESS = re.compile(r"[0-9]+|self|thread-self")
_KERNEL_ENTRIES = frozenset({"net", "mounts"})
"""Entries of a process's directory that are the kernel's own files (its network namespace's
tables, its mount table), not a way out: what `/proc/net` and `/proc/mounts` open."""
_MAX_STEPS = 4096
"""Bounds the work on a hostile path (a symlink target is re-walked)."""
PATH_MAX = 4096
"""Linux's PATH_MAX, the terminating NUL included: the kernel opens no longer path, so a
hostPath this long is refused before it is resolved (`fits`)."""


def fits(path: str) -> bool:
    """`path` is shorter than PATH_MAX bytes, as the kernel counts them."""
    return len(path) < PATH_MAX and len(path.encode("utf-8", "surrogatepass")) < PATH_MAX


def _components(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def canonical(path: str) -> str:
    """The absolute path the kernel would open for `path` (relative = from `/`), with the known
    symlinks and `/proc/<pid>/root` resolved; a `/proc` path that may lead anywhere is `/`."""
    pending = deque(_components(path))
    out: list[str] = []
    steps = 0
    while pending:
        steps += 1
        if steps > _MAX_STEPS:
            return "/"  # not a real path; treat it as reaching everything
        part = pending.popleft()
        if part == "..":
            if out:
                out.pop()
            continue
        out.append(part)
        target = (KNOWN_SYMLINKS.get("/" + "/".join(out)) if len(out) in _SYMLINK_DEPTHS
                  else None)
        if target is not None:
            out = []
            pending.extendleft(reversed(_components(target)))
            continue
        if out[0] != "proc" or len(out) < 2:
            continue
        if not _PROCESS.fullmatch(out[1]):
            continue  # /proc/meminfo, /proc/sys/...: files of the kernel, not a way out
        tail = out[2:]
        if tail and tail[0] == "task":
            if len(tail) == 1 and pending:
                continue  # the thread id comes next
            tail = tail[2:]  # /proc/<pid>/task/<tid>/... is that thread's view of the same
        if tail and tail[0] == "root":
            out = []  # that process's root: the host's own for a host process
            continue
        if tail and tail[0] in _KERNEL_ENTRIES:
            continue  # files of the kernel; a `..` after them climbs back to the process
        if tail or not pending:
            return "/"  # cwd, fd, map_files, or the process directory itself: anywhere
    if out and out[0] == "proc" and (len(out) == 1 or _process_directory(out)):
        # /proc holds every process's root; a process's (or a thread's) directory its own. Only
        # a `..` ends a path here unclassified (`/proc/net/..` is `/proc/self`).
        return "/"
    return "/" + "/".join(out)


def _process_directory(out: list[str]) -> bool:
    """`/proc/<pid>`, `/proc/<pid>/task` or `/proc/<pid>/task/<tid>`."""
    return bool(_PROCESS.fullmatch(out[1])) and (
        len(out) == 2 or (out[2] == "task" and len(out) <= 4))


def related(a: str, b: str) -> bool:
    """Canonical paths `a` and `b` are the same directory, or one is inside the other."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def overlaps(a: str, b: str) -> bool:
    """`a` and `b` are the same directory, or one is inside the other (after `canonical`)."""
    return related(canonical(a), canonical(b))


def same(a: str, b: str) -> bool:
    return canonical(a) == canonical(b)
