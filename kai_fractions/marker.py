"""The readiness marker: the node agent's word to the gate that a pod's limits are in force.

One JSON file per pod, `<marker-root>/<pod-uid>/marker.json`:

    {"version": 1, "pod_uid": "...", "written_at": "<RFC3339>", "boot_id": "<the host's>",
     "containers": {"<name>": {"state": "applied" | "refused", "plan_digest": "sha256:...",
                               "reason": "CamelCase", "message": "..."}}}

The node agent writes it (`write_marker`) only after every fractional container's plan is applied,
or with a refusal; the gate reads it (`read_marker`). A marker speaks for one boot of the host
(`boot_id`, the kernel's random ID of the boot it was written in): a reboot clears the kernel's
limits but not the marker directory, so the gate and the agent treat a marker of another boot,
or one without a boot ID, as no marker at all. Writes are atomic (temp file in the same
directory, fsync, rename, fsync of the directory), so a reader sees the old marker or the new one,
never half of one. Permissions: the root 0700 (only root on the host lists pod UIDs), each pod
directory 0755 and the file 0644, so the gate, running as an unprivileged user with only its own
pod's directory mounted read-only (subPathExpr), can read it; workload containers never mount it.
A pod directory the kubelet made for that mount before the agent's first write there has the
root's mode, 0700, until that write: the gate cannot read it yet (`MarkerUnreadable`).

Standard library only: the gate imports this module and must start fast.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

MARKER_VERSION = 1
MARKER_FILE = "marker.json"
ROOT_MODE = 0o700
POD_DIR_MODE = 0o755
FILE_MODE = 0o644
TEMP_PREFIX = f".{MARKER_FILE}."
TEMP_SUFFIX = ".tmp"
"""`write_marker`'s temp files: `.marker.json.<random>.tmp` in the pod's directory."""
SET_ASIDE_FILE = "set-aside.json"
"""A marker the node agent moved out of the gate's sight: one of an earlier boot of the host (the
limits it vouched for went with that boot), or one a pass could no longer keep (its plan not in
force at the moment). No gate reads it, but it still says which plan the pod was held to."""
MAX_MARKER_BYTES = 256 * 1024
"""A marker is a few hundred bytes a container: anything larger is not one."""
GONE_PREFIX = ".gone."
"""`remove_marker` renames a gone pod's directory `.gone.<uid>.<random>` before it empties it."""

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_REASON = re.compile(r"[A-Z][A-Za-z0-9]*")
# Pod UIDs are RFC 4122 strings; refuse anything that could escape the marker root.
_POD_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,127}")
_BOOT_ID = re.compile(r"[A-Za-z0-9-]{1,64}")
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
"""A random UUID the kernel draws at each boot; the host's own in every container."""


class MarkerState(StrEnum):
    APPLIED = "applied"
    REFUSED = "refused"


class MarkerError(ValueError):
    """A marker that cannot be trusted: the message says which field and why."""


class MarkerUnreadable(MarkerError):
    """The pod's marker directory denies the reader (EACCES, and the file cannot even be
    looked up): as the gate finds its directory before the agent's first write there, which
    the kubelet made with the root's mode (0700) for the gate's subPathExpr mount. A file that
    can be looked up but not read is a MarkerError. Vouches for nothing, as any MarkerError."""


