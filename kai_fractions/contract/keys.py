"""Every annotation key, label and env name of the NvFractions contract, and nothing else.

The per-container shape is `<prefix><containerName><suffix>`; the prefix is configurable
(default `nvidia.com/container.`). Container names are DNS labels (no dots), so the first dot
after the prefix ends the name and the split is unambiguous.

kai_fractions' own per-container keys (`Keys.derived`) are `<project prefix><id><suffix>`, the
id being the container's name when every such key fits Kubernetes' 63 characters, else a
shortened one (`Keys.container_id`): a container may be named with up to 63 characters, and
KAI's keys leave room for longer names than ours. Readers find them by `Keys.derived` of the
container's name, never by parsing a name out of the key.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from .names import MAX_NAME, is_dns_label, is_dns_subdomain

DEFAULT_PREFIX = "nvidia.com/container."

# Per-container suffixes.
MEMORY_REQUEST = ".gpu-memory.request"
MEMORY_LIMIT = ".gpu-memory.limit"
COMPUTE_MODE = ".gpu-compute.mode"
DEVICES = ".gpus.devices"  # binder only
COMPUTE_PORTION = ".gpu-compute.portion"  # binder only
USER_SUFFIXES = (MEMORY_REQUEST, MEMORY_LIMIT, COMPUTE_MODE)
BINDER_SUFFIXES = (DEVICES, COMPUTE_PORTION)
SUFFIXES = USER_SUFFIXES + BINDER_SUFFIXES

# Pod-level and legacy annotations (still honoured).
GPU_FRACTION = "gpu-fraction"
GPU_FRACTION_LIMIT = "gpu-fraction.limit"
GPU_MEMORY = "gpu-memory"
GPU_MEMORY_LIMIT = "gpu-memory.limit"
GPU_FRACTION_NUM_DEVICES = "gpu-fraction-num-devices"
GPU_FRACTION_CONTAINER_NAME = "gpu-fraction-container-name"
RECEIVED_RESOURCE_TYPE = "received-resource-type"  # binder, on every bind
PORTION_LIMIT_PREFIX = "kai.scheduler/container."
PORTION_LIMIT_SUFFIX = ".gpu-memory.portion.limit"
LEGACY_COMPUTE_MODE = "kai.scheduler/gpu-compute-sharing-mode"  # older docs; read by nobody
RESERVE_FOR_GPU = "run.ai/reserve_for_gpu_index"  # on the reservation pod
LEGACY_POD_KEYS = (
    GPU_FRACTION,
    GPU_FRACTION_LIMIT,
    GPU_MEMORY,
    GPU_MEMORY_LIMIT,
    GPU_FRACTION_NUM_DEVICES,
    GPU_FRACTION_CONTAINER_NAME,
)

# Labels.
GPU_GROUP_LABEL = "runai-gpu-group"
QUEUE_LABEL = "kai.scheduler/queue"
NODE_GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"  # node label, MiB per GPU

# Values.
RESOURCE_TYPE_REGULAR = "Regular"
RESOURCE_TYPE_FRACTION = "Fraction"
WHOLE_GPU_RESOURCE = "nvidia.com/gpu"
CDI_DEVICE_PREFIX = "k8s.device-plugin.nvidia.com/gpu="
KAI_BINDER_IDENTITY = "system:serviceaccount:kai-scheduler:binder"
KAI_SCHEDULER_NAME = "kai-scheduler"

# Node conditions KAI reads before placing fractional pods.
NODE_CONDITION = "gpu-fractioning.nvidia.com/Ready"
LEGACY_NODE_CONDITION = "gpu-sharing.nvidia.com/Ready"

# What the container must end up with.
ENV_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
ENV_MEMORY_REQUEST = "NVIDIA_GPU_MEMORY_REQUEST"
ENV_MEMORY_LIMIT = "NVIDIA_GPU_MEMORY_LIMIT"
ENV_PINNED_MEM_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ENV_ACTIVE_THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"
ENFORCED_ENV = (
    ENV_VISIBLE_DEVICES,
    ENV_MEMORY_REQUEST,
    ENV_MEMORY_LIMIT,
    ENV_PINNED_MEM_LIMIT,
    ENV_ACTIVE_THREAD_PERCENTAGE,
    ENV_PIPE_DIRECTORY,
)

# KAI's BindRequest (the scheduler's decision) and where its binder reserves devices.
BINDREQUEST_GROUP = "scheduling.run.ai"
BINDREQUEST_VERSION = "v1alpha2"
BINDREQUEST_PLURAL = "bindrequests"
RESERVATION_NAMESPACE = "kai-resource-reservation"

# The mirror's record of what it wrote (its keys, the decision digest, the idempotency key).
# Protected: a forged record could make the mirror strip and then overwrite a user's request.
MIRRORED_RECORD = "kai-fractions.io/mirrored"

# kai_fractions' own annotations: values the env needs that are not literally in a contract key.
PROJECT_PREFIX = "kai-fractions.io/container."
DERIVED_MEMORY_REQUEST_MIB = ".memory-request-mib"
DERIVED_MEMORY_LIMIT_MIB = ".memory-limit-mib"
DERIVED_PINNED_MEM_LIMIT = ".mps-pinned-mem-limit"
DERIVED_ACTIVE_THREAD_PERCENTAGE = ".mps-active-thread-percentage"
DERIVED_PIPE_DIRECTORY = ".mps-pipe-directory"
DERIVED_PLAN_DIGEST = ".plan-digest"
DERIVED_SUFFIXES = (
    DERIVED_MEMORY_REQUEST_MIB,
    DERIVED_MEMORY_LIMIT_MIB,
    DERIVED_PINNED_MEM_LIMIT,
    DERIVED_ACTIVE_THREAD_PERCENTAGE,
    DERIVED_PIPE_DIRECTORY,
    DERIVED_PLAN_DIGEST,
)
# The mirror's signature over a container's allocation (kai_fractions.signing); the node agent
# verifies it. Under the project prefix, so `Keys.is_protected` covers it; not an env source.
DERIVED_SIGNATURE = ".signature"
# The MPS namespace of an sm-sharing container, named by the admission webhook when the pod is
# created (`kai-fractions.io/container.<c>.mps-namespace`): the container mounts only that
# namespace's pipe directory, so the name must exist before the pod has a UID. Protected like
# the derived keys; neither the mirror nor the agent ever writes it.
ADMITTED_MPS_NAMESPACE = ".mps-namespace"
MPS_NAMESPACE_PREFIX = "kf_"
_MPS_NAMESPACE = re.compile(MPS_NAMESPACE_PREFIX + "[0-9a-f]{20}")


def is_mps_namespace_name(name: str) -> bool:
    """True for the names kai_fractions gives MPS namespaces (the webhook's, and the plan's
    hash of a pod UID): the agent deletes only its own namespaces."""
    return bool(_MPS_NAMESPACE.fullmatch(name))


def is_container_name(name: str) -> bool:
    return is_dns_label(name)


MAX_KEY_NAME = 63
"""The part of an annotation key after its '/' (a Kubernetes qualified name) holds at most
this many characters."""
_KEY_NAME_START = re.compile(r"[A-Za-z0-9][-._A-Za-z0-9]*")
"""What a qualified name may hold, from its first character (alphanumeric) on; the prefix's
part ends with a dot, and the container name and suffix appended to it end alphanumeric."""


def _longest(suffixes: tuple[str, ...]) -> int:
    return max(len(s) for s in suffixes)


PREFIX_SUFFIXES = SUFFIXES
"""What `Keys.container` appends to the configured prefix, after the container's name."""
PROJECT_SUFFIXES = (*DERIVED_SUFFIXES, DERIVED_SIGNATURE, ADMITTED_MPS_NAMESPACE)
"""What `Keys.derived` appends to the project prefix."""
ID_HASH_DIGITS = 8
"""Hex digits of sha256(container name) that end a shortened container id."""
ID_SEPARATOR = "_"
"""Between a shortened id's head and its hash: no container name (a DNS label) holds it, so a
shortened id is never another container's name, and no two containers share derived keys."""
MIN_ID_ROOM = 1 + len(ID_SEPARATOR) + ID_HASH_DIGITS
"""The room a project prefix must leave for a container id: one character of the name, the
separator and the hash."""


