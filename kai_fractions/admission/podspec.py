"""The pieces the mutating webhook puts into a fractional pod, as Kubernetes JSON.

Every field the API server would default is spelled out (`apiVersion: v1` in fieldRefs,
`defaultMode`, `imagePullPolicy`, `terminationMessagePath`), so the object the API server
stores equals what we emitted, and a reinvocation finds nothing to change.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from typing import Any

from ..contract import ComputeMode, Keys, env_sources
from ..contract.keys import MPS_NAMESPACE_PREFIX, NODE_CONDITION
from ..contract.plan import mps_pipe_directory
from ..gate import paths
from .config import (
    GATE_CONTAINER,
    GATE_USER,
    MARKER_VOLUME,
    MPS_VOLUME,
    PODINFO_VOLUME,
    AdmissionConfig,
)

# Requests equal limits: a Guaranteed pod stays Guaranteed (QoS counts init containers too),
# and the gate cannot use more than a sliver of the node. 100m keeps Python's start quick.
GATE_RESOURCES = {"cpu": "100m", "memory": "64Mi"}


def annotation_ref(key: str) -> dict[str, Any]:
    return {"fieldRef": {"apiVersion": "v1", "fieldPath": f"metadata.annotations['{key}']"}}


def enforced_env(container: str, mode: ComputeMode, keys: Keys) -> list[dict[str, Any]]:
    """The fractional container's enforced env: each variable reads the annotation the
    contract names for it, resolved by the kubelet when the container starts (after the gate)."""
    return [{"name": name, "valueFrom": annotation_ref(key)}
            for name, key in env_sources(container, mode, keys).items()]


def gate_command(config: AdmissionConfig, containers: Sequence[str],
                 init_containers: Sequence[str]) -> list[str]:
    """The gate's command. `--condition-name` only for a condition other than the default: a
    default install's gates stay as earlier webhooks wired them (`wiring` holds them exact)."""
    command = [
        "kai-fractions", "gate",
        "--marker-dir", paths.MARKER_DIR,
        "--annotations-file", paths.ANNOTATIONS_FILE,
        "--termination-log", paths.TERMINATION_LOG,
        "--annotation-prefix", config.keys.prefix,
        "--containers", ",".join(containers),
    ]
    if init_containers:
        command += ["--init-containers", ",".join(init_containers)]
    if config.condition_name != NODE_CONDITION:
        command += ["--condition-name", config.condition_name]
    return command


def gate_container(config: AdmissionConfig, containers: Sequence[str],
                   init_containers: Sequence[str]) -> dict[str, Any]:
    return {
        "name": GATE_CONTAINER,
        "image": config.gate_image,
        "imagePullPolicy": "IfNotPresent",
        "command": gate_command(config, containers, init_containers),
        "env": [
            {"name": paths.POD_UID_ENV,
             "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}},
            # The gate needs no GPU; `void` keeps the NVIDIA runtime from injecting one even
            # if the image's own env asks for all of them.
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
        ],
        "resources": {"requests": dict(GATE_RESOURCES), "limits": dict(GATE_RESOURCES)},
        "volumeMounts": [
            # Only this pod's own directory (subPathExpr), read-only: the gate can neither
            # see other pods' markers nor write its own.
            {"name": MARKER_VOLUME, "mountPath": paths.MARKER_DIR, "readOnly": True,
             "subPathExpr": f"$({paths.POD_UID_ENV})"},
            {"name": PODINFO_VOLUME, "mountPath": paths.PODINFO_DIR, "readOnly": True},
        ],
        "terminationMessagePath": paths.TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "runAsUser": GATE_USER,
            "runAsGroup": GATE_USER,
            "runAsNonRoot": True,
            "privileged": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def marker_volume(config: AdmissionConfig) -> dict[str, Any]:
    # DirectoryOrCreate: a pod landing before the node agent waits in its gate (and says so at
    # the timeout) instead of failing to mount.
    return {"name": MARKER_VOLUME,
            "hostPath": {"path": config.marker_host_dir, "type": "DirectoryOrCreate"}}


def podinfo_volume() -> dict[str, Any]:
    return {"name": PODINFO_VOLUME, "downwardAPI": {
        "defaultMode": 0o644,
        "items": [{"path": paths.ANNOTATIONS_FILE_NAME,
                   "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.annotations"}}],
    }}


def mps_volume(config: AdmissionConfig) -> dict[str, Any]:
    return {"name": MPS_VOLUME,
            "hostPath": {"path": config.mps_server_host_dir, "type": "DirectoryOrCreate"}}


MPS_NAMESPACE_RANDOM_HEX = 12
"""The random hex digits that end an MPS namespace name, after the 8 of its tag (`kf_` and 20
hex digits in all: the node agent checks that format, and the pipe directory's length budget
counts on it)."""


def namespace_tag(namespace: str) -> str:
    """The 8 hex digits an MPS namespace name of a pod in Kubernetes namespace `namespace`
    starts with (after `kf_`): the first of sha256 of the namespace's name. A name copied from
    a pod of another namespace lacks it, so no tenant can take another namespace's name."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:8]


def is_named_for(name: str, namespace: str) -> bool:
    """Whether MPS namespace name `name` carries the tag of Kubernetes namespace `namespace`."""
    return name.startswith(MPS_NAMESPACE_PREFIX + namespace_tag(namespace))


def new_mps_namespace() -> str:
    """The random part of a fresh MPS namespace name: random, because nothing else about the
    pod is known yet (no UID, often no name), and unguessable, so no one can aim at it."""
    return secrets.token_hex(MPS_NAMESPACE_RANDOM_HEX // 2)


def mps_namespace_for(namespace: str, fresh: str) -> str:
    """The MPS namespace name of a new pod in Kubernetes namespace `namespace`: `kf_`, the
    namespace's tag, then `fresh`, 12 random hex digits (`new_mps_namespace`)."""
    return f"{MPS_NAMESPACE_PREFIX}{namespace_tag(namespace)}{fresh}"


def mps_mount(namespace: str) -> dict[str, Any]:
    # Read-write: an MPS client connects to (writes into) the sockets in its pipe directory.
    # Only the container's own namespace (subPath): not the server directory, where a process
    # could join another container's namespace and take its compute cap, nor the root, a v3
    # daemon's own pipe directory with its control socket. docs/admission.md.
    return {"name": MPS_VOLUME, "mountPath": mps_pipe_directory(namespace), "subPath": namespace}
