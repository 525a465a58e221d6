"""The node-side plan for one container: what the GPU must enforce and what env it must see.

Pure function of the pod's annotations (through `parse_pod`) and a little node configuration.
Memory is planned in whole MiB rounded up (the contract's conversion), so the cgroup limits,
the env values and the pinned MPS limit all say the same number.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from fractions import Fraction

from . import keys as k
from .errors import ContractError, ContractViolation
from .keys import MPS_NAMESPACE_PREFIX
from .quantity import MIB, mib_ceil
from .request import ComputeMode, ContainerShare, PodRequest

DEFAULT_MPS_PIPE_ROOT = "/run/kai-fractions/mps"
"""Where the MPS pipe directories appear inside containers (the chart mounts it there)."""
MPS_SERVER = "shared"
"""The one MPS v3 server every sm-sharing namespace on a GPU node belongs to."""
MAX_PIPE_DIRECTORY = 83
"""A unix socket path is at most 107 bytes; MPS appends its own names to the directory."""


NO_COMPUTE_CAP = 100
"""The active-thread percentage of an sm-sharing container whose binder wrote no portion."""


def mps_pipe_directory(namespace: str, mps_pipe_root: str = DEFAULT_MPS_PIPE_ROOT) -> str:
    """A namespace's pipe directory, `<root>/<server>/<namespace>`: where the client finds it
    (its CUDA_MPS_PIPE_DIRECTORY) and where the admission webhook mounts it."""
    return f"{mps_pipe_root.rstrip('/')}/{MPS_SERVER}/{namespace}"


def mps_namespace_name(pod_identity: str, container: str) -> str:
    """A v3 namespace name (`[a-z0-9_]+`), stable for one container of one pod: for pods the
    admission webhook did not name one for (`keys.ADMITTED_MPS_NAMESPACE`).

    A hash keeps it short (the pipe directory must fit a unix socket path) whatever the pod UID
    and container name; the node agent reports the mapping back to users.
    """
    digest = hashlib.sha256(f"{pod_identity}/{container}".encode()).hexdigest()
    return f"{MPS_NAMESPACE_PREFIX}{digest[:20]}"


def active_thread_percentage(portion: Fraction) -> int:
    """round(portion * 100), half up, clamped to 1..100 (0 would mean unlimited to MPS).
    floor(n/d * 100 + 1/2) in integers: exact, and far cheaper than Fraction arithmetic or
    hashing a Fraction for a cache (a negative portion clamps to 1 either way)."""
    n, d = portion.numerator, portion.denominator
    return min(100, max(1, (200 * n + d) // (2 * d)))


@dataclass(frozen=True, slots=True)
class ContainerPlan:
    pod_identity: str
    """The pod UID (or `namespace/name` for manifests that have none yet)."""
    container: str
    devices_value: str
    """The `.gpus.devices` annotation verbatim: NVIDIA_VISIBLE_DEVICES is exactly this."""
    device_uuids: tuple[str, ...]
    compute_mode: ComputeMode
    request_mib: int
    limit_mib: int
    active_thread_percentage: int | None
    mps_namespace: str | None
    mps_pipe_directory: str | None

    @property
    def request_bytes(self) -> int:
        return self.request_mib * MIB

    @property
    def limit_bytes(self) -> int:
        return self.limit_mib * MIB

    @property
    def pinned_mem_limit(self) -> str:
        """`0=<L>M,1=<L>M,...`: one entry per visible device, by ordinal inside the container.

        Every entry carries the same cap, so the ordinal order cannot attach a cap to the wrong
        device, and no entry names a GPU the process cannot see (CUDA would drop them all).
        """
        return ",".join([f"{i}={self.limit_mib}M" for i in range(len(self.device_uuids))])

    @property
    def env(self) -> dict[str, str]:
        env = {
            k.ENV_VISIBLE_DEVICES: self.devices_value,
            k.ENV_MEMORY_REQUEST: str(self.request_mib),
            k.ENV_MEMORY_LIMIT: str(self.limit_mib),
            k.ENV_PINNED_MEM_LIMIT: self.pinned_mem_limit,
        }
        if self.compute_mode is ComputeMode.SM_SHARING:
            assert self.active_thread_percentage is not None and self.mps_pipe_directory
            env[k.ENV_ACTIVE_THREAD_PERCENTAGE] = str(self.active_thread_percentage)
            env[k.ENV_PIPE_DIRECTORY] = self.mps_pipe_directory
        return env

    def to_dict(self) -> dict:
        return {
            "env": self.env,
            "memory": {"request_bytes": self.request_bytes, "limit_bytes": self.limit_bytes},
            "compute": {
                "mode": self.compute_mode.value,
                "active_thread_percentage": self.active_thread_percentage,
            },
            "devices": list(self.device_uuids),
        }

    @property
    def digest(self) -> str:
        """Identifies what is enforced; the gate compares it with what the agent applied.

        Every field the env and the limits derive from (the env is a function of these), one
        per line: none of them can contain a newline (UIDs, DNS labels, validated UUIDs,
        numbers, derived paths), so the encoding is unambiguous, cheap and the same wherever
        it is computed.
        """
        canonical = "\n".join((
            "v1", self.pod_identity, self.container, self.devices_value,
            ",".join(self.device_uuids), self.compute_mode.value, str(self.request_mib),
            str(self.limit_mib), str(self.active_thread_percentage), str(self.mps_namespace),
            str(self.mps_pipe_directory),
        ))
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def plan_container(
    share: ContainerShare,
    pod_identity: str,
    *,
    keys: k.Keys = k.DEFAULT_KEYS,
    mps_pipe_root: str = DEFAULT_MPS_PIPE_ROOT,
) -> ContainerPlan:
    """The plan for a bound container; raises ContractViolation naming what is missing."""
    name = share.container
    errors = []
    if not share.devices:
        errors.append(ContractError(keys.container(name, k.DEVICES), "is missing: the binder "
                                    "has not assigned a GPU yet", container=name))
    request, limit = share.node_request_bytes, share.node_limit_bytes
    if request is None or limit is None:
        errors.append(ContractError(keys.container(name, k.MEMORY_REQUEST), "is missing: the "
                                    "binder writes it when the user gives none", container=name))
    atp = namespace = pipe = None
    if share.compute_mode is ComputeMode.SM_SHARING:
        # Upstream KAI main writes no compute portion: the container then shares the SMs
        # without a cap (100%), as on upstream's own node side; its memory is still capped.
        atp = (NO_COMPUTE_CAP if share.compute_portion is None
               else active_thread_percentage(share.compute_portion))
        namespace = share.mps_namespace or mps_namespace_name(pod_identity, name)
        pipe = mps_pipe_directory(namespace, mps_pipe_root)
        if len(pipe.encode()) > MAX_PIPE_DIRECTORY:
            errors.append(ContractError("mps_pipe_root", f"makes the MPS pipe directory {pipe!r} "
                                        f"longer than {MAX_PIPE_DIRECTORY} bytes", mps_pipe_root,
                                        container=name))
    if errors:
        raise ContractViolation(errors)
    assert request is not None and limit is not None
    return ContainerPlan(
        pod_identity=pod_identity,
        container=name,
        devices_value=share.devices_value or ",".join(share.devices),
        device_uuids=share.device_uuids,
        compute_mode=share.compute_mode,
        request_mib=mib_ceil(request),
        limit_mib=mib_ceil(limit),
        active_thread_percentage=atp,
        mps_namespace=namespace,
        mps_pipe_directory=pipe,
    )


def pod_identity(request: PodRequest) -> str:
    pod = request.pod
    return pod.uid or f"{pod.namespace}/{pod.name}"


def plan_pod(
    request: PodRequest,
    *,
    keys: k.Keys = k.DEFAULT_KEYS,
    mps_pipe_root: str = DEFAULT_MPS_PIPE_ROOT,
) -> tuple[ContainerPlan, ...]:
    """Plans for every fractional container of a valid, bound pod; raises ContractViolation."""
    if request.errors:
        raise ContractViolation(request.errors)
    identity = pod_identity(request)
    return tuple(
        plan_container(s, identity, keys=keys, mps_pipe_root=mps_pipe_root)
        for s in request.shares
    )


def derived_annotations(plan: ContainerPlan, keys: k.Keys = k.DEFAULT_KEYS) -> dict[str, str]:
    """The project's own annotations the container's env reads (values not literally in a
    contract key), plus the plan digest the gate checks."""
    name = plan.container
    out = {
        keys.derived(name, k.DERIVED_MEMORY_REQUEST_MIB): str(plan.request_mib),
        keys.derived(name, k.DERIVED_MEMORY_LIMIT_MIB): str(plan.limit_mib),
        keys.derived(name, k.DERIVED_PINNED_MEM_LIMIT): plan.pinned_mem_limit,
        keys.derived(name, k.DERIVED_PLAN_DIGEST): plan.digest,
    }
    if plan.compute_mode is ComputeMode.SM_SHARING:
        out[keys.derived(name, k.DERIVED_ACTIVE_THREAD_PERCENTAGE)] = str(
            plan.active_thread_percentage)
        out[keys.derived(name, k.DERIVED_PIPE_DIRECTORY)] = plan.mps_pipe_directory or ""
    return out


# Which annotation each enforced env var reads (the webhook turns these into fieldRefs).
def env_sources(container: str, mode: ComputeMode, keys: k.Keys = k.DEFAULT_KEYS) -> dict[str, str]:
    sources = {
        k.ENV_VISIBLE_DEVICES: keys.container(container, k.DEVICES),
        k.ENV_MEMORY_REQUEST: keys.derived(container, k.DERIVED_MEMORY_REQUEST_MIB),
        k.ENV_MEMORY_LIMIT: keys.derived(container, k.DERIVED_MEMORY_LIMIT_MIB),
        k.ENV_PINNED_MEM_LIMIT: keys.derived(container, k.DERIVED_PINNED_MEM_LIMIT),
    }
    if mode is ComputeMode.SM_SHARING:
        sources[k.ENV_ACTIVE_THREAD_PERCENTAGE] = keys.derived(
            container, k.DERIVED_ACTIVE_THREAD_PERCENTAGE)
        sources[k.ENV_PIPE_DIRECTORY] = keys.derived(container, k.DERIVED_PIPE_DIRECTORY)
    return sources
