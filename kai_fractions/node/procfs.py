"""What `/proc` says about a process: its pod and container (from its cgroup), whether it still
runs, its command line, environment and mount namespace, and who holds a file lock. The root is
configurable so tests use a fake tree.

A pin (`Procfs.pin`) holds a process by its pidfd, so that a later look tells it from another
process that reuses its pid.

A process's cgroup is the `0::` line of `/proc/<pid>/cgroup` (cgroup v2). Kubernetes layouts:
- systemd driver: `/kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid_with_underscores>
  .slice/<runtime>-<id>.scope` (guaranteed pods have no qos level), runtime `cri-containerd`,
  `crio` or `docker`;
- cgroupfs driver: `/kubepods/<qos>/pod<uid>/<id>` (cri-o: `crio-<id>`).
Anything else (host services, user sessions, other orchestrators) belongs to no pod.

A reader in a cgroup namespace of its own (containerd gives one to every non-privileged container
on cgroup v2) sees paths relative to its own cgroup, the common ancestors elided: `/../../
kubepods-besteffort-pod<uid>.slice/...` (systemd: the slice names still say kubepods and the
uid), `/../../pod<uid>/<id>` or `/../../../besteffort/pod<uid>/<id>` (cgroupfs: no kubepods
left). Both are placed. A relative path that is neither, yet has a pod-shaped component past the
`..`s (`pod<uid>`, `...-pod<uid>.slice`, or anything of `kubepods`: `may_be_a_pod`), may be a
pod's the reader cannot place: the watchdog counts such a process as one it cannot see, rather
than as no pod's. Any other relative path is no pod's: the kubelet names every pod cgroup so,
whatever the layout around it, and what is left (the host's services, however the
distribution groups them: `system.slice`, `runtime.slice`, Talos's `system`; a container
runtime's own `docker/<id>`; a sibling container of the reader's own pod, `../<runtime>-<id>
.scope`) is the host's or the reader's own pod's.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import select
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True, slots=True)
class PodContainer:
    pod_uid: str
    """With dashes, lower case, as in the pod's metadata.uid."""
    container_id: str | None
    """The runtime's container ID (hex, no `containerd://`), None for a process in the pod's
    own cgroup rather than a container's."""
    runtime: str | None = None
    """`containerd`, `crio` or `docker` when the cgroup name says; None for a bare ID."""


_SYSTEMD_POD = re.compile(
    r"kubepods(?:-(?:besteffort|burstable|guaranteed))?-pod(?P<uid>[0-9a-fA-F_]{32,36})\.slice")
_CGROUPFS_POD = re.compile(r"pod(?P<uid>[0-9a-fA-F-]{32,36})")
_SYSTEMD_CONTAINER = re.compile(
    r"(?P<rt>cri-containerd|crio|docker)-(?P<id>[0-9a-f]{12,64})\.scope")
_CGROUPFS_CONTAINER = re.compile(r"(?:(?P<rt>cri-containerd|crio|docker)-)?(?P<id>[0-9a-f]{12,64})")
_RUNTIMES = {"cri-containerd": "containerd", "crio": "crio", "docker": "docker"}
_GONE = ("Z", "X", "x")
"""The states (`stat`'s third field) of a process that has exited: a zombie, or dead."""
_CGROUPFS_QOS = ("besteffort", "burstable")
"""The QoS level of a cgroupfs pod path (a Guaranteed pod sits right under kubepods)."""
_POD_SHAPED = re.compile(r"(?:.*-)?pod(?P<uid>[0-9a-fA-F_-]{32,36})(?:\.slice)?")
"""A cgroup name as the kubelet gives a pod's: `pod<uid>` (cgroupfs), `kubepods-<qos>-pod<uid
with underscores>.slice` or any `...-pod<uid>.slice` (systemd)."""
_UID_SHAPE = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}")


