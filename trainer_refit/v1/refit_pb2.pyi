from trainer_refit.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_DRAM: _ClassVar[MemoryKind]
    MEMORY_KIND_VRAM: _ClassVar[MemoryKind]

class SourceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SOURCE_KIND_UNSPECIFIED: _ClassVar[SourceKind]
    SOURCE_KIND_TRAINER: _ClassVar[SourceKind]
    SOURCE_KIND_PEER: _ClassVar[SourceKind]
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_DRAM: MemoryKind
MEMORY_KIND_VRAM: MemoryKind
SOURCE_KIND_UNSPECIFIED: SourceKind
SOURCE_KIND_TRAINER: SourceKind
SOURCE_KIND_PEER: SourceKind

class Box(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[int]] = ...) -> None: ...

class ShardPiece(_message.Message):
    __slots__ = ("box", "local_start")
    BOX_FIELD_NUMBER: _ClassVar[int]
    LOCAL_START_FIELD_NUMBER: _ClassVar[int]
    box: Box
    local_start: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, box: _Optional[_Union[Box, _Mapping]] = ..., local_start: _Optional[_Iterable[int]] = ...) -> None: ...

class ShardLocation(_message.Message):
    __slots__ = ("agent", "address", "nbytes", "shape", "strides", "memory", "device_id")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    agent: str
    address: int
    nbytes: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    strides: _containers.RepeatedScalarFieldContainer[int]
    memory: MemoryKind
    device_id: int
    def __init__(self, agent: _Optional[str] = ..., address: _Optional[int] = ..., nbytes: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., strides: _Optional[_Iterable[int]] = ..., memory: _Optional[_Union[MemoryKind, str]] = ..., device_id: _Optional[int] = ...) -> None: ...

class ShardRecord(_message.Message):
    __slots__ = ("location", "pieces", "crc32", "rank", "tensor_rank", "pipeline_stage", "wsum64", "expert_rank", "expert_tensor_rank")
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_RANK_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_STAGE_FIELD_NUMBER: _ClassVar[int]
    WSUM64_FIELD_NUMBER: _ClassVar[int]
    EXPERT_RANK_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TENSOR_RANK_FIELD_NUMBER: _ClassVar[int]
    location: ShardLocation
    pieces: _containers.RepeatedCompositeFieldContainer[ShardPiece]
    crc32: int
    rank: int
    tensor_rank: int
    pipeline_stage: int
    wsum64: int
    expert_rank: int
    expert_tensor_rank: int
    def __init__(self, location: _Optional[_Union[ShardLocation, _Mapping]] = ..., pieces: _Optional[_Iterable[_Union[ShardPiece, _Mapping]]] = ..., crc32: _Optional[int] = ..., rank: _Optional[int] = ..., tensor_rank: _Optional[int] = ..., pipeline_stage: _Optional[int] = ..., wsum64: _Optional[int] = ..., expert_rank: _Optional[int] = ..., expert_tensor_rank: _Optional[int] = ...) -> None: ...

class ParameterRecord(_message.Message):
    __slots__ = ("name", "shape", "dtype", "shards")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: _common_pb2.DType
    shards: _containers.RepeatedCompositeFieldContainer[ShardRecord]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., shards: _Optional[_Iterable[_Union[ShardRecord, _Mapping]]] = ...) -> None: ...

class SourceAgent(_message.Message):
    __slots__ = ("name", "metadata", "rank", "version_word", "pieces")
    NAME_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    VERSION_WORD_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    name: str
    metadata: bytes
    rank: int
    version_word: ShardLocation
    pieces: SnapshotPieces
    def __init__(self, name: _Optional[str] = ..., metadata: _Optional[bytes] = ..., rank: _Optional[int] = ..., version_word: _Optional[_Union[ShardLocation, _Mapping]] = ..., pieces: _Optional[_Union[SnapshotPieces, _Mapping]] = ...) -> None: ...

