from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StoreDecision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORE_DECISION_UNSPECIFIED: _ClassVar[StoreDecision]
    STORE_DECISION_NEW: _ClassVar[StoreDecision]
    STORE_DECISION_PRESENT: _ClassVar[StoreDecision]
    STORE_DECISION_NO_SPACE: _ClassVar[StoreDecision]
STORE_DECISION_UNSPECIFIED: StoreDecision
STORE_DECISION_NEW: StoreDecision
STORE_DECISION_PRESENT: StoreDecision
STORE_DECISION_NO_SPACE: StoreDecision

class NamespaceSpec(_message.Message):
    __slots__ = ("model", "dtype", "kv_layout", "block_size", "chunk_blocks", "tp_size", "hash_algo", "key_size", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    kv_layout: str
    block_size: int
    chunk_blocks: int
    tp_size: int
    hash_algo: str
    key_size: int
    extra: _containers.ScalarMap[str, str]
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_layout: _Optional[str] = ..., block_size: _Optional[int] = ..., chunk_blocks: _Optional[int] = ..., tp_size: _Optional[int] = ..., hash_algo: _Optional[str] = ..., key_size: _Optional[int] = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("spec", "num_ranks", "slot_bytes_per_rank", "client_name", "engine")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    spec: NamespaceSpec
    num_ranks: int
    slot_bytes_per_rank: int
    client_name: str
    engine: int
    def __init__(self, spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., num_ranks: _Optional[int] = ..., slot_bytes_per_rank: _Optional[int] = ..., client_name: _Optional[str] = ..., engine: _Optional[int] = ...) -> None: ...

class RankRegion(_message.Message):
    __slots__ = ("rank", "path", "offset", "slot_bytes", "slot_count")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    path: str
    offset: int
    slot_bytes: int
    slot_count: int
    def __init__(self, rank: _Optional[int] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., slot_count: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("namespace_id", "client_id", "regions", "pool_ready", "prefault_fraction", "committed_blocks", "pool_generation", "session_socket", "presence_map", "sidecar_epoch", "engine_lock_base", "slot_table_offset", "slot_record_bytes", "engine", "tenant_memory", "pool")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    POOL_READY_FIELD_NUMBER: _ClassVar[int]
    PREFAULT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_SOCKET_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_MAP_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_LOCK_BASE_FIELD_NUMBER: _ClassVar[int]
    SLOT_TABLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SLOT_RECORD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    TENANT_MEMORY_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    client_id: int
    regions: _containers.RepeatedCompositeFieldContainer[RankRegion]
    pool_ready: bool
    prefault_fraction: float
    committed_blocks: int
    pool_generation: str
    session_socket: str
    presence_map: str
    sidecar_epoch: int
    engine_lock_base: int
    slot_table_offset: int
    slot_record_bytes: int
    engine: int
    tenant_memory: str
    pool: PoolName
    def __init__(self, namespace_id: _Optional[str] = ..., client_id: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[RankRegion, _Mapping]]] = ..., pool_ready: _Optional[bool] = ..., prefault_fraction: _Optional[float] = ..., committed_blocks: _Optional[int] = ..., pool_generation: _Optional[str] = ..., session_socket: _Optional[str] = ..., presence_map: _Optional[str] = ..., sidecar_epoch: _Optional[int] = ..., engine_lock_base: _Optional[int] = ..., slot_table_offset: _Optional[int] = ..., slot_record_bytes: _Optional[int] = ..., engine: _Optional[int] = ..., tenant_memory: _Optional[str] = ..., pool: _Optional[_Union[PoolName, _Mapping]] = ...) -> None: ...

class PoolName(_message.Message):
    __slots__ = ("placement", "pool_id", "node_pool", "node", "tenant", "pool_bytes")
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_POOL_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    placement: str
    pool_id: str
    node_pool: str
    node: str
    tenant: str
    pool_bytes: int
    def __init__(self, placement: _Optional[str] = ..., pool_id: _Optional[str] = ..., node_pool: _Optional[str] = ..., node: _Optional[str] = ..., tenant: _Optional[str] = ..., pool_bytes: _Optional[int] = ...) -> None: ...

