from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoomWrites(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROOM_WRITES_UNSPECIFIED: _ClassVar[RoomWrites]
    ROOM_WRITES_NONE_IN_FLIGHT: _ClassVar[RoomWrites]
    ROOM_WRITES_IN_FLIGHT: _ClassVar[RoomWrites]
ROOM_WRITES_UNSPECIFIED: RoomWrites
ROOM_WRITES_NONE_IN_FLIGHT: RoomWrites
ROOM_WRITES_IN_FLIGHT: RoomWrites

class Region(_message.Message):
    __slots__ = ("addr", "item_bytes", "count", "device_id")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    ITEM_BYTES_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    addr: int
    item_bytes: int
    count: int
    device_id: int
    def __init__(self, addr: _Optional[int] = ..., item_bytes: _Optional[int] = ..., count: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...

class MemoryLayout(_message.Message):
    __slots__ = ("kv", "aux", "mem_type", "aux_mem_type")
    KV_FIELD_NUMBER: _ClassVar[int]
    AUX_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    AUX_MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    kv: _containers.RepeatedCompositeFieldContainer[Region]
    aux: Region
    mem_type: str
    aux_mem_type: str
    def __init__(self, kv: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., aux: _Optional[_Union[Region, _Mapping]] = ..., mem_type: _Optional[str] = ..., aux_mem_type: _Optional[str] = ...) -> None: ...

class Fingerprint(_message.Message):
    __slots__ = ("model_hash", "dtype", "page_size", "kv_layout", "spec_algorithm", "draft_model_hash", "aux_row_bytes", "version", "tp_layout")
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SPEC_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    AUX_ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TP_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    model_hash: str
    dtype: str
    page_size: int
    kv_layout: str
    spec_algorithm: str
    draft_model_hash: str
    aux_row_bytes: int
    version: str
    tp_layout: str
    def __init__(self, model_hash: _Optional[str] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., kv_layout: _Optional[str] = ..., spec_algorithm: _Optional[str] = ..., draft_model_hash: _Optional[str] = ..., aux_row_bytes: _Optional[int] = ..., version: _Optional[str] = ..., tp_layout: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("decode_agent", "nixl_metadata", "layout", "fingerprint")
    DECODE_AGENT_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    decode_agent: str
    nixl_metadata: bytes
    layout: MemoryLayout
    fingerprint: Fingerprint
    def __init__(self, decode_agent: _Optional[str] = ..., nixl_metadata: _Optional[bytes] = ..., layout: _Optional[_Union[MemoryLayout, _Mapping]] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("prefill_agent", "nixl_metadata", "layout", "fingerprint")
    PREFILL_AGENT_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    prefill_agent: str
    nixl_metadata: bytes
    layout: MemoryLayout
    fingerprint: Fingerprint
    def __init__(self, prefill_agent: _Optional[str] = ..., nixl_metadata: _Optional[bytes] = ..., layout: _Optional[_Union[MemoryLayout, _Mapping]] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ...) -> None: ...

class DestinationRequest(_message.Message):
    __slots__ = ("room", "request_id", "decode_agent", "pages", "aux_row", "num_tokens", "deadline_unix_s", "cached_pages")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    AUX_ROW_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    room: int
    request_id: str
    decode_agent: str
    pages: _containers.RepeatedScalarFieldContainer[int]
    aux_row: int
    num_tokens: int
    deadline_unix_s: float
    cached_pages: int
    def __init__(self, room: _Optional[int] = ..., request_id: _Optional[str] = ..., decode_agent: _Optional[str] = ..., pages: _Optional[_Iterable[int]] = ..., aux_row: _Optional[int] = ..., num_tokens: _Optional[int] = ..., deadline_unix_s: _Optional[float] = ..., cached_pages: _Optional[int] = ...) -> None: ...

class DestinationAck(_message.Message):
    __slots__ = ("accepted", "error")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    error: str
    def __init__(self, accepted: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class AbortRoomRequest(_message.Message):
    __slots__ = ("room", "reason")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    room: int
    reason: str
    def __init__(self, room: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortRoomAck(_message.Message):
    __slots__ = ("writes",)
    WRITES_FIELD_NUMBER: _ClassVar[int]
    writes: RoomWrites
    def __init__(self, writes: _Optional[_Union[RoomWrites, str]] = ...) -> None: ...
