from kai_fractions.api.v1 import allocation_pb2 as _allocation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AllocationState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALLOCATION_STATE_UNSPECIFIED: _ClassVar[AllocationState]
    ALLOCATION_STATE_PENDING: _ClassVar[AllocationState]
    ALLOCATION_STATE_APPLIED: _ClassVar[AllocationState]
    ALLOCATION_STATE_REFUSED: _ClassVar[AllocationState]
ALLOCATION_STATE_UNSPECIFIED: AllocationState
ALLOCATION_STATE_PENDING: AllocationState
ALLOCATION_STATE_APPLIED: AllocationState
ALLOCATION_STATE_REFUSED: AllocationState

class Device(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_total_bytes", "compute_mode", "mig_enabled")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MODE_FIELD_NUMBER: _ClassVar[int]
    MIG_ENABLED_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    compute_mode: str
    mig_enabled: bool
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., compute_mode: _Optional[str] = ..., mig_enabled: _Optional[bool] = ...) -> None: ...

class AppliedLimit(_message.Message):
    __slots__ = ("gpu_uuid", "cgroup_path", "soft_limit_bytes", "hard_limit_bytes", "mechanism")
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    CGROUP_PATH_FIELD_NUMBER: _ClassVar[int]
    SOFT_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HARD_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MECHANISM_FIELD_NUMBER: _ClassVar[int]
    gpu_uuid: str
    cgroup_path: str
    soft_limit_bytes: int
    hard_limit_bytes: int
    mechanism: str
    def __init__(self, gpu_uuid: _Optional[str] = ..., cgroup_path: _Optional[str] = ..., soft_limit_bytes: _Optional[int] = ..., hard_limit_bytes: _Optional[int] = ..., mechanism: _Optional[str] = ...) -> None: ...

class ContainerAllocation(_message.Message):
    __slots__ = ("pod", "container", "devices", "compute_sharing_mode", "memory_request_bytes", "memory_limit_bytes", "active_thread_percentage", "state", "reason", "message", "plan_digest", "applied_limits", "memory_used_bytes", "mps_namespace", "change_refused_reason", "change_refused_message")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SHARING_MODE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_THREAD_PERCENTAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    APPLIED_LIMITS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MPS_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CHANGE_REFUSED_REASON_FIELD_NUMBER: _ClassVar[int]
    CHANGE_REFUSED_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    pod: _allocation_pb2.PodRef
    container: str
    devices: _containers.RepeatedScalarFieldContainer[str]
    compute_sharing_mode: _allocation_pb2.ComputeSharingMode
    memory_request_bytes: int
    memory_limit_bytes: int
    active_thread_percentage: int
    state: AllocationState
    reason: str
    message: str
    plan_digest: str
    applied_limits: _containers.RepeatedCompositeFieldContainer[AppliedLimit]
    memory_used_bytes: int
    mps_namespace: str
    change_refused_reason: str
    change_refused_message: str
    def __init__(self, pod: _Optional[_Union[_allocation_pb2.PodRef, _Mapping]] = ..., container: _Optional[str] = ..., devices: _Optional[_Iterable[str]] = ..., compute_sharing_mode: _Optional[_Union[_allocation_pb2.ComputeSharingMode, str]] = ..., memory_request_bytes: _Optional[int] = ..., memory_limit_bytes: _Optional[int] = ..., active_thread_percentage: _Optional[int] = ..., state: _Optional[_Union[AllocationState, str]] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., plan_digest: _Optional[str] = ..., applied_limits: _Optional[_Iterable[_Union[AppliedLimit, _Mapping]]] = ..., memory_used_bytes: _Optional[int] = ..., mps_namespace: _Optional[str] = ..., change_refused_reason: _Optional[str] = ..., change_refused_message: _Optional[str] = ...) -> None: ...

class NodeCondition(_message.Message):
    __slots__ = ("type", "ready", "reason", "message")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    type: str
    ready: bool
    reason: str
    message: str
    def __init__(self, type: _Optional[str] = ..., ready: _Optional[bool] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class GetNodeStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetNodeStateResponse(_message.Message):
    __slots__ = ("node_name", "driver_version", "devices", "allocations", "condition", "memory_limits_supported")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    CONDITION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMITS_SUPPORTED_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    driver_version: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    allocations: _containers.RepeatedCompositeFieldContainer[ContainerAllocation]
    condition: NodeCondition
    memory_limits_supported: bool
    def __init__(self, node_name: _Optional[str] = ..., driver_version: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., allocations: _Optional[_Iterable[_Union[ContainerAllocation, _Mapping]]] = ..., condition: _Optional[_Union[NodeCondition, _Mapping]] = ..., memory_limits_supported: _Optional[bool] = ...) -> None: ...

class ProvisionRequest(_message.Message):
    __slots__ = ("pod", "annotations", "containers", "init_containers")
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    POD_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    CONTAINERS_FIELD_NUMBER: _ClassVar[int]
    INIT_CONTAINERS_FIELD_NUMBER: _ClassVar[int]
    pod: _allocation_pb2.PodRef
    annotations: _containers.ScalarMap[str, str]
    containers: _containers.RepeatedScalarFieldContainer[str]
    init_containers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pod: _Optional[_Union[_allocation_pb2.PodRef, _Mapping]] = ..., annotations: _Optional[_Mapping[str, str]] = ..., containers: _Optional[_Iterable[str]] = ..., init_containers: _Optional[_Iterable[str]] = ...) -> None: ...

class ProvisionResponse(_message.Message):
    __slots__ = ("allocations",)
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    allocations: _containers.RepeatedCompositeFieldContainer[ContainerAllocation]
    def __init__(self, allocations: _Optional[_Iterable[_Union[ContainerAllocation, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("pod", "container")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    pod: _allocation_pb2.PodRef
    container: str
    def __init__(self, pod: _Optional[_Union[_allocation_pb2.PodRef, _Mapping]] = ..., container: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released_containers",)
    RELEASED_CONTAINERS_FIELD_NUMBER: _ClassVar[int]
    released_containers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, released_containers: _Optional[_Iterable[str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("pod", "container")
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    pod: _allocation_pb2.PodRef
    container: str
    def __init__(self, pod: _Optional[_Union[_allocation_pb2.PodRef, _Mapping]] = ..., container: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("drained_pids",)
    DRAINED_PIDS_FIELD_NUMBER: _ClassVar[int]
    drained_pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, drained_pids: _Optional[_Iterable[int]] = ...) -> None: ...