def key_name_length(key: str) -> int:
    """The length of the part of `key` after its '/' (the part held to MAX_KEY_NAME)."""
    return len(key.rpartition("/")[2])


def prefix_problem(name: str, value: str, suffixes: tuple[str, ...],
                   min_room: int = 1) -> str | None:
    """Why `value` cannot be a per-container prefix (None: it can): `<prefix><container>
    <suffix>` must be an annotation key Kubernetes accepts for every suffix in `suffixes` and at
    least a `min_room`-character container, the part before '/' a DNS subdomain and the part
    after it a qualified name of at most 63 characters. One line, starting with `name` and the
    value."""
    if not value or "/" not in value or not value.endswith("."):
        return (f"{name} must look like 'example.com/container.' (a domain, a slash, ending "
                f"with a dot), got {value!r}")
    domain, _, rest = value.partition("/")
    if not is_dns_subdomain(domain):
        return (f"{name} {value!r}: the part before '/' must be a DNS subdomain (lower-case "
                "letters, digits, '-' and '.'; each dot-separated part starts and ends with a "
                f"letter or digit; at most {MAX_NAME} characters)")
    if not _KEY_NAME_START.fullmatch(rest):
        return (f"{name} {value!r}: the part after '/' must start with a letter or digit and "
                "hold only letters, digits, '-', '_' and '.' (an annotation key's name)")
    room = MAX_KEY_NAME - len(rest) - _longest(suffixes)
    if room < min_room:
        return (f"{name} {value!r}: the part after '/' is {len(rest)} characters, and a "
                f"container name and a suffix of up to {_longest(suffixes)} "
                f"({max(suffixes, key=len)!r}) are appended to it in an annotation key whose "
                f"name holds at most {MAX_KEY_NAME}: it may be at most "
                f"{MAX_KEY_NAME - min_room - _longest(suffixes)} characters")
    return None


