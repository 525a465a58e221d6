"""Kubernetes cgroup (v2) paths of pods and containers, and the cgroup-filesystem seam.

NVML's memory limits take the full sysfs path of a cgroup as their namespace, so these paths are
exactly what the engine passes to NVML. Two kubelet layouts exist:

    systemd:  <root>/kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid_>.slice/<leaf>.scope
    cgroupfs: <root>/kubepods/<qos>/pod<uid>/<leaf>

Guaranteed pods have no QoS level. The leaf is named by the container runtime: containerd
`cri-containerd-<id>.scope`, CRI-O `crio-<id>.scope`, Docker `docker-<id>.scope` under systemd;
`<id>` (CRI-O: `crio-<id>`) under cgroupfs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from typing import Any, Protocol, runtime_checkable

from ..contract import QuantityError, parse_quantity


class CgroupDriver(StrEnum):
    SYSTEMD = "systemd"
    CGROUPFS = "cgroupfs"


class QosClass(StrEnum):
    GUARANTEED = "Guaranteed"
    BURSTABLE = "Burstable"
    BEST_EFFORT = "BestEffort"

    @property
    def level(self) -> str | None:
        """The path component kubelet uses: None for Guaranteed (no level)."""
        return {QosClass.BURSTABLE: "burstable", QosClass.BEST_EFFORT: "besteffort"}.get(self)


class ContainerRuntime(StrEnum):
    CONTAINERD = "containerd"
    CRIO = "cri-o"
    DOCKER = "docker"


@dataclass(frozen=True, slots=True)
class ContainerId:
    runtime: ContainerRuntime
    id: str

    @classmethod
    def parse(cls, value: str) -> ContainerId:
        """`containerd://<id>` (as in a pod's containerStatuses) -> ContainerId."""
        scheme, sep, cid = value.partition("://")
        if not sep or not cid:
            raise ValueError(f"container ID {value!r} is not <runtime>://<id>")
        try:
            runtime = ContainerRuntime(scheme)
        except ValueError:
            raise ValueError(f"container runtime {scheme!r} (in {value!r}) is not supported; "
                             "supported: " + ", ".join(r.value for r in ContainerRuntime)) from None
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", cid) or cid in (".", ".."):
            # `.` and `..` would name the pod's cgroup or its parent, not a container's.
            raise ValueError(f"container ID {value!r} has characters a cgroup name cannot hold")
        return cls(runtime, cid)

    def __str__(self) -> str:
        return f"{self.runtime.value}://{self.id}"


_SYSTEMD_SCOPE_PREFIX = {
    ContainerRuntime.CONTAINERD: "cri-containerd-",
    ContainerRuntime.CRIO: "crio-",
    ContainerRuntime.DOCKER: "docker-",
}
_CGROUPFS_PREFIX = {
    ContainerRuntime.CONTAINERD: "",
    ContainerRuntime.CRIO: "crio-",
    ContainerRuntime.DOCKER: "",
}
_UID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def is_pod_uid(uid: str) -> bool:
    """`uid` can name a pod's cgroup: a UUID, in either case (what the kubelet wrote)."""
    return _UID.fullmatch(uid) is not None


_SYSTEMD_POD = re.compile(r"kubepods(?:-(burstable|besteffort))?-pod([0-9a-fA-F_]+)\.slice")
_CGROUPFS_POD = re.compile(r"pod([0-9a-fA-F-]+)")
_LEVEL_QOS = {None: QosClass.GUARANTEED, "burstable": QosClass.BURSTABLE,
              "besteffort": QosClass.BEST_EFFORT}


@dataclass(frozen=True, slots=True)
class PodCgroup:
    """A pod's cgroup found on disk, with the cgroups directly below it (its containers')."""

    uid: str
    qos: QosClass
    path: str
    children: tuple[str, ...] = ()


@runtime_checkable
class CgroupFs(Protocol):
    """The little of the cgroup filesystem the engine reads; paths are absolute."""

    def exists(self, path: str) -> bool: ...
    def list_dirs(self, path: str) -> tuple[str, ...]:
        """Names of the directories directly under `path`; () when it does not exist."""
        ...


class HostCgroupFs:
    """The real filesystem (a temp directory with the same tree in tests)."""

    def exists(self, path: str) -> bool:
        return os.path.isdir(path)

    def list_dirs(self, path: str) -> tuple[str, ...]:
        try:
            with os.scandir(path) as it:
                return tuple(sorted(e.name for e in it if e.is_dir(follow_symlinks=False)))
        except (FileNotFoundError, NotADirectoryError):
            return ()


@dataclass(frozen=True, slots=True)
class CgroupLayout:
    """Where kubelet puts pods under `root` (usually /sys/fs/cgroup) with a given driver."""

    root: str = "/sys/fs/cgroup"
    driver: CgroupDriver = CgroupDriver.SYSTEMD

    def __post_init__(self) -> None:
        if not self.root.startswith("/"):
            raise ValueError(f"the cgroup root must be an absolute path, got {self.root!r}")
        object.__setattr__(self, "root", self.root.rstrip("/") or "/")
        object.__setattr__(self, "driver", CgroupDriver(self.driver))

    def _join(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def pod_path(self, uid: str, qos: QosClass) -> str:
        if not is_pod_uid(uid):
            raise ValueError(f"pod UID {uid!r} is not a UUID")
        level = QosClass(qos).level
        if self.driver is CgroupDriver.SYSTEMD:
            slice_uid = uid.replace("-", "_")
            if level is None:
                return self._join("kubepods.slice", f"kubepods-pod{slice_uid}.slice")
            return self._join("kubepods.slice", f"kubepods-{level}.slice",
                              f"kubepods-{level}-pod{slice_uid}.slice")
        if level is None:
            return self._join("kubepods", f"pod{uid}")
        return self._join("kubepods", level, f"pod{uid}")

    def leaf_name(self, container: ContainerId) -> str:
        if self.driver is CgroupDriver.SYSTEMD:
            return f"{_SYSTEMD_SCOPE_PREFIX[container.runtime]}{container.id}.scope"
        return f"{_CGROUPFS_PREFIX[container.runtime]}{container.id}"

    def container_path(self, uid: str, qos: QosClass, container: ContainerId | str) -> str:
        if isinstance(container, str):
            container = ContainerId.parse(container)
        return f"{self.pod_path(uid, qos)}/{self.leaf_name(container)}"

    def _qos_parents(self) -> list[tuple[QosClass | None, str]]:
        """(qos, directory) pairs where pod cgroups live; qos None: mixed (guaranteed + levels)."""
        if self.driver is CgroupDriver.SYSTEMD:
            top = self._join("kubepods.slice")
            return [(None, top),
                    (QosClass.BURSTABLE, f"{top}/kubepods-burstable.slice"),
                    (QosClass.BEST_EFFORT, f"{top}/kubepods-besteffort.slice")]
        top = self._join("kubepods")
        return [(None, top), (QosClass.BURSTABLE, f"{top}/burstable"),
                (QosClass.BEST_EFFORT, f"{top}/besteffort")]

    def parse_pod_dir(self, name: str) -> tuple[str, QosClass] | None:
        """A pod cgroup's directory name -> (pod uid, qos); None for anything else."""
        if self.driver is CgroupDriver.SYSTEMD:
            m = _SYSTEMD_POD.fullmatch(name)
            if not m:
                return None
            uid = m.group(2).replace("_", "-")
            qos = _LEVEL_QOS[m.group(1)]
        else:
            m = _CGROUPFS_POD.fullmatch(name)
            if not m:
                return None
            uid, qos = m.group(1), QosClass.GUARANTEED  # the caller knows the level
        return (uid, qos) if is_pod_uid(uid) else None

    def scan(self, fs: CgroupFs) -> tuple[PodCgroup, ...]:
        """Every pod cgroup on the node, with its children, sorted by path."""
        found: list[PodCgroup] = []
        for level_qos, parent in self._qos_parents():
            for name in fs.list_dirs(parent):
                parsed = self.parse_pod_dir(name)
                if parsed is None:
                    continue
                uid, qos = parsed
                if self.driver is CgroupDriver.CGROUPFS:
                    qos = level_qos or QosClass.GUARANTEED
                elif level_qos is not None and qos is not level_qos:
                    continue  # a name that does not belong at this level
                elif level_qos is None and qos is not QosClass.GUARANTEED:
                    continue
                path = f"{parent}/{name}"
                found.append(PodCgroup(uid=uid, qos=qos, path=path,
                                       children=tuple(f"{path}/{c}" for c in fs.list_dirs(path))))
        return tuple(sorted(found, key=lambda p: p.path))


# -- QoS class --------------------------------------------------------------------------------

_QOS_RESOURCES = ("cpu", "memory")


def _quantity(value: Any) -> Fraction | None:
    try:
        return parse_quantity(str(value))
    except QuantityError:
        return None  # the API server would have refused it; it proves nothing


def compute_qos_class(spec: Mapping[str, Any]) -> QosClass:
    """Kubernetes' QoS rules (GetPodQOS) over a pod spec's containers and init containers.

    Guaranteed: every container has cpu and memory limits and requests equal to them (a missing
    request defaults to the limit, as the API server does). BestEffort: no cpu or memory
    request or limit anywhere. Otherwise Burstable.
    """
    any_set = False
    guaranteed = True
    containers = list(spec.get("containers") or []) + list(spec.get("initContainers") or [])
    for c in containers:
        if not isinstance(c, Mapping):
            continue
        res = c.get("resources") or {}
        limits = {r: _quantity(v) for r, v in (res.get("limits") or {}).items()
                  if r in _QOS_RESOURCES}
        requests = {**limits, **{r: _quantity(v) for r, v in (res.get("requests") or {}).items()
                                 if r in _QOS_RESOURCES}}
        if any(v != 0 for v in (*limits.values(), *requests.values())):
            any_set = True
        if any(limits.get(r) in (None, 0) or requests.get(r) != limits.get(r)
               for r in _QOS_RESOURCES):
            guaranteed = False
    if not any_set:
        return QosClass.BEST_EFFORT
    return QosClass.GUARANTEED if guaranteed else QosClass.BURSTABLE


def qos_class_of(pod: Mapping[str, Any]) -> QosClass:
    """The pod's QoS class: `status.qosClass` when the API server has set it, else computed."""
    status = pod.get("status") or {}
    value = status.get("qosClass")
    if value in {q.value for q in QosClass}:
        return QosClass(value)
    return compute_qos_class(pod.get("spec") or {})
