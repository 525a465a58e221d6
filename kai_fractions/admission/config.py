"""What the webhooks are configured with, and the names they reserve in a pod."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..contract import DEFAULT_KEYS, Keys
from ..contract import keys as k
from ..contract.names import is_dns_subdomain
from ..contract.plan import MPS_SERVER
from ..contract.scheduler import DEFAULT_SCHEDULER_NAME

MIRROR_IDENTITY = "system:serviceaccount:kai-fractions:kai-fractions-mirror"
DEFAULT_ALLOWED_IDENTITIES = (k.KAI_BINDER_IDENTITY, MIRROR_IDENTITY)
DEFAULT_MARKER_HOST_DIR = "/var/lib/kai-fractions/markers"
DEFAULT_MPS_PIPE_HOST_DIR = "/run/kai-fractions/mps"
DEFAULT_AGENT_SOCKET_HOST_DIR = "/run/kai-fractions"
"""Where the node agent's NodeEnforcer socket lives (the chart's `hostPaths.socketDir`)."""
DEFAULT_KUBELET_ROOT_DIR = "/var/lib/kubelet"
"""The kubelet's `--root-dir`: it bind-mounts every pod's subPath volumes read-write under
`pods/<uid>/volume-subpaths/` there, the gate's marker directory and the MPS namespaces
included, so no hostPath may reach its `pods` directory (the chart's `webhook.kubeletRootDir`).
Its siblings (`device-plugins`, `plugins_registry`) stay open to the device plugins that mount
them."""

CONDITION_NAME = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+"
    r"/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
"""A node condition type the node agents may publish: the chart's schema rule for
`nodeCondition.name`, exactly (a domain prefix, so never one of the kubelet's own types)."""

# Names the mutating webhook puts into a pod. They are reserved: a pod's own definition under
# one of these names is replaced, and the validating webhook refuses other containers that
# mount them (a workload that could write the marker root could release any pod on the node).
GATE_CONTAINER = "kai-fractions-gate"
MARKER_VOLUME = "kai-fractions-marker"
PODINFO_VOLUME = "kai-fractions-podinfo"
MPS_VOLUME = "kai-fractions-mps"
GATE_USER = 65534
"""`nobody`: the marker is 0644 in a 0755 directory, so the gate needs no root."""


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    gate_image: str
    keys: Keys = DEFAULT_KEYS
    allowed_identities: tuple[str, ...] = DEFAULT_ALLOWED_IDENTITIES
    """Who may create, change or remove protected keys (binder-owned and derived)."""
    marker_host_dir: str = DEFAULT_MARKER_HOST_DIR
    mps_pipe_host_dir: str = DEFAULT_MPS_PIPE_HOST_DIR
    agent_socket_host_dir: str = DEFAULT_AGENT_SOCKET_HOST_DIR
    kubelet_root_dir: str = DEFAULT_KUBELET_ROOT_DIR
    runtime_class: str = ""
    """Given to fractional pods that name no RuntimeClass: their container reaches its GPU
    through the NVIDIA runtime, which a node may offer only as a RuntimeClass. "" leaves the
    pod to the node's default runtime."""
    scheduler_name: str = DEFAULT_SCHEDULER_NAME
    """KAI's scheduler: a fractional pod of another is admitted with a warning (it would wait in
    its gate for ever, `contract.scheduler`); "" warns of none."""
    condition_name: str = k.NODE_CONDITION
    """The node condition the node agents publish (the chart's `nodeCondition.name`): the gate
    names it where it says the agent's reason is. Passed to the gate only when it is not the
    default, so a default install wires the gate as it always did."""

    @property
    def kubelet_pods_dir(self) -> str:
        """Where the kubelet bind-mounts pods' subPath volumes (`<root>/pods/<uid>/...`)."""
        return f"{self.kubelet_root_dir.rstrip('/')}/pods"

    @property
    def mps_server_host_dir(self) -> str:
        """The MPS server directory under the pipe root: the volume an sm-sharing container
        mounts its own namespace's directory of (a subPath), never the root itself (a v3
        daemon's control socket is there)."""
        return f"{self.mps_pipe_host_dir.rstrip('/')}/{MPS_SERVER}"

    def __post_init__(self) -> None:
        if not self.gate_image.strip():
            raise ValueError("gate_image: must name the image of the gate init container")
        if not self.allowed_identities:
            raise ValueError("allowed_identities: at least one identity must be allowed to "
                             "write protected keys (the binder's)")
        for identity in self.allowed_identities:
            # A review without userInfo has the user "": a blank identity would let it write
            # protected keys, and one with spaces around it matches no username.
            if not identity.strip() or identity != identity.strip():
                raise ValueError(f"allowed_identities: must be a username, got {identity!r}")
        if self.runtime_class and not is_dns_subdomain(self.runtime_class):
            raise ValueError(f"runtime_class: {self.runtime_class!r} is not a RuntimeClass name "
                             "(lower-case letters, digits, '-' and '.')")
        if not CONDITION_NAME.fullmatch(self.condition_name):
            raise ValueError(f"condition_name: {self.condition_name!r} is not a node condition "
                             "type with a domain prefix (such as example.com/Ready: a DNS "
                             "subdomain with a dot, a slash, then letters, digits, '-', '_' and "
                             "'.', starting and ending with a letter or digit)")
        for name in ("marker_host_dir", "mps_pipe_host_dir", "agent_socket_host_dir",
                     "kubelet_root_dir"):
            value = getattr(self, name)
            if not value.startswith("/") or value.rstrip("/") == "":
                raise ValueError(f"{name}: must be an absolute host directory other than /, "
                                 f"got {value!r}")
