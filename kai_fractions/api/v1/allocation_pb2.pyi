from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ComputeSharingMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPUTE_SHARING_MODE_UNSPECIFIED: _ClassVar[ComputeSharingMode]
    COMPUTE_SHARING_MODE_TIME_SLICING: _ClassVar[ComputeSharingMode]
    COMPUTE_SHARING_MODE_SM_SHARING: _ClassVar[ComputeSharingMode]

class ReceivedResourceType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECEIVED_RESOURCE_TYPE_UNSPECIFIED: _ClassVar[ReceivedResourceType]
    RECEIVED_RESOURCE_TYPE_REGULAR: _ClassVar[ReceivedResourceType]
    RECEIVED_RESOURCE_TYPE_FRACTION: _ClassVar[ReceivedResourceType]
COMPUTE_SHARING_MODE_UNSPECIFIED: ComputeSharingMode
COMPUTE_SHARING_MODE_TIME_SLICING: ComputeSharingMode
COMPUTE_SHARING_MODE_SM_SHARING: ComputeSharingMode
RECEIVED_RESOURCE_TYPE_UNSPECIFIED: ReceivedResourceType
RECEIVED_RESOURCE_TYPE_REGULAR: ReceivedResourceType
RECEIVED_RESOURCE_TYPE_FRACTION: ReceivedResourceType

class PodRef(_message.Message):
    __slots__ = ("namespace", "name", "uid")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    uid: str
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ..., uid: _Optional[str] = ...) -> None: ...

class FractionalGpuGroup(_message.Message):
    __slots__ = ("id", "compute_sharing_mode")
    ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SHARING_MODE_FIELD_NUMBER: _ClassVar[int]
    id: str
    compute_sharing_mode: ComputeSharingMode
    def __init__(self, id: _Optional[str] = ..., compute_sharing_mode: _Optional[_Union[ComputeSharingMode, str]] = ...) -> None: ...

class ReceivedGpu(_message.Message):
    __slots__ = ("count", "portion")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    PORTION_FIELD_NUMBER: _ClassVar[int]
    count: int
    portion: str
    def __init__(self, count: _Optional[int] = ..., portion: _Optional[str] = ...) -> None: ...

class Allocation(_message.Message):
    __slots__ = ("pod", "selected_node", "received_resource_type", "received_gpu", "selected_fractional_gpu_groups", "reserved_gpu_ids", "node_gpu_memory_mib", "cdi", "reserve_mib", "container_name")
    POD_FIELD_NUMBER: _ClassVar[int]
    SELECTED_NODE_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_RESOURCE_TYPE_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_GPU_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FRACTIONAL_GPU_GROUPS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_GPU_IDS_FIELD_NUMBER: _ClassVar[int]
    NODE_GPU_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    CDI_FIELD_NUMBER: _ClassVar[int]
    RESERVE_MIB_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_NAME_FIELD_NUMBER: _ClassVar[int]
    pod: PodRef
    selected_node: str
    received_resource_type: ReceivedResourceType
    received_gpu: ReceivedGpu
    selected_fractional_gpu_groups: _containers.RepeatedCompositeFieldContainer[FractionalGpuGroup]
    reserved_gpu_ids: _containers.RepeatedScalarFieldContainer[str]
    node_gpu_memory_mib: int
    cdi: bool
    reserve_mib: int
    container_name: str
    def __init__(self, pod: _Optional[_Union[PodRef, _Mapping]] = ..., selected_node: _Optional[str] = ..., received_resource_type: _Optional[_Union[ReceivedResourceType, str]] = ..., received_gpu: _Optional[_Union[ReceivedGpu, _Mapping]] = ..., selected_fractional_gpu_groups: _Optional[_Iterable[_Union[FractionalGpuGroup, _Mapping]]] = ..., reserved_gpu_ids: _Optional[_Iterable[str]] = ..., node_gpu_memory_mib: _Optional[int] = ..., cdi: _Optional[bool] = ..., reserve_mib: _Optional[int] = ..., container_name: _Optional[str] = ...) -> None: ...

class ContainerPlan(_message.Message):
    __slots__ = ("container", "env", "memory_request_bytes", "memory_limit_bytes", "compute_sharing_mode", "active_thread_percentage", "devices")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    MEMORY_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SHARING_MODE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_THREAD_PERCENTAGE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    container: str
    env: _containers.ScalarMap[str, str]
    memory_request_bytes: int
    memory_limit_bytes: int
    compute_sharing_mode: ComputeSharingMode
    active_thread_percentage: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, container: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., memory_request_bytes: _Optional[int] = ..., memory_limit_bytes: _Optional[int] = ..., compute_sharing_mode: _Optional[_Union[ComputeSharingMode, str]] = ..., active_thread_percentage: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ...) -> None: ...

class MirrorAllocationRequest(_message.Message):
    __slots__ = ("allocation", "idempotency_key", "replace")
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    allocation: Allocation
    idempotency_key: str
    replace: bool
    def __init__(self, allocation: _Optional[_Union[Allocation, _Mapping]] = ..., idempotency_key: _Optional[str] = ..., replace: _Optional[bool] = ...) -> None: ...

class MirrorAllocationResponse(_message.Message):
    __slots__ = ("annotations", "changed", "resource_version", "containers")
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTAINERS_FIELD_NUMBER: _ClassVar[int]
    annotations: _containers.ScalarMap[str, str]
    changed: bool
    resource_version: str
    containers: _containers.RepeatedCompositeFieldContainer[ContainerPlan]
    def __init__(self, annotations: _Optional[_Mapping[str, str]] = ..., changed: _Optional[bool] = ..., resource_version: _Optional[str] = ..., containers: _Optional[_Iterable[_Union[ContainerPlan, _Mapping]]] = ...) -> None: ...

class PreviewAllocationRequest(_message.Message):
    __slots__ = ("allocation", "check_conflict")
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    CHECK_CONFLICT_FIELD_NUMBER: _ClassVar[int]
    allocation: Allocation
    check_conflict: bool
    def __init__(self, allocation: _Optional[_Union[Allocation, _Mapping]] = ..., check_conflict: _Optional[bool] = ...) -> None: ...

class PreviewAllocationResponse(_message.Message):
    __slots__ = ("annotations", "containers")
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    CONTAINERS_FIELD_NUMBER: _ClassVar[int]
    annotations: _containers.ScalarMap[str, str]
    containers: _containers.RepeatedCompositeFieldContainer[ContainerPlan]
    def __init__(self, annotations: _Optional[_Mapping[str, str]] = ..., containers: _Optional[_Iterable[_Union[ContainerPlan, _Mapping]]] = ...) -> None: ...

class ReleaseAllocationRequest(_message.Message):
    __slots__ = ("pod", "idempotency_key")
    POD_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    pod: PodRef
    idempotency_key: str
    def __init__(self, pod: _Optional[_Union[PodRef, _Mapping]] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class ReleaseAllocationResponse(_message.Message):
    __slots__ = ("removed_keys", "changed")
    REMOVED_KEYS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    removed_keys: _containers.RepeatedScalarFieldContainer[str]
    changed: bool
    def __init__(self, removed_keys: _Optional[_Iterable[str]] = ..., changed: _Optional[bool] = ...) -> None: ...