def cgroup_v2_path(text: str) -> str | None:
    """The cgroup path of a `/proc/<pid>/cgroup` file: its `0::` line. On a cgroup v1 or hybrid
    host, where `0::` says nothing about pods, the first controller line that does (the v1
    hierarchies agree on the pod part)."""
    unified = v1_pod = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        if parts[0] == "0" and parts[1] == "":
            unified = parts[2] if unified is None else unified
        elif v1_pod is None and "kubepods" in parts[2]:
            v1_pod = parts[2]
    if unified is not None and ("kubepods" in unified or v1_pod is None):
        return unified
    return v1_pod


def parse_cgroup_path(path: str) -> PodContainer | None:
    """Pod UID and container ID named by a cgroup path; None when it is not a pod's.

    Tolerates a cgroup-namespace prefix (`/../../kubepods...`, and for the cgroupfs layout,
    where the namespace elides `kubepods` itself, `/../../[<qos>/]pod<uid>/<id>`) and cgroups
    nested inside the container's (the component right after the pod's is the container)."""
    parts = [p for p in path.split("/") if p and p != ".."]
    if not any(p.startswith("kubepods") for p in parts):
        return _parse_relative_cgroupfs(path)
    for i, part in enumerate(parts):
        m = _SYSTEMD_POD.fullmatch(part)
        systemd = m is not None
        if m is None and any(p.startswith("kubepods") for p in parts[:i]):
            m = _CGROUPFS_POD.fullmatch(part)
        if m is None:
            continue
        return _pod_container(m.group("uid"), parts[i + 1:], systemd)
    return None


def _relative_tail(path: str) -> list[str] | None:
    """The components after the leading `/..` run of a path relative to the reader's cgroup
    namespace; None for a path that is not one (no leading `..`, or one further in)."""
    raw = path.strip().split("/")
    if len(raw) < 2 or raw[0] != "" or raw[1] != "..":
        return None
    i = 1
    while i < len(raw) and raw[i] == "..":
        i += 1
    tail = [p for p in raw[i:] if p]
    return None if ".." in tail else tail


def _parse_relative_cgroupfs(path: str) -> PodContainer | None:
    """A cgroupfs pod path seen from a cgroup namespace below `kubepods` (the agent's own
    container): `/..` one or more times, then `[besteffort|burstable/]pod<uid>[/<id>...]`,
    exactly; anything else is no pod."""
    tail = _relative_tail(path)
    if not tail:
        return None
    if tail[0] in _CGROUPFS_QOS:
        tail = tail[1:]
    m = _CGROUPFS_POD.fullmatch(tail[0]) if tail else None
    if m is None:
        return None
    return _pod_container(m.group("uid"), tail[1:], systemd=False)


def _pod_container(raw_uid: str, below: list[str], systemd: bool) -> PodContainer | None:
    """The pod of `raw_uid` (as its cgroup names it) and the container `below[0]` names."""
    uid = raw_uid.replace("_", "-").lower()
    if not _UID_SHAPE.fullmatch(uid):
        return None
    if not below:
        return PodContainer(uid, None)
    child = below[0]
    if child.startswith("crio-conmon-"):
        return PodContainer(uid, None)  # cri-o's monitor process, not the container
    cm = (_SYSTEMD_CONTAINER if systemd else _CGROUPFS_CONTAINER).fullmatch(child)
    if cm is None:
        return PodContainer(uid, None)
    runtime = _RUNTIMES.get(cm.group("rt") or "")
    return PodContainer(uid, cm.group("id"), runtime)


def may_be_a_pod(path: str) -> bool:
    """Whether a cgroup path `parse_cgroup_path` places in no pod may still be a pod's: one
    relative to the reader's cgroup namespace (`/..` first) with a component past the `..`s
    that is pod-shaped (`pod<uid>`, `...-pod<uid>.slice`: the kubelet names every pod's
    cgroup so, with either cgroup driver) or of `kubepods` (its parents). Such a path hides
    whose process it is (a layout the parse does not know, a kubelet `--cgroup-root`
    elsewhere): the watchdog cannot tell it from a managed container's, and the socket's
    caller check does not take it for the host's. Any other relative path is not a pod's: an
    ancestor of the reader (nothing after the `..`s), a host service wherever the distribution
    puts it (`system.slice`, EKS AL2023's `runtime.slice/containerd.service`, Talos's
    `system/...`), a container runtime's own (`docker/<id>` with cgroupfs), or a sibling
    container of the reader's own pod (`../cri-containerd-<id>.scope`): the host's, or the
    reader's own pod's."""
    if parse_cgroup_path(path) is not None:
        return False
    tail = _relative_tail(path)
    return bool(tail) and any(_pod_shaped(part) for part in tail)


