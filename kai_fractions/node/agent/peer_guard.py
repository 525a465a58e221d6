"""Who is calling the NodeEnforcer socket, by the kernel's word (SO_PEERCRED), and what it may do.

The socket's mode (0600, root) keeps other users out, but a root container that reaches the
socket's directory (a hostPath admission did not stop: a namespace it does not cover, or a
privileged pod) is root too. So each connection's peer credentials decide:

- a uid not in `allowed_uids` (default: root and the agent's own user) may call nothing;
- a process in a pod's cgroup, other than the node agent's own pod, may read the node's state
  but not Provision, Release or Drain anything: a workload must not lift other pods' limits;
- a process whose pid the agent cannot see (another pid namespace: SO_PEERCRED says 0) cannot be
  told from a pod, so it is treated like one; so is one gone before the agent placed it, and
  one whose cgroup, read from the agent's own cgroup namespace, has a pod-shaped component the
  agent cannot place (`procfs.may_be_a_pod`). A relative cgroup with none (a host service
  wherever the distribution puts it, a container of the agent's own pod) is the host's.

Where a caller runs is read once, as its connection is accepted, and kept with its credentials:
read at each call instead, a pod process could connect, fork, exit, and have its child call on
the inherited connection from a pid that no longer names anything (which read as the host).
Where the kernel gives the peer's pidfd (SO_PEERPIDFD, Linux 6.5), the process is checked to be
alive after its cgroup was read: exited, its pid may already name another process (a host
one), so it is not placed (nor is one whose pidfd the kernel refuses: reaped already). Older
kernels leave that window open: a pid reused between the connecting process's exit and the
accept.

grpcio does not show a call's peer credentials, so the agent owns the public socket itself
(`Relay`): it reads the peer's credentials when it accepts, then relays the bytes to the gRPC
server on a private socket in a directory only the agent's user can enter, from a client socket
bound to a fresh, unguessable path there. gRPC reports that path as the call's peer
(`unix:<path>`), which `PeerTable` maps back to the credentials. A call whose peer is not in the
table (a root process that connected to the private socket directly) is refused.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import secrets
import shutil
import signal
import socket
import struct
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from ..procfs import Procfs, may_be_a_pod, parse_cgroup_path

log = logging.getLogger(__name__)

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5; Python 3.11 has no name for it
_MAX_UNIX_PATH = 100  # sun_path is 108 bytes; leave room for the peer names


@dataclass(frozen=True, slots=True)
class Peer:
    pid: int
    uid: int
    pod: str | None = None
    """The pod (uid) whose cgroup the caller's process was in when it connected; None: the
    host."""
    placed: bool = True
    """False when its process could not be placed then (another pid namespace, or gone)."""
    hidden: str | None = None
    """Its cgroup, when that is relative to the agent's cgroup namespace and has a pod-shaped
    component the parse cannot place (`procfs.may_be_a_pod`): it may be a pod's. A relative
    cgroup with none (a host service, a container of the agent's own pod) is the host's."""


def peer_of(sock: socket.socket, procfs: Procfs) -> Peer:
    """The kernel's credentials of the connecting process, and where it runs, read now."""
    pid, uid, _gid = _CREDS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                   _CREDS.size))  # no rule reads the gid
    if pid <= 0:
        return Peer(pid, uid, placed=False)
    try:
        pidfd: int | None = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as e:
        if e.errno != errno.ENOPROTOOPT:  # EINVAL (6.5 to 6.14) or ESRCH: reaped already
            return Peer(pid, uid, placed=False)
        pidfd = None  # a kernel before 6.5
    try:
        path = procfs.cgroup_path(pid)
        if path is None or (pidfd is not None and not _alive(pidfd)):
            return Peer(pid, uid, placed=False)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    owner = parse_cgroup_path(path)
    if owner is None and may_be_a_pod(path):
        return Peer(pid, uid, hidden=path)
    return Peer(pid, uid, pod=owner.pod_uid if owner is not None else None)