@lru_cache(maxsize=64)
def _id_room(project_prefix: str) -> int:
    """The longest container id `<project_prefix><id><suffix>` holds for every project
    suffix."""
    return MAX_KEY_NAME - key_name_length(project_prefix) - _longest(PROJECT_SUFFIXES)


@lru_cache(maxsize=4096)
def _container_id(container: str, room: int) -> str:
    if len(container) <= room:
        return container
    digest = hashlib.sha256(container.encode()).hexdigest()[:ID_HASH_DIGITS]
    return container[: room - len(ID_SEPARATOR) - ID_HASH_DIGITS] + ID_SEPARATOR + digest


@dataclass(frozen=True, slots=True)
class Keys:
    """Key builder for one configured prefix. `Keys()` is KAI's default spelling."""

    prefix: str = DEFAULT_PREFIX
    project_prefix: str = PROJECT_PREFIX

    def __post_init__(self) -> None:
        for name, value, suffixes, room in (
                ("prefix", self.prefix, PREFIX_SUFFIXES, 1),
                ("project_prefix", self.project_prefix, PROJECT_SUFFIXES, MIN_ID_ROOM)):
            problem = prefix_problem(name, value, suffixes, room)
            if problem:
                raise ValueError(problem)
        if self.prefix.startswith(self.project_prefix) or \
                self.project_prefix.startswith(self.prefix):
            # The derived keys would then be read as the user's and the binder's, and a rule
            # that lets the node agent write its own keys would let it write the binder's.
            raise ValueError(
                f"prefix {self.prefix!r} overlaps the keys kai_fractions derives "
                f"({self.project_prefix!r}): give the scheduler's per-container prefix, such "
                "as 'nvidia.com/container.'")

    def container(self, container: str, suffix: str) -> str:
        return f"{self.prefix}{container}{suffix}"

    def container_id(self, container: str) -> str:
        """How `container` is named in its derived keys: its name when every derived key of
        it fits in 63 characters (with the default project prefix: a name of at most 24), else
        the name cut to leave room, `_` and 8 hex digits of the sha256 of the whole name
        (deterministic, so the mirror, the agent, the webhook and the gate find the same key;
        a `_` no container name holds, so never another container's name)."""
        return _container_id(container, _id_room(self.project_prefix))

    def derived(self, container: str, suffix: str) -> str:
        """`<project prefix><container id><suffix>`: kai_fractions' own key of `container`."""
        return f"{self.project_prefix}{self.container_id(container)}{suffix}"

    def derived_container(self, key: str, containers: Iterable[str]) -> str | None:
        """The container whose derived key `key` is (any suffix): the one among `containers`
        whose `container_id` it carries; else the id itself when it is a name that is its own
        id (a name that fits); None otherwise (no derived key, or a shortened id of a container
        not among them: the id cannot be read back into a name)."""
        if not key.startswith(self.project_prefix):
            return None
        for name in containers:
            if key.startswith(f"{self.project_prefix}{self.container_id(name)}."):
                return name
        ident = key[len(self.project_prefix):].partition(".")[0]
        return ident if is_dns_label(ident) and self.container_id(ident) == ident else None

    def portion_limit(self, container: str) -> str:
        return f"{PORTION_LIMIT_PREFIX}{container}{PORTION_LIMIT_SUFFIX}"

    @staticmethod
    def _split(key: str, prefix: str) -> tuple[str, str] | None:
        if not key.startswith(prefix):
            return None
        rest = key[len(prefix) :]
        name, dot, tail = rest.partition(".")
        return name, dot + tail

    def split(self, key: str) -> tuple[str, str] | None:
        """`nvidia.com/container.main.gpu-memory.request` -> ("main", ".gpu-memory.request")."""
        return self._split(key, self.prefix)

    def split_portion_limit(self, key: str) -> str | None:
        """The container of a `kai.scheduler/container.<c>.gpu-memory.portion.limit` key."""
        if key.startswith(PORTION_LIMIT_PREFIX) and key.endswith(PORTION_LIMIT_SUFFIX):
            return key[len(PORTION_LIMIT_PREFIX) : -len(PORTION_LIMIT_SUFFIX)]
        return None

    def is_user_owned(self, key: str) -> bool:
        """The keys a user writes to ask for GPU sharing: a container's request, limit and
        compute mode under the prefix, KAI's legacy pod-level keys and the per-container
        `gpu-memory.portion.limit`."""
        parts = self.split(key)
        return ((parts is not None and parts[1] in USER_SUFFIXES) or key in LEGACY_POD_KEYS
                or self.split_portion_limit(key) is not None)

    def is_binder_owned(self, key: str) -> bool:
        parts = self.split(key)
        return parts is not None and parts[1] in BINDER_SUFFIXES

    def is_admitted_namespace(self, key: str) -> bool:
        """`<project prefix><container>.mps-namespace`: protected, but the admission webhook's
        (written once, as the pod is created), not the binder's or the mirror's."""
        return key.startswith(self.project_prefix) and key.endswith(ADMITTED_MPS_NAMESPACE)

    def is_protected(self, key: str) -> bool:
        """Keys only the binder, the mirror or the node agent may write: binder-owned keys,
        every derived key (they feed the container's env, so a user must not set them) and the
        mirror's record."""
        return (self.is_binder_owned(key) or key.startswith(self.project_prefix)
                or key == MIRRORED_RECORD)


DEFAULT_KEYS = Keys()