@dataclass(frozen=True, slots=True)
class ContainerMarker:
    state: MarkerState
    plan_digest: str = ""
    """The applied plan's `ContainerPlan.digest`; may be empty for a refusal without a plan."""
    reason: str = ""
    """CamelCase; required for a refusal (e.g. `InsufficientMemory`)."""
    message: str = ""
    """One sentence a user can act on; required for a refusal."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "state", MarkerState(self.state))
        except ValueError:
            raise MarkerError(f"container.state: must be applied or refused, "
                              f"got {self.state!r}") from None
        _check_container("container", self)

    @classmethod
    def applied(cls, plan_digest: str, message: str = "") -> ContainerMarker:
        return cls(MarkerState.APPLIED, plan_digest, "Applied", message)

    @classmethod
    def refused(cls, reason: str, message: str, plan_digest: str = "") -> ContainerMarker:
        return cls(MarkerState.REFUSED, plan_digest, reason, message)

    def to_dict(self) -> dict[str, str]:
        return {"state": self.state.value, "plan_digest": self.plan_digest,
                "reason": self.reason, "message": self.message}


@dataclass(frozen=True, slots=True)
class Marker:
    pod_uid: str
    written_at: str
    """RFC 3339 in UTC, e.g. `2025-01-31T12:00:00Z` (see `rfc3339`)."""
    containers: Mapping[str, ContainerMarker] = field(
        default_factory=lambda: MappingProxyType({}))
    version: int = MARKER_VERSION
    boot_id: str = ""
    """The host's boot ID when the marker was written ("" from agents before boot IDs)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "containers", MappingProxyType(dict(self.containers)))
        if self.version != MARKER_VERSION:
            raise MarkerError(f"version: must be {MARKER_VERSION}, got {self.version!r}")
        check_pod_uid(self.pod_uid)
        _check_time(self.written_at)
        if not isinstance(self.boot_id, str) or (self.boot_id
                                                   and not _BOOT_ID.fullmatch(self.boot_id)):
            raise MarkerError(f"boot_id: must be a boot ID, got {self.boot_id!r}")
        for name, container in self.containers.items():
            if not isinstance(container, ContainerMarker):
                raise MarkerError(f"containers.{name}: must be a ContainerMarker")

    @classmethod
    def build(cls, pod_uid: str, containers: Mapping[str, ContainerMarker], *,
              boot_id: str, clock: Callable[[], float] = time.time) -> Marker:
        return cls(pod_uid=pod_uid, written_at=rfc3339(clock()), containers=containers,
                   boot_id=boot_id)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "version": self.version,
            "pod_uid": self.pod_uid,
            "written_at": self.written_at,
            "containers": {n: c.to_dict() for n, c in sorted(self.containers.items())},
        }
        if self.boot_id:
            out["boot_id"] = self.boot_id
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def rfc3339(epoch_seconds: float) -> str:
    return datetime.fromtimestamp(int(epoch_seconds), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _check_time(value: Any) -> None:
    if not isinstance(value, str) or "T" not in value:
        raise MarkerError(f"written_at: must be an RFC 3339 time, got {value!r}")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise MarkerError(f"written_at: must be an RFC 3339 time, got {value!r}") from None
    if parsed.tzinfo is None:
        raise MarkerError(f"written_at: must carry a time zone (Z), got {value!r}")


def _check_container(where: str, c: ContainerMarker) -> None:
    for name in ("plan_digest", "reason", "message"):
        if not isinstance(getattr(c, name), str):
            raise MarkerError(f"{where}.{name}: must be a string")
    if c.plan_digest and not _DIGEST.fullmatch(c.plan_digest):
        raise MarkerError(f"{where}.plan_digest: must be sha256:<64 hex digits>, "
                          f"got {c.plan_digest!r}")
    if c.reason and not _REASON.fullmatch(c.reason):
        raise MarkerError(f"{where}.reason: must be CamelCase, got {c.reason!r}")
    if c.state is MarkerState.APPLIED and not c.plan_digest:
        raise MarkerError(f"{where}.plan_digest: is required when the state is applied")
    if c.state is MarkerState.REFUSED and not (c.reason and c.message):
        raise MarkerError(f"{where}: a refusal needs a reason and a message")


def parse_marker(text: str | bytes, *, expected_pod_uid: str | None = None) -> Marker:
    """The marker in `text`; raises MarkerError naming the first field that is wrong."""
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise MarkerError(f"not valid JSON: {e}") from None
    except RecursionError:
        raise MarkerError("not a marker: nested too deeply") from None
    if not isinstance(data, dict):
        raise MarkerError("must be a JSON object")
    version = data.get("version")
    if version != MARKER_VERSION:
        raise MarkerError(f"version: must be {MARKER_VERSION}, got {version!r}")
    for name in ("pod_uid", "written_at"):
        if not isinstance(data.get(name), str):
            raise MarkerError(f"{name}: is missing or not a string")
    boot_id = data.get("boot_id", "")
    if not isinstance(boot_id, str):
        raise MarkerError(f"boot_id: must be a string, got {boot_id!r}")
    raw = data.get("containers")
    if not isinstance(raw, dict):
        raise MarkerError("containers: must be an object keyed by container name")
    containers = {}
    for name, item in raw.items():
        where = f"containers.{name}"
        if not isinstance(item, dict):
            raise MarkerError(f"{where}: must be an object")
        try:
            state = MarkerState(item.get("state"))
        except ValueError:
            raise MarkerError(f"{where}.state: must be applied or refused, "
                              f"got {item.get('state')!r}") from None
        fields = {}
        for key in ("plan_digest", "reason", "message"):
            value = item.get(key, "")
            if not isinstance(value, str):
                raise MarkerError(f"{where}.{key}: must be a string, got {value!r}")
            fields[key] = value
        try:
            containers[name] = ContainerMarker(state, **fields)
        except MarkerError as e:
            raise MarkerError(str(e).replace("container", where, 1)) from None
    marker = Marker(pod_uid=data["pod_uid"], written_at=data["written_at"],
                    containers=containers, boot_id=boot_id)
    if expected_pod_uid is not None and marker.pod_uid != expected_pod_uid:
        raise MarkerError(f"pod_uid: is {marker.pod_uid!r}, expected this pod's "
                          f"{expected_pod_uid!r}")
    return marker


def read_boot_id(path: str | os.PathLike[str] = BOOT_ID_PATH) -> str:
    """This boot's ID; raises MarkerError when it cannot be read (then no marker can be told
    from one written before a reboot)."""
    try:
        value = Path(path).read_text().strip()
    except OSError as e:
        raise MarkerError(f"{path}: cannot read the host's boot ID: {e.strerror or e}") from None
    if not _BOOT_ID.fullmatch(value):
        raise MarkerError(f"{path}: not a boot ID: {value[:60]!r}")
    return value


def check_pod_uid(pod_uid: str) -> str:
    """`pod_uid`, or MarkerError when it is not one (it names a directory under the root)."""
    if not isinstance(pod_uid, str) or not _POD_UID.fullmatch(pod_uid):
        raise MarkerError(f"pod_uid: must be a pod UID, got {pod_uid!r}")
    return pod_uid


def pod_marker_dir(root: str | os.PathLike[str], pod_uid: str) -> Path:
    return Path(root) / check_pod_uid(pod_uid)


def read_marker(pod_dir: str | os.PathLike[str], *, expected_pod_uid: str | None = None,
                name: str = MARKER_FILE) -> Marker | None:
    """The marker in a pod's directory (the gate's mount), None while there is none yet;
    raises MarkerError when it is unreadable or malformed. `name`: another file of the same
    format there (SET_ASIDE_FILE)."""
    path = Path(pod_dir) / name
    try:
        data = _read_regular(path)
    except FileNotFoundError:
        return None
    except PermissionError as e:
        try:
            stat = path.stat()  # needs only search permission on the directory
        except OSError:
            # The directory itself is closed to the reader: as the kubelet made it.
            raise MarkerUnreadable(f"{path}: cannot read: {e.strerror or e}") from None
        # Written, but not for this reader (its mode, owner or a security label): not the
        # kubelet's directory, which the agent's first write opens.
        raise MarkerError(f"{path}: written but cannot be read by uid {os.getuid()} "
                          f"(mode {stat.st_mode & 0o777:o}, owner uid {stat.st_uid}; check its "
                          f"mode and security label): {e.strerror or e}") from None
    except OSError as e:
        raise MarkerError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        return parse_marker(data, expected_pod_uid=expected_pod_uid)
    except MarkerError as e:
        raise MarkerError(f"{path}: {e}") from None


def _read_regular(path: Path) -> bytes:
    """The file's bytes, if it is a regular file of at most MAX_MARKER_BYTES: the gate waits
    on the marker with a deadline, and a FIFO would block the read, a huge file its memory."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if st.st_size > MAX_MARKER_BYTES:
            raise OSError(errno.EFBIG, f"larger than {MAX_MARKER_BYTES} bytes")
        return f.read(MAX_MARKER_BYTES + 1)


def _ensure_dir(path: Path, mode: int) -> None:
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=mode)
    # mkdir honours the umask, and the kubelet may create the directory first (subPathExpr,
    # DirectoryOrCreate): set the mode the gate needs explicitly.
    if path.stat().st_mode & 0o7777 != mode:
        os.chmod(path, mode)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(root: str | os.PathLike[str], marker: Marker) -> Path:
    """Atomically (re)write the pod's marker under `root`; returns the file's path."""
    root_path = Path(root)
    root_path.mkdir(mode=ROOT_MODE, parents=True, exist_ok=True)
    _ensure_dir(root_path, ROOT_MODE)
    pod_dir = pod_marker_dir(root_path, marker.pod_uid)
    _ensure_dir(pod_dir, POD_DIR_MODE)
    target = pod_dir / MARKER_FILE
    write_atomically(target, marker.to_json().encode(), FILE_MODE)
    return target


def write_atomically(target: Path, data: bytes, mode: int) -> None:
    """Replace `target` with `data` so that a reader, or the next boot, sees the old file or
    the new one, never part of one: a temp file in the same directory (named for
    `is_temp_file` when the target is a marker), fsync, rename, fsync of the directory."""
    prefix = f".{target.name.lstrip('.')}."  # TEMP_PREFIX for a marker
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=prefix, suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def is_temp_file(name: str) -> bool:
    """A temp file of `write_marker`: one is left when the writer dies before its rename."""
    return name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX)


def remove_marker(root: str | os.PathLike[str], pod_uid: str) -> bool:
    """Remove a gone pod's directory (the marker and any temp file); False when absent.

    It is renamed out of the pod's name before it is emptied: a remover killed half way
    (an agent's SIGKILL, say) must not leave an empty `<uid>` directory, which looks like the
    one the kubelet makes for a new pod and is kept for the agent's grace period. What it
    leaves is a `GONE_PREFIX` entry of a name of its own, which `remove_leftovers` removes."""
    pod_dir = pod_marker_dir(root, pod_uid)
    grave = pod_dir.with_name(f"{GONE_PREFIX}{pod_dir.name}.{os.urandom(4).hex()}")
    try:
        os.rename(pod_dir, grave)
    except FileNotFoundError:
        return False
    _remove(grave)
    return True


def remove_leftovers(root: str | os.PathLike[str]) -> dict[str, OSError | None]:
    """Remove what removals cut short left under `root`: each `GONE_PREFIX` entry's name, and
    None or the error that keeps it (one does not hold up the others)."""
    try:
        names = [e.name for e in os.scandir(root) if e.name.startswith(GONE_PREFIX)]
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out: dict[str, OSError | None] = {}
    for name in names:
        try:
            _remove(Path(root) / name)
            out[name] = None
        except OSError as e:
            out[name] = e
    return out


def _remove(path: Path) -> None:
    """Remove a file, a symlink (never followed: the agent runs as root) or a directory and
    what it holds."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
            return
        with os.scandir(path) as it:
            entries = [Path(e.path) for e in it]
    except FileNotFoundError:
        return
    for entry in entries:
        _remove(entry)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)