def _alive(pidfd: int) -> bool:
    """Whether the process is still there (a zombie too: it holds its pid until reaped)."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def default_allowed_uids() -> frozenset[int]:
    """Root, and the user the agent runs as (who owns the socket anyway)."""
    return frozenset({0, os.geteuid()})


class PeerPolicy:
    """Decides what a peer may do; the answer is a refusal message, or None."""

    def __init__(self, procfs: Procfs, allowed_uids: Iterable[int] | None = None,
                 own_pid: int | None = None) -> None:
        self.procfs = procfs
        self.allowed_uids = frozenset(default_allowed_uids() if allowed_uids is None
                                      else allowed_uids)
        if not self.allowed_uids:
            raise ValueError("allowed_uids: at least one uid must be allowed to call the node "
                             "agent (root's, 0)")
        self.own_pid = os.getpid() if own_pid is None else own_pid
        own = procfs.container_of(self.own_pid)
        self.own_pod = own.pod_uid if own is not None else None

    def who_may_call(self) -> str:
        return "uid " + ", ".join(str(u) for u in sorted(self.allowed_uids))

    def refusal(self, peer: Peer, method: str, *, changes: bool) -> str | None:
        if peer.uid not in self.allowed_uids:
            return (f"{method}: uid {peer.uid} may not call the node agent; only "
                    f"{self.who_may_call()} may (the socket checks its caller's credentials)")
        if not changes or peer.pid == self.own_pid:
            return None
        if peer.pid <= 0:
            return (f"{method}: refused: the caller's pid is not visible to the node agent "
                    "(another pid namespace), so it cannot be told from a pod; call it from "
                    "the host's pid namespace or the node agent's own pod")
        if not peer.placed:
            return (f"{method}: refused: pid {peer.pid} had exited when the node agent "
                    "accepted its connection, so it cannot be told from a pod; call from a "
                    "process that stays until it is connected")
        if peer.hidden is not None:  # read as the host's, a pod could change GPU limits
            return (f"{method}: refused: pid {peer.pid} runs in cgroup {peer.hidden}, which "
                    "the node agent cannot tell from a pod's (it reads cgroups from a cgroup "
                    "namespace of its own); call from the host or the node agent's own "
                    "container")
        if peer.pod is not None and peer.pod != self.own_pod:
            return (f"{method}: refused: pid {peer.pid} runs in pod {peer.pod}; only "
                    "processes on the host or in the node agent's own pod may change GPU "
                    "limits through this socket")
        return None


class PeerTable:
    """Relay client path -> the credentials of the connection it carries."""

    def __init__(self) -> None:
        self._peers: dict[str, Peer] = {}
        self._lock = threading.Lock()

    def add(self, path: str, peer: Peer) -> None:
        with self._lock:
            self._peers[path] = peer

    def remove(self, path: str) -> None:
        with self._lock:
            self._peers.pop(path, None)

    def lookup(self, grpc_peer: str) -> Peer | None:
        """`grpc_peer` is `ServicerContext.peer()`: `unix:<path>` for a relayed call."""
        path = grpc_peer.removeprefix("unix:")
        with self._lock:
            return self._peers.get(path)


def private_dir(public_path: str) -> str:
    """A fresh 0700 directory for the gRPC server's socket and the relay's client sockets:
    `.<socket name>.d` next to the public socket (a previous agent's, left by a crash, is
    replaced), or a new one in the temporary directory when that path would be too long."""
    parent = os.path.dirname(public_path) or "."
    directory = os.path.join(parent, f".{os.path.basename(public_path)}.d")
    if len(directory) + 32 > _MAX_UNIX_PATH:  # room for the relay's peer names
        return tempfile.mkdtemp(prefix="kf-enforcer-")
    if os.path.islink(directory):
        os.unlink(directory)
    shutil.rmtree(directory, ignore_errors=True)
    os.mkdir(directory, 0o700)
    os.chmod(directory, 0o700)  # whatever the umask
    return directory


class Relay:
    """Accepts on the public socket (mode `mode`) and relays each connection to `upstream`."""

    def __init__(self, public_path: str, upstream: str, directory: str, peers: PeerTable,
                 mode: int, procfs: Procfs) -> None:
        self.upstream, self.directory = upstream, directory
        self.peers = peers
        self.procfs = procfs
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # born 0600: no window where others may connect
        try:
            self._listener.bind(public_path)
        except OSError:
            self._listener.close()
            raise
        finally:
            os.umask(old)
        os.chmod(public_path, mode)
        self._listener.listen(64)
        self._listener.settimeout(0.2)  # so `close` is noticed without a wake-up trick
        self._thread = threading.Thread(target=self._accept, name="node-enforcer-relay",
                                        daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("NodeEnforcer relay: accept failed")
                continue
            conn.settimeout(None)
            threading.Thread(target=self._serve, args=(conn,), name="node-enforcer-conn",
                             daemon=True).start()

    def _track(self, *socks: socket.socket, add: bool) -> None:
        with self._lock:
            for s in socks:
                (self._open.add if add else self._open.discard)(s)

    def _serve(self, conn: socket.socket) -> None:
        # An unguessable name, bound BEFORE it enters the table and kept bound until it left it:
        # a process that connects to the private socket directly is credited with no one's
        # credentials. (Root in this 0700 directory could still unlink a live entry's socket
        # and bind its own there while that caller is connected; such root is the node's, which
        # admission keeps pods from: the agent's directories are refused as host paths.)
        path = os.path.join(self.directory, f"p{next(self._ids)}-{secrets.token_hex(6)}.sock")
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._track(conn, up, add=True)
        bound = False
        try:
            peer = peer_of(conn, self.procfs)
            up.bind(path)  # the name gRPC will report as this call's peer
            bound = True
            self.peers.add(path, peer)
            up.connect(self.upstream)
            log.debug("NodeEnforcer connection from pid %d uid %d", peer.pid, peer.uid)
            pump = threading.Thread(target=_copy, args=(conn, up), daemon=True)
            pump.start()
            _copy(up, conn)
            pump.join()
        except OSError as e:
            if not self._stop.is_set():
                log.warning("NodeEnforcer relay: connection dropped: %s", e)
        finally:
            self.peers.remove(path)
            self._track(conn, up, add=False)
            for s in (conn, up):
                s.close()
            if bound:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(2.0)
        with self._lock:
            for s in list(self._open):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        shutil.rmtree(self.directory, ignore_errors=True)


def _copy(src: socket.socket, dst: socket.socket) -> None:
    """Bytes from `src` to `dst` until `src` ends; then `dst` learns that no more come."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        return
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)