class KeyList(_message.Message):
    __slots__ = ("keys", "cache_salt")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    cache_salt: str
    def __init__(self, keys: _Optional[bytes] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace_id", "queries", "report_misses")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    REPORT_MISSES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    queries: _containers.RepeatedCompositeFieldContainer[KeyList]
    report_misses: bool
    def __init__(self, namespace_id: _Optional[str] = ..., queries: _Optional[_Iterable[_Union[KeyList, _Mapping]]] = ..., report_misses: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit_counts",)
    HIT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    hit_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hit_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveLoadRequest(_message.Message):
    __slots__ = ("namespace_id", "client_id", "keys", "count_lookup", "cache_salt")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    COUNT_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    client_id: int
    keys: bytes
    count_lookup: bool
    cache_salt: str
    def __init__(self, namespace_id: _Optional[str] = ..., client_id: _Optional[int] = ..., keys: _Optional[bytes] = ..., count_lookup: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ReserveLoadResponse(_message.Message):
    __slots__ = ("pin_id", "slots", "versions")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    pin_id: int
    slots: bytes
    versions: bytes
    def __init__(self, pin_id: _Optional[int] = ..., slots: _Optional[bytes] = ..., versions: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("namespace_id", "client_id", "pin_ids")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    client_id: int
    pin_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace_id: _Optional[str] = ..., client_id: _Optional[int] = ..., pin_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released_slots",)
    RELEASED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    released_slots: int
    def __init__(self, released_slots: _Optional[int] = ...) -> None: ...

class ReserveStoreRequest(_message.Message):
    __slots__ = ("namespace_id", "client_id", "keys", "announce", "cache_salts", "key_salts")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALTS_FIELD_NUMBER: _ClassVar[int]
    KEY_SALTS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    client_id: int
    keys: bytes
    announce: _containers.RepeatedScalarFieldContainer[bytes]
    cache_salts: _containers.RepeatedScalarFieldContainer[str]
    key_salts: bytes
    def __init__(self, namespace_id: _Optional[str] = ..., client_id: _Optional[int] = ..., keys: _Optional[bytes] = ..., announce: _Optional[_Iterable[bytes]] = ..., cache_salts: _Optional[_Iterable[str]] = ..., key_salts: _Optional[bytes] = ...) -> None: ...

class ReserveStoreResponse(_message.Message):
    __slots__ = ("store_id", "decisions", "slots")
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    store_id: int
    decisions: bytes
    slots: bytes
    def __init__(self, store_id: _Optional[int] = ..., decisions: _Optional[bytes] = ..., slots: _Optional[bytes] = ...) -> None: ...

class CommitStoreRequest(_message.Message):
    __slots__ = ("namespace_id", "store_id", "rank", "sidecar_epoch", "engine")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    store_id: int
    rank: int
    sidecar_epoch: int
    engine: int
    def __init__(self, namespace_id: _Optional[str] = ..., store_id: _Optional[int] = ..., rank: _Optional[int] = ..., sidecar_epoch: _Optional[int] = ..., engine: _Optional[int] = ...) -> None: ...

class CommitStoreResponse(_message.Message):
    __slots__ = ("visible",)
    VISIBLE_FIELD_NUMBER: _ClassVar[int]
    visible: bool
    def __init__(self, visible: _Optional[bool] = ...) -> None: ...

class AbortStoreRequest(_message.Message):
    __slots__ = ("namespace_id", "store_id", "sidecar_epoch", "engine")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    store_id: int
    sidecar_epoch: int
    engine: int
    def __init__(self, namespace_id: _Optional[str] = ..., store_id: _Optional[int] = ..., sidecar_epoch: _Optional[int] = ..., engine: _Optional[int] = ...) -> None: ...

class AbortStoreResponse(_message.Message):
    __slots__ = ("freed_slots",)
    FREED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    freed_slots: int
    def __init__(self, freed_slots: _Optional[int] = ...) -> None: ...

class DrainedRequest(_message.Message):
    __slots__ = ("namespace_id", "client_id", "sidecar_epoch", "engine", "rank")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    client_id: int
    sidecar_epoch: int
    engine: int
    rank: int
    def __init__(self, namespace_id: _Optional[str] = ..., client_id: _Optional[int] = ..., sidecar_epoch: _Optional[int] = ..., engine: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class DrainedResponse(_message.Message):
    __slots__ = ("freed_slots",)
    FREED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    freed_slots: int
    def __init__(self, freed_slots: _Optional[int] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("namespace_id", "log_id", "after_seq", "cursor", "max_events")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    MAX_EVENTS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    log_id: str
    after_seq: int
    cursor: int
    max_events: int
    def __init__(self, namespace_id: _Optional[str] = ..., log_id: _Optional[str] = ..., after_seq: _Optional[int] = ..., cursor: _Optional[int] = ..., max_events: _Optional[int] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("seq", "removed", "key", "announce")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    removed: bool
    key: bytes
    announce: bytes
    def __init__(self, seq: _Optional[int] = ..., removed: _Optional[bool] = ..., key: _Optional[bytes] = ..., announce: _Optional[bytes] = ...) -> None: ...

class EventsResponse(_message.Message):
    __slots__ = ("log_id", "seq", "snapshot", "events", "cursor", "first")
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    log_id: str
    seq: int
    snapshot: bool
    events: _containers.RepeatedCompositeFieldContainer[BlockEvent]
    cursor: int
    first: bool
    def __init__(self, log_id: _Optional[str] = ..., seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[BlockEvent, _Mapping]]] = ..., cursor: _Optional[int] = ..., first: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace_id", "spec", "num_ranks", "slot_bytes", "slot_count", "committed_slots", "reserved_slots", "pinned_slots", "live_clients", "capacity_bytes", "used_bytes", "pinned_bytes", "lookups", "hit_blocks", "miss_blocks", "stored_blocks", "loaded_blocks", "evicted_blocks", "stored_bytes", "loaded_bytes", "queried_blocks", "tenants", "refused_commits", "unlocked_reservations", "withheld_slots", "capacity_tokens", "used_tokens", "prefaulted_slots")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PINNED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LIVE_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUERIED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_COMMITS_FIELD_NUMBER: _ClassVar[int]
    UNLOCKED_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    WITHHELD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFAULTED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    spec: NamespaceSpec
    num_ranks: int
    slot_bytes: int
    slot_count: int
    committed_slots: int
    reserved_slots: int
    pinned_slots: int
    live_clients: int
    capacity_bytes: int
    used_bytes: int
    pinned_bytes: int
    lookups: int
    hit_blocks: int
    miss_blocks: int
    stored_blocks: int
    loaded_blocks: int
    evicted_blocks: int
    stored_bytes: int
    loaded_bytes: int
    queried_blocks: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    refused_commits: int
    unlocked_reservations: int
    withheld_slots: int
    capacity_tokens: int
    used_tokens: int
    prefaulted_slots: int
    def __init__(self, namespace_id: _Optional[str] = ..., spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., num_ranks: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., slot_count: _Optional[int] = ..., committed_slots: _Optional[int] = ..., reserved_slots: _Optional[int] = ..., pinned_slots: _Optional[int] = ..., live_clients: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., lookups: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., miss_blocks: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., loaded_blocks: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., loaded_bytes: _Optional[int] = ..., queried_blocks: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., refused_commits: _Optional[int] = ..., unlocked_reservations: _Optional[int] = ..., withheld_slots: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., used_tokens: _Optional[int] = ..., prefaulted_slots: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("name", "guaranteed_fraction", "max_fraction", "guaranteed_slots", "max_slots", "used_slots", "committed_slots", "used_bytes", "stored_blocks", "evicted_blocks", "lookups", "hit_blocks", "miss_blocks", "queried_blocks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    MAX_FRACTION_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUERIED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    guaranteed_fraction: float
    max_fraction: float
    guaranteed_slots: int
    max_slots: int
    used_slots: int
    committed_slots: int
    used_bytes: int
    stored_blocks: int
    evicted_blocks: int
    lookups: int
    hit_blocks: int
    miss_blocks: int
    queried_blocks: int
    def __init__(self, name: _Optional[str] = ..., guaranteed_fraction: _Optional[float] = ..., max_fraction: _Optional[float] = ..., guaranteed_slots: _Optional[int] = ..., max_slots: _Optional[int] = ..., used_slots: _Optional[int] = ..., committed_slots: _Optional[int] = ..., used_bytes: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., lookups: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., miss_blocks: _Optional[int] = ..., queried_blocks: _Optional[int] = ...) -> None: ...

class RpcLatency(_message.Message):
    __slots__ = ("method", "count", "p50_seconds", "p99_seconds")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    method: str
    count: int
    p50_seconds: float
    p99_seconds: float
    def __init__(self, method: _Optional[str] = ..., count: _Optional[int] = ..., p50_seconds: _Optional[float] = ..., p99_seconds: _Optional[float] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("pool_bytes", "prefaulted_bytes", "pool_ready", "eviction_policy", "pool_generation", "namespaces", "rpc_latency", "uptime_seconds", "version", "degraded_reason", "connector_status", "adoption", "placement", "shared")
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFAULTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_READY_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    RPC_LATENCY_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_REASON_FIELD_NUMBER: _ClassVar[int]
    CONNECTOR_STATUS_FIELD_NUMBER: _ClassVar[int]
    ADOPTION_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    pool_bytes: int
    prefaulted_bytes: int
    pool_ready: bool
    eviction_policy: str
    pool_generation: str
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    rpc_latency: _containers.RepeatedCompositeFieldContainer[RpcLatency]
    uptime_seconds: float
    version: str
    degraded_reason: str
    connector_status: str
    adoption: PoolAdoption
    placement: str
    shared: SharedPool
    def __init__(self, pool_bytes: _Optional[int] = ..., prefaulted_bytes: _Optional[int] = ..., pool_ready: _Optional[bool] = ..., eviction_policy: _Optional[str] = ..., pool_generation: _Optional[str] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., rpc_latency: _Optional[_Iterable[_Union[RpcLatency, _Mapping]]] = ..., uptime_seconds: _Optional[float] = ..., version: _Optional[str] = ..., degraded_reason: _Optional[str] = ..., connector_status: _Optional[str] = ..., adoption: _Optional[_Union[PoolAdoption, _Mapping]] = ..., placement: _Optional[str] = ..., shared: _Optional[_Union[SharedPool, _Mapping]] = ...) -> None: ...

class SharedPool(_message.Message):
    __slots__ = ("pool_id", "node_pool", "node", "tenant", "attached_pods", "active_pods", "capacity_bytes", "used_bytes", "live_clients")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_POOL_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_PODS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_PODS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIVE_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    node_pool: str
    node: str
    tenant: str
    attached_pods: int
    active_pods: int
    capacity_bytes: int
    used_bytes: int
    live_clients: int
    def __init__(self, pool_id: _Optional[str] = ..., node_pool: _Optional[str] = ..., node: _Optional[str] = ..., tenant: _Optional[str] = ..., attached_pods: _Optional[int] = ..., active_pods: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., live_clients: _Optional[int] = ...) -> None: ...

class PoolAdoption(_message.Message):
    __slots__ = ("outcome", "reason", "format_version", "adopted_blocks", "adopted_namespaces", "discarded_blocks", "adopt_seconds", "boots")
    class DiscardedBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADOPT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BOOTS_FIELD_NUMBER: _ClassVar[int]
    outcome: str
    reason: str
    format_version: int
    adopted_blocks: int
    adopted_namespaces: int
    discarded_blocks: _containers.ScalarMap[str, int]
    adopt_seconds: float
    boots: int
    def __init__(self, outcome: _Optional[str] = ..., reason: _Optional[str] = ..., format_version: _Optional[int] = ..., adopted_blocks: _Optional[int] = ..., adopted_namespaces: _Optional[int] = ..., discarded_blocks: _Optional[_Mapping[str, int]] = ..., adopt_seconds: _Optional[float] = ..., boots: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("seq", "lookup", "reserve_load", "release", "reserve_store", "commit_store", "abort_store", "attach", "drained")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    RESERVE_LOAD_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    RESERVE_STORE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_STORE_FIELD_NUMBER: _ClassVar[int]
    ABORT_STORE_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    lookup: LookupRequest
    reserve_load: ReserveLoadRequest
    release: ReleaseRequest
    reserve_store: ReserveStoreRequest
    commit_store: CommitStoreRequest
    abort_store: AbortStoreRequest
    attach: AttachRequest
    drained: DrainedRequest
    def __init__(self, seq: _Optional[int] = ..., lookup: _Optional[_Union[LookupRequest, _Mapping]] = ..., reserve_load: _Optional[_Union[ReserveLoadRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseRequest, _Mapping]] = ..., reserve_store: _Optional[_Union[ReserveStoreRequest, _Mapping]] = ..., commit_store: _Optional[_Union[CommitStoreRequest, _Mapping]] = ..., abort_store: _Optional[_Union[AbortStoreRequest, _Mapping]] = ..., attach: _Optional[_Union[AttachRequest, _Mapping]] = ..., drained: _Optional[_Union[DrainedRequest, _Mapping]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("client_id",)
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    def __init__(self, client_id: _Optional[int] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("seq", "lookup", "reserve_load", "release", "reserve_store", "commit_store", "abort_store", "attach", "drained", "error")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    RESERVE_LOAD_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    RESERVE_STORE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_STORE_FIELD_NUMBER: _ClassVar[int]
    ABORT_STORE_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq: int
    lookup: LookupResponse
    reserve_load: ReserveLoadResponse
    release: ReleaseResponse
    reserve_store: ReserveStoreResponse
    commit_store: CommitStoreResponse
    abort_store: AbortStoreResponse
    attach: AttachResponse
    drained: DrainedResponse
    error: SessionError
    def __init__(self, seq: _Optional[int] = ..., lookup: _Optional[_Union[LookupResponse, _Mapping]] = ..., reserve_load: _Optional[_Union[ReserveLoadResponse, _Mapping]] = ..., release: _Optional[_Union[ReleaseResponse, _Mapping]] = ..., reserve_store: _Optional[_Union[ReserveStoreResponse, _Mapping]] = ..., commit_store: _Optional[_Union[CommitStoreResponse, _Mapping]] = ..., abort_store: _Optional[_Union[AbortStoreResponse, _Mapping]] = ..., attach: _Optional[_Union[AttachResponse, _Mapping]] = ..., drained: _Optional[_Union[DrainedResponse, _Mapping]] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ...) -> None: ...
