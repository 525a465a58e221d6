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
- `procMount: Unmasked`: /proc without the runtime's masks (the host's kernel interfaces).
- capabilities that reach past the container, or set the node's clock (`REACHING`).
- a mount whose path starts with `/var/run/nvidia-container-devices` (or `/run/...`), as a
  string, as the toolkit compares it: with the toolkit's
  `accept-nvidia-visible-devices-as-volume-mounts` (the GPU Operator's volume-mounts device
  list strategy), a `/dev/null` mounted there names the container's GPUs, read BEFORE
  NVIDIA_VISIBLE_DEVICES: any GPU of the node, or `all`, whatever the binder chose.

What real GPU pods carry stays allowed: `hostIPC` (MPS clients may share memory with their
server), `hostNetwork`, and every other capability (IPC_LOCK pins memory for RDMA, NET_ADMIN and
NET_RAW act on the pod's or the node's network). Allowed is not harmless: `hostIPC` joins the
node's IPC namespace (the System V IPC objects of host processes and of other `hostIPC` pods,
the node's /dev/shm), `hostNetwork` its network (with NET_ADMIN its interfaces and firewall),
and some capabilities act on the whole node (SYSLOG). None of them reaches the gate or a GPU;
keeping them from tenants is a policy engine's (docs/admission.md).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator, Mapping
from typing import Any

from ..contract.errors import shown
from .config import GATE_CONTAINER
from .errors import Problem

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
    "SYS_TIME": "it sets the node's clock, which no namespace confines: every certificate "
                "check and Lease on the node goes wrong",
}
"""Capabilities refused in `capabilities.add`, with why."""

_RULE = "in a pod with a GPU fraction"
DEVICE_LIST_MOUNTS = ("/var/run/nvidia-container-devices", "/run/nvidia-container-devices")
"""Where the NVIDIA container toolkit reads a device list from mounts (its
DeviceListAsVolumeMountsRoot), in both spellings of /var/run."""


def _names_devices(mount_path: str) -> bool:
    """The mount's path, cleaned, starts with the toolkit's device-list root: as a plain string,
    as the toolkit compares it (`/var/run/nvidia-container-devicesall` names device `all`)."""
    path = posixpath.normpath("/" + mount_path.lstrip("/"))
    return path.startswith(DEVICE_LIST_MOUNTS)
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


def isolation_problems(spec: Mapping[str, Any]) -> list[Problem]:
    """Every way the pod's spec asks to reach past its containers (empty: none)."""
    out = []
    if spec.get("hostPID") is True:
        out.append(Problem(f"spec.hostPID: must not be true {_RULE}: its processes would see "
                           "the host's, the gate of every pod on the node included"))
    if spec.get("shareProcessNamespace") is True:
        out.append(Problem(f"spec.shareProcessNamespace: must not be true {_RULE}: its "
                           f"containers would see the {GATE_CONTAINER} process and could make "
                           "it exit before the node agent applied the pod's limits"))
    for where, c in _containers(spec):
        if where.startswith("spec.ephemeralContainers") and \
                c.get("targetContainerName") == GATE_CONTAINER:
            out.append(Problem(f"{where}.targetContainerName: must not be {GATE_CONTAINER}: a "
                               "container in the gate's process namespace could make it exit "
                               "before the node agent applied the pod's limits"))
        for j, mount in enumerate(c.get("volumeMounts") or []):
            path = mount.get("mountPath") if isinstance(mount, Mapping) else None
            if isinstance(path, str) and _names_devices(path):
                out.append(Problem(
                    f"{where}.volumeMounts[{j}].mountPath: {shown(path)} may not be mounted "
                    f"{_RULE}: the NVIDIA container toolkit can read mounts whose path starts "
                    "with /var/run/nvidia-container-devices as the "
                    "container's GPUs (accept-nvidia-visible-devices-as-volume-mounts), any GPU "
                    "of the node whatever the binder chose", value=path))
        context = c.get("securityContext")
        if not isinstance(context, Mapping):
            continue
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