class SnapshotPieces(_message.Message):
    __slots__ = ("words", "slot_address", "ends")
    WORDS_FIELD_NUMBER: _ClassVar[int]
    SLOT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    words: ShardLocation
    slot_address: int
    ends: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, words: _Optional[_Union[ShardLocation, _Mapping]] = ..., slot_address: _Optional[int] = ..., ends: _Optional[_Iterable[int]] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("version", "layout", "parameters", "agents", "pending")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    version: int
    layout: _common_pb2.ParallelLayout
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterRecord]
    agents: _containers.RepeatedCompositeFieldContainer[SourceAgent]
    pending: bool
    def __init__(self, version: _Optional[int] = ..., layout: _Optional[_Union[_common_pb2.ParallelLayout, _Mapping]] = ..., parameters: _Optional[_Iterable[_Union[ParameterRecord, _Mapping]]] = ..., agents: _Optional[_Iterable[_Union[SourceAgent, _Mapping]]] = ..., pending: _Optional[bool] = ...) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("version", "total_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    total_bytes: int
    def __init__(self, version: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class GetLatestVersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchVersionsRequest(_message.Message):
    __slots__ = ("after_version",)
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    after_version: int
    def __init__(self, after_version: _Optional[int] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("version", "reserved")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    version: int
    reserved: bool
    def __init__(self, version: _Optional[int] = ..., reserved: _Optional[bool] = ...) -> None: ...

class AcquireLeaseRequest(_message.Message):
    __slots__ = ("version", "receiver_id", "ttl_seconds", "wait_seconds", "with_checksums", "before_readable")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WITH_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    BEFORE_READABLE_FIELD_NUMBER: _ClassVar[int]
    version: int
    receiver_id: str
    ttl_seconds: float
    wait_seconds: float
    with_checksums: bool
    before_readable: bool
    def __init__(self, version: _Optional[int] = ..., receiver_id: _Optional[str] = ..., ttl_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., with_checksums: _Optional[bool] = ..., before_readable: _Optional[bool] = ...) -> None: ...

class GetChecksumsRequest(_message.Message):
    __slots__ = ("version", "wait_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    wait_seconds: float
    def __init__(self, version: _Optional[int] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class VersionChecksums(_message.Message):
    __slots__ = ("version", "manifest_key", "checksums")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_KEY_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest_key: bytes
    checksums: _containers.RepeatedCompositeFieldContainer[ShardChecksums]
    def __init__(self, version: _Optional[int] = ..., manifest_key: _Optional[bytes] = ..., checksums: _Optional[_Iterable[_Union[ShardChecksums, _Mapping]]] = ...) -> None: ...

class ShardChecksums(_message.Message):
    __slots__ = ("crc32", "wsum64")
    CRC32_FIELD_NUMBER: _ClassVar[int]
    WSUM64_FIELD_NUMBER: _ClassVar[int]
    crc32: int
    wsum64: int
    def __init__(self, crc32: _Optional[int] = ..., wsum64: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "version", "expires_in_seconds", "manifest_key", "receiver_id", "checksums", "readable_at", "answered_at", "pending")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_KEY_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    READABLE_AT_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_AT_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    version: int
    expires_in_seconds: float
    manifest_key: bytes
    receiver_id: str
    checksums: _containers.RepeatedCompositeFieldContainer[ShardChecksums]
    readable_at: float
    answered_at: float
    pending: bool
    def __init__(self, lease_id: _Optional[str] = ..., version: _Optional[int] = ..., expires_in_seconds: _Optional[float] = ..., manifest_key: _Optional[bytes] = ..., receiver_id: _Optional[str] = ..., checksums: _Optional[_Iterable[_Union[ShardChecksums, _Mapping]]] = ..., readable_at: _Optional[float] = ..., answered_at: _Optional[float] = ..., pending: _Optional[bool] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "ttl_seconds", "receiver_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_seconds: float
    receiver_id: str
    def __init__(self, lease_id: _Optional[str] = ..., ttl_seconds: _Optional[float] = ..., receiver_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "receiver_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    receiver_id: str
    def __init__(self, lease_id: _Optional[str] = ..., receiver_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterTrainerRequest(_message.Message):
    __slots__ = ("layout", "num_slots", "owner", "take_over", "generation")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    TAKE_OVER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.ParallelLayout
    num_slots: int
    owner: str
    take_over: bool
    generation: int
    def __init__(self, layout: _Optional[_Union[_common_pb2.ParallelLayout, _Mapping]] = ..., num_slots: _Optional[int] = ..., owner: _Optional[str] = ..., take_over: _Optional[bool] = ..., generation: _Optional[int] = ...) -> None: ...

class RegisterTrainerResponse(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class RenewRegistrationRequest(_message.Message):
    __slots__ = ("generation", "wait_version", "wait_seconds")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WAIT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    wait_version: int
    wait_seconds: float
    def __init__(self, generation: _Optional[int] = ..., wait_version: _Optional[int] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class RegistrationStatus(_message.Message):
    __slots__ = ("generation", "pending", "latest")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    generation: int
    pending: _containers.RepeatedCompositeFieldContainer[PendingVersion]
    latest: int
    def __init__(self, generation: _Optional[int] = ..., pending: _Optional[_Iterable[_Union[PendingVersion, _Mapping]]] = ..., latest: _Optional[int] = ...) -> None: ...

class PendingVersion(_message.Message):
    __slots__ = ("version", "missing_ranks")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MISSING_RANKS_FIELD_NUMBER: _ClassVar[int]
    version: int
    missing_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., missing_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveSlotRequest(_message.Message):
    __slots__ = ("version", "ahead", "generation", "abandoned")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    version: int
    ahead: bool
    generation: int
    abandoned: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., ahead: _Optional[bool] = ..., generation: _Optional[int] = ..., abandoned: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveSlotResponse(_message.Message):
    __slots__ = ("slot", "retired_version")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    RETIRED_VERSION_FIELD_NUMBER: _ClassVar[int]
    slot: int
    retired_version: int
    def __init__(self, slot: _Optional[int] = ..., retired_version: _Optional[int] = ...) -> None: ...

class PublishShardsRequest(_message.Message):
    __slots__ = ("version", "rank", "agent", "parameters", "generation", "slot_layouts")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SLOT_LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    rank: int
    agent: SourceAgent
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterRecord]
    generation: int
    slot_layouts: _containers.RepeatedCompositeFieldContainer[SlotLayout]
    def __init__(self, version: _Optional[int] = ..., rank: _Optional[int] = ..., agent: _Optional[_Union[SourceAgent, _Mapping]] = ..., parameters: _Optional[_Iterable[_Union[ParameterRecord, _Mapping]]] = ..., generation: _Optional[int] = ..., slot_layouts: _Optional[_Iterable[_Union[SlotLayout, _Mapping]]] = ...) -> None: ...

class SlotLayout(_message.Message):
    __slots__ = ("slot", "agent", "parameters")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    agent: SourceAgent
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterRecord]
    def __init__(self, slot: _Optional[int] = ..., agent: _Optional[_Union[SourceAgent, _Mapping]] = ..., parameters: _Optional[_Iterable[_Union[ParameterRecord, _Mapping]]] = ...) -> None: ...

class PublishShardsResponse(_message.Message):
    __slots__ = ("visible",)
    VISIBLE_FIELD_NUMBER: _ClassVar[int]
    visible: bool
    def __init__(self, visible: _Optional[bool] = ...) -> None: ...

class WantedBox(_message.Message):
    __slots__ = ("name", "box")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    name: str
    box: Box
    def __init__(self, name: _Optional[str] = ..., box: _Optional[_Union[Box, _Mapping]] = ...) -> None: ...

class PeerOffer(_message.Message):
    __slots__ = ("agent", "locations", "progress", "progress_file")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FILE_FIELD_NUMBER: _ClassVar[int]
    agent: SourceAgent
    locations: _containers.RepeatedCompositeFieldContainer[ShardLocation]
    progress: ShardLocation
    progress_file: ProgressFile
    def __init__(self, agent: _Optional[_Union[SourceAgent, _Mapping]] = ..., locations: _Optional[_Iterable[_Union[ShardLocation, _Mapping]]] = ..., progress: _Optional[_Union[ShardLocation, _Mapping]] = ..., progress_file: _Optional[_Union[ProgressFile, _Mapping]] = ...) -> None: ...

class ProgressFile(_message.Message):
    __slots__ = ("host", "path")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    host: str
    path: str
    def __init__(self, host: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class GetSourcesRequest(_message.Message):
    __slots__ = ("version", "receiver_id", "domain", "wants", "offer", "lost", "wait_seconds", "lease_ttl_seconds", "lease_with_checksums", "known_routing_keys")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    WANTS_FIELD_NUMBER: _ClassVar[int]
    OFFER_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_WITH_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_ROUTING_KEYS_FIELD_NUMBER: _ClassVar[int]
    version: int
    receiver_id: str
    domain: str
    wants: _containers.RepeatedCompositeFieldContainer[WantedBox]
    offer: PeerOffer
    lost: _containers.RepeatedScalarFieldContainer[str]
    wait_seconds: float
    lease_ttl_seconds: float
    lease_with_checksums: bool
    known_routing_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, version: _Optional[int] = ..., receiver_id: _Optional[str] = ..., domain: _Optional[str] = ..., wants: _Optional[_Iterable[_Union[WantedBox, _Mapping]]] = ..., offer: _Optional[_Union[PeerOffer, _Mapping]] = ..., lost: _Optional[_Iterable[str]] = ..., wait_seconds: _Optional[float] = ..., lease_ttl_seconds: _Optional[float] = ..., lease_with_checksums: _Optional[bool] = ..., known_routing_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SourceRoute(_message.Message):
    __slots__ = ("name", "box", "primary", "fallbacks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    box: Box
    primary: str
    fallbacks: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., box: _Optional[_Union[Box, _Mapping]] = ..., primary: _Optional[str] = ..., fallbacks: _Optional[_Iterable[str]] = ...) -> None: ...

class SourceCopy(_message.Message):
    __slots__ = ("source_id", "kind", "shards", "progress", "progress_file")
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FILE_FIELD_NUMBER: _ClassVar[int]
    source_id: str
    kind: SourceKind
    shards: Manifest
    progress: ShardLocation
    progress_file: ProgressFile
    def __init__(self, source_id: _Optional[str] = ..., kind: _Optional[_Union[SourceKind, str]] = ..., shards: _Optional[_Union[Manifest, _Mapping]] = ..., progress: _Optional[_Union[ShardLocation, _Mapping]] = ..., progress_file: _Optional[_Union[ProgressFile, _Mapping]] = ...) -> None: ...

class GetSourcesResponse(_message.Message):
    __slots__ = ("version", "routes", "sources", "offer_expires_in_seconds", "routing_key", "lease", "routes_left_out")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    OFFER_EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    ROUTES_LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    version: int
    routes: _containers.RepeatedCompositeFieldContainer[SourceRoute]
    sources: _containers.RepeatedCompositeFieldContainer[SourceCopy]
    offer_expires_in_seconds: float
    routing_key: bytes
    lease: Lease
    routes_left_out: bool
    def __init__(self, version: _Optional[int] = ..., routes: _Optional[_Iterable[_Union[SourceRoute, _Mapping]]] = ..., sources: _Optional[_Iterable[_Union[SourceCopy, _Mapping]]] = ..., offer_expires_in_seconds: _Optional[float] = ..., routing_key: _Optional[bytes] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., routes_left_out: _Optional[bool] = ...) -> None: ...

class ReleaseSourcesRequest(_message.Message):
    __slots__ = ("version", "receiver_id", "complete")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    version: int
    receiver_id: str
    complete: bool
    def __init__(self, version: _Optional[int] = ..., receiver_id: _Optional[str] = ..., complete: _Optional[bool] = ...) -> None: ...

class ReleaseSourcesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTreeRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class TreeNode(_message.Message):
    __slots__ = ("node_id", "kind", "domain", "complete", "depth", "children", "serves")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    SERVES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    kind: SourceKind
    domain: str
    complete: bool
    depth: int
    children: int
    serves: bool
    def __init__(self, node_id: _Optional[str] = ..., kind: _Optional[_Union[SourceKind, str]] = ..., domain: _Optional[str] = ..., complete: _Optional[bool] = ..., depth: _Optional[int] = ..., children: _Optional[int] = ..., serves: _Optional[bool] = ...) -> None: ...

class TreeEdge(_message.Message):
    __slots__ = ("parent", "child", "active")
    PARENT_FIELD_NUMBER: _ClassVar[int]
    CHILD_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    parent: str
    child: str
    active: bool
    def __init__(self, parent: _Optional[str] = ..., child: _Optional[str] = ..., active: _Optional[bool] = ...) -> None: ...

class TreeListing(_message.Message):
    __slots__ = ("version", "nodes", "edges", "depth")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    EDGES_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    version: int
    nodes: _containers.RepeatedCompositeFieldContainer[TreeNode]
    edges: _containers.RepeatedCompositeFieldContainer[TreeEdge]
    depth: int
    def __init__(self, version: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[TreeNode, _Mapping]]] = ..., edges: _Optional[_Iterable[_Union[TreeEdge, _Mapping]]] = ..., depth: _Optional[int] = ...) -> None: ...
