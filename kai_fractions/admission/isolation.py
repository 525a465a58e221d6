"""What a pod with a GPU fraction may not ask for: a way past its own containers.

The gate and the MPS pipes are hostPath volumes, so the namespaces that run fractions need the
Pod Security level `privileged`, and Pod Security refuses nothing else there. The webhook does
it itself, in every pod with a GPU fraction (or with the gate or a volume the webhook reserves),
for every container (init and ephemeral ones included):

- `privileged: true`: the container gets every device of the node, every GPU included,
  whatever NVIDIA_VISIBLE_DEVICES says.
- `hostPID`, `shareProcessNamespace`, an ephemeral container whose `targetContainerName` is
  the gate: its processes see the gate (this pod's, or with `hostPID` every pod's on the node).
  The gate runs as `nobody`; a process of that user, or one with SYS_PTRACE, can make it exit 0
  before the node agent applied the limits.
- `hostIPC`: the host's IPC namespace, where the node agent (hostIPC) runs the MPS servers,
  whose shared memory is in the host's /dev/shm.
- `hostNetwork`: the node's network namespace, every service on its loopback included, where
  no NetworkPolicy applies.
- `procMount: Unmasked`: /proc without the runtime's masks (the host's kernel interfaces).
- capabilities that reach past the container (`REACHING`).
- a `hostPath` volume other than the webhook's own (`host_path_problem`): the runtime's socket
  is node root, /sys/fs/cgroup holds every pod's limits, /etc and /dev are the node's. Only
  the host paths the administrator trusts (`AdmissionConfig.trusted_host_paths`) may be.
- a `mountPropagation` other than None: mounts made on the host later (other pods' volumes)
  would appear in the container, and with Bidirectional its own would reach the host.

What real GPU pods carry stays allowed: every other capability (IPC_LOCK pins memory for RDMA,
NET_ADMIN and NET_RAW act on the pod's network, none of them on other processes, devices or
files), and every volume that is not a host path.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ..contract.errors import shown
from . import hostpaths
from .config import GATE_CONTAINER, AdmissionConfig
from .errors import Problem, exact

REACHING = {
    "ALL": "every capability, these included",
    "SYS_ADMIN": "it mounts file systems and devices, and much else that reaches the host",
    "SYS_PTRACE": "it traces and changes any process it sees, the gate included",
    "SYS_MODULE": "it loads kernel modules",
    "SYS_RAWIO": "it reaches devices and memory directly",
    "BPF": "it loads programs into the kernel",
    "PERFMON": "it traces the kernel and other processes",
    "DAC_READ_SEARCH": "it opens any file of the host's file systems by handle "
                       "(open_by_handle_at)",
}
"""Capabilities refused in `capabilities.add`, with why."""

_RULE = "in a pod with a GPU fraction"
_LISTS = ("initContainers", "containers", "ephemeralContainers")


def _capability(value: Any) -> str:
    """The capability's name as the runtimes read it: any case, `CAP_` or not."""
    name = str(value).upper()
    return name[len("CAP_"):] if name.startswith("CAP_") else name


def _containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for field in _LISTS:
        for i, c in enumerate(spec.get(field) or []):
            if isinstance(c, Mapping):
                yield f"spec.{field}[{i}]", c


_HOST_NAMESPACES = {
    "hostPID": "its processes would see the host's, the gate of every pod on the node included",
    "hostIPC": "its processes would share the host's IPC namespace, with the shared memory of "
               "the MPS servers (the host's /dev/shm) and of every other process there",
    "hostNetwork": "its processes would share the node's network namespace, every service "
                   "listening on the node's loopback included, where no NetworkPolicy applies",
}
"""Pod fields that put every container in one of the host's namespaces, with why."""


def _pod_problems(spec: Mapping[str, Any]) -> list[Problem]:
    """The host's namespaces and a shared process namespace, set for the whole pod."""
    out = [Problem(f"spec.{field}: must not be true {_RULE}: {why}")
           for field, why in _HOST_NAMESPACES.items() if spec.get(field) is True]
    if spec.get("shareProcessNamespace") is True:
        out.append(Problem(f"spec.shareProcessNamespace: must not be true {_RULE}: its "
                           f"containers would see the {GATE_CONTAINER} process and could make "
                           "it exit before the node agent applied the pod's limits"))
    return out


def _context_problems(where: str, context: Mapping[str, Any]) -> list[Problem]:
    """A container's securityContext: privileged, an unmasked /proc, reaching capabilities."""
    out = []
    if context.get("privileged") is True:
        out.append(Problem(f"{where}.securityContext.privileged: must not be true {_RULE}: "
                           "a privileged container gets every GPU of the node, whatever "
                           "NVIDIA_VISIBLE_DEVICES says"))
    if context.get("procMount") == "Unmasked":
        out.append(Problem(f"{where}.securityContext.procMount: must not be Unmasked "
                           f"{_RULE}: an unmasked /proc exposes the host's kernel "
                           "interfaces"))
    capabilities = context.get("capabilities")
    added = capabilities.get("add") if isinstance(capabilities, Mapping) else None
    for j, value in enumerate(added if isinstance(added, list) else []):
        why = REACHING.get(_capability(value))
        if why is not None:
            out.append(Problem(
                f"{where}.securityContext.capabilities.add[{j}]: {shown(str(value))} may "
                f"not be added {_RULE}: {why}", value=str(value)))
    return out


def _propagation_problems(where: str, c: Mapping[str, Any]) -> list[Problem]:
    """Mounts shared with the host's mount namespace, either way (None or unset only)."""
    out = []
    for j, mount in enumerate(c.get("volumeMounts") or []):
        value = mount.get("mountPropagation") if isinstance(mount, Mapping) else None
        if value in (None, "None"):
            continue
        out.append(Problem(
            f"{where}.volumeMounts[{j}].mountPropagation: must be None or unset {_RULE} (got "
            f"{shown(str(value))}): mounts made on the host later, other pods' volumes among "
            "them, would appear in the container, and with Bidirectional its own would reach "
            "the host", value=str(value)))
    return out


def isolation_problems(spec: Mapping[str, Any]) -> list[Problem]:
    """Every way the pod's spec asks to reach past its containers (empty: none); its
    hostPath volumes are `host_path_problem`'s, each resolved once by the caller."""
    out = _pod_problems(spec)
    for where, c in _containers(spec):
        if where.startswith("spec.ephemeralContainers") and \
                c.get("targetContainerName") == GATE_CONTAINER:
            out.append(Problem(f"{where}.targetContainerName: must not be {GATE_CONTAINER}: a "
                               "container in the gate's process namespace could make it exit "
                               "before the node agent applied the pod's limits"))
        context = c.get("securityContext")
        if isinstance(context, Mapping):
            out += _context_problems(where, context)
        out += _propagation_problems(where, c)
    return out


def host_path_problem(where: str, path: str, resolved: str,
                      config: AdmissionConfig) -> Problem | None:
    """A hostPath volume (not one of the webhook's own) of a pod with a GPU fraction: refused
    unless `resolved` (its canonical path) is a trusted host path or inside one."""
    if any(hostpaths.within(resolved, trusted) for trusted in config.trusted_canonical):
        return None
    return Problem(f"{where}: {shown(path)} may not be mounted {_RULE}: a host path reaches "
                   "past the container (the runtime's socket is node root, /sys/fs/cgroup "
                   "holds other pods' limits); only the webhook's own volumes and the host "
                   "paths the administrator trusts (--trusted-host-path, the chart's "
                   "webhook.trustedHostPaths) may be", exact(path))