def _pod_shaped(part: str) -> bool:
    """A cgroup name the kubelet gives a pod (`_POD_SHAPED`, its uid of a pod UID's shape) or
    its parents (anything of `kubepods`)."""
    if part.startswith("kubepods"):
        return True
    m = _POD_SHAPED.fullmatch(part)
    return m is not None and _UID_SHAPE.fullmatch(m["uid"].replace("_", "-").lower()) is not None


def normalize_container_id(container_id: str) -> str:
    """`containerd://abc` (a pod status's containerID) -> `abc` (what the cgroup says)."""
    return container_id.split("://", 1)[-1].strip().lower()


class Pin(Protocol):
    def exited(self) -> bool:
        """Whether the pinned process has exited (its pid may be another process's now)."""
        ...

    def close(self) -> None: ...


class PidfdPin:
    """A process held by its pidfd, which turns readable once it exits (reaped or not)."""

    def __init__(self, fd: int):
        self.fd = fd
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)

    def exited(self) -> bool:
        return bool(self._poller.poll(0))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    __del__ = close


class Unpinned:
    """No pidfd to hold: never says exited, so what was read of the pid is trusted as before."""

    def exited(self) -> bool:
        return False

    def close(self) -> None:
        pass


UNPINNED = Unpinned()


class Procfs:
    def __init__(self, root: str | os.PathLike[str] = "/proc"):
        self.root = Path(root)

    @functools.cached_property
    def own_pid_namespace(self) -> bool:
        """Whether the root is a /proc of this process's pid namespace (the agent's own, or the
        host's with hostPID): only then are its pids the ones `pidfd_open` takes. A fake tree
        (tests, the demo's simulated node) is not. `self/status` of a /proc mounted for an
        outer pid namespace lists our pid in each namespace (`NSpid:`); of our own, one."""
        nspid = next((line.split()[1:] for line in (self._read("self", "status") or "")
                      .splitlines() if line.startswith("NSpid:")), None)
        if nspid is not None:
            return nspid == [str(os.getpid())]
        try:  # a kernel before 4.1 has no NSpid
            return os.readlink(self.root / "self") == str(os.getpid())
        except OSError:
            return False

    def pin(self, pid: int) -> Pin | None:
        """Holds the process that has `pid` now; None when no process has it. `UNPINNED` where
        the root is not of this pid namespace, or the kernel has no pidfds (before 5.3).
        Raises OSError when no file descriptor is left for it (EMFILE, ENFILE)."""
        if not self.own_pid_namespace:
            return UNPINNED
        try:
            return PidfdPin(os.pidfd_open(pid))
        except ProcessLookupError:
            return None
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise
            return UNPINNED

    def _read(self, *parts: str) -> str | None:
        try:
            return self.root.joinpath(*parts).read_text(errors="replace")
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            return None  # the process exited (or never was)

    def cgroup_path(self, pid: int) -> str | None:
        """The process's cgroup path (`cgroup_v2_path`); None when it has no /proc entry.
        Raises OSError (PermissionError: `hidepid=1`, an LSM) when the entry is there but
        cannot be read: whose process it is is then unknown, which is not "nobody's"."""
        text = self._read(str(int(pid)), "cgroup")
        return None if text is None else cgroup_v2_path(text)

    def container_of(self, pid: int) -> PodContainer | None:
        """The pod and container of `pid`; None for a host process or a pid that is gone.
        Raises OSError as `cgroup_path`."""
        path = self.cgroup_path(pid)
        return None if path is None else parse_cgroup_path(path)

    def state(self, pid: int) -> str | None:
        """The one-letter state from `stat` (`R`, `S`, `Z`, ...); None when there is no such pid."""
        text = self._read(str(int(pid)), "stat")
        if not text or ")" not in text:
            return None
        fields = text.rsplit(")", 1)[1].split()
        return fields[0] if fields else None

    def is_alive(self, pid: int) -> bool:
        """Runs (a zombie nobody reaped yet counts as gone: it holds no GPU and no lock)."""
        return self.state(pid) not in (None, *_GONE)

    def threads(self, pid: int) -> int:
        """How many threads of the process are left (`task/`); 0 when there is no such pid."""
        try:
            return sum(1 for _ in os.scandir(self.root / str(int(pid)) / "task"))
        except (FileNotFoundError, NotADirectoryError, ProcessLookupError):
            return 0

    def comm(self, pid: int) -> str | None:
        text = self._read(str(int(pid)), "comm")
        return None if text is None else text.strip()

    def pids(self) -> list[int]:
        """Every process the root lists now (its numeric entries), in no particular order."""
        try:
            return [int(entry.name) for entry in os.scandir(self.root) if entry.name.isdigit()]
        except FileNotFoundError:
            return []

    def _read_bytes(self, *parts: str) -> bytes | None:
        try:
            return self.root.joinpath(*parts).read_bytes()
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            return None

    def cmdline(self, pid: int) -> list[str] | None:
        """The process's argv; None when it is gone, [] for a kernel thread or a zombie."""
        raw = self._read_bytes(str(int(pid)), "cmdline")
        if raw is None:
            return None
        args = raw.split(b"\0")
        if args[-1] == b"":
            args.pop()  # the terminator of the last one
        return [arg.decode(errors="replace") for arg in args]

    def environ(self, pid: int) -> dict[str, str] | None:
        """The environment the process started with (`environ`, as exec gave it); None when it
        is gone, or cannot be read yet: a zombie, or a process whose environ and cmdline both
        read empty (the kernel shows neither while exec builds the new image, nor once an
        exiting process's memory is gone, nor for a kernel thread). An empty environment of a
        process with a command line is one it was started with (`env -i`): {}. Raises OSError
        (PermissionError: another user's process, unless root) when the entry is there but
        cannot be read: what it holds is then unknown, not empty."""
        raw = self._read_bytes(str(int(pid)), "environ")
        if raw is not None and not raw.strip(b"\0"):
            if not self.cmdline(pid) or self.state(pid) in _GONE:
                return None
            # Its cmdline reads now: exec may have finished only since the first read.
            raw = self._read_bytes(str(int(pid)), "environ")
        if raw is None:
            return None
        env: dict[str, str] = {}
        for item in raw.split(b"\0"):
            name, sep, value = item.partition(b"=")
            if sep and name:
                env.setdefault(name.decode(errors="replace"), value.decode(errors="replace"))
        return env

    def mount_namespace(self, pid: int | str) -> str | None:
        """The process's mount namespace (`mnt:[4026531841]`; `pid` may be `"self"`); None when
        it is gone. Raises OSError when the link cannot be read (another user's process)."""
        try:
            return os.readlink(self.root / str(pid if pid == "self" else int(pid)) / "ns" / "mnt")
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            return None

    def lock_holders(self, major: int, minor: int, inode: int) -> list[int]:
        """Pids holding a lock on the file (device major:minor, inode), from `<root>/locks`
        (`1: POSIX  ADVISORY  WRITE 9148 fe:00:2147857 0 EOF`); waiters (`->`) and open file
        description locks (pid -1) are left out."""
        text = self._read("locks") or ""
        wanted = (major, minor, inode)
        pids = []
        for line in text.splitlines():
            fields = line.split()
            if len(fields) < 6 or fields[1] == "->":
                continue
            try:
                pid = int(fields[4])
                maj, mnr, ino = fields[5].split(":")
                key = (int(maj, 16), int(mnr, 16), int(ino))
            except ValueError:
                continue
            if key == wanted and pid > 0 and pid not in pids:
                pids.append(pid)
        return pids

    def lock_holders_of(self, path: str | os.PathLike[str]) -> list[int]:
        try:
            st = os.stat(path)
        except OSError:
            return []
        return self.lock_holders(os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
