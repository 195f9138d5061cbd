from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Decision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECISION_UNSPECIFIED: _ClassVar[Decision]
    HIT: _ClassVar[Decision]
    COMPILE: _ClassVar[Decision]
    WAIT: _ClassVar[Decision]
    COMPILE_LOCALLY: _ClassVar[Decision]

class LocalCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOCAL_CAUSE_UNSPECIFIED: _ClassVar[LocalCause]
    LOCAL_CAUSE_BELOW_THRESHOLD: _ClassVar[LocalCause]

class ReleaseReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELEASE_REASON_UNSPECIFIED: _ClassVar[ReleaseReason]
    COMPILE_FAILED: _ClassVar[ReleaseReason]
    BELOW_THRESHOLD: _ClassVar[ReleaseReason]
    ABANDONED: _ClassVar[ReleaseReason]
    PUBLISH_REFUSED: _ClassVar[ReleaseReason]

class TaskState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATE_UNSPECIFIED: _ClassVar[TaskState]
    QUEUED: _ClassVar[TaskState]
    RUNNING: _ClassVar[TaskState]
    DONE: _ClassVar[TaskState]
    FAILED: _ClassVar[TaskState]
DECISION_UNSPECIFIED: Decision
HIT: Decision
COMPILE: Decision
WAIT: Decision
COMPILE_LOCALLY: Decision
LOCAL_CAUSE_UNSPECIFIED: LocalCause
LOCAL_CAUSE_BELOW_THRESHOLD: LocalCause
RELEASE_REASON_UNSPECIFIED: ReleaseReason
COMPILE_FAILED: ReleaseReason
BELOW_THRESHOLD: ReleaseReason
ABANDONED: ReleaseReason
PUBLISH_REFUSED: ReleaseReason
TASK_STATE_UNSPECIFIED: TaskState
QUEUED: TaskState
RUNNING: TaskState
DONE: TaskState
FAILED: TaskState

class Requester(_message.Message):
    __slots__ = ("job", "process_id", "designated_process", "client")
    JOB_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    DESIGNATED_PROCESS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    job: str
    process_id: int
    designated_process: int
    client: str
    def __init__(self, job: _Optional[str] = ..., process_id: _Optional[int] = ..., designated_process: _Optional[int] = ..., client: _Optional[str] = ...) -> None: ...

class ArtifactInfo(_message.Message):
    __slots__ = ("key", "digest", "size", "compile_time_seconds", "created_unix", "recipe_digest")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPILE_TIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    RECIPE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    key: str
    digest: str
    size: int
    compile_time_seconds: float
    created_unix: float
    recipe_digest: str
    def __init__(self, key: _Optional[str] = ..., digest: _Optional[str] = ..., size: _Optional[int] = ..., compile_time_seconds: _Optional[float] = ..., created_unix: _Optional[float] = ..., recipe_digest: _Optional[str] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("id", "ttl_seconds", "revision", "takes_digest_last")
    ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TAKES_DIGEST_LAST_FIELD_NUMBER: _ClassVar[int]
    id: int
    ttl_seconds: int
    revision: int
    takes_digest_last: bool
    def __init__(self, id: _Optional[int] = ..., ttl_seconds: _Optional[int] = ..., revision: _Optional[int] = ..., takes_digest_last: _Optional[bool] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("key", "requester", "key_components", "program_name", "key_seconds", "trace_context")
    class KeyComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    KEY_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    key: str
    requester: Requester
    key_components: _containers.ScalarMap[str, str]
    program_name: str
    key_seconds: float
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, key: _Optional[str] = ..., requester: _Optional[_Union[Requester, _Mapping]] = ..., key_components: _Optional[_Mapping[str, str]] = ..., program_name: _Optional[str] = ..., key_seconds: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("decision", "artifact", "lease", "reason", "local_cause")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CAUSE_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    artifact: ArtifactInfo
    lease: Lease
    reason: str
    local_cause: LocalCause
    def __init__(self, decision: _Optional[_Union[Decision, str]] = ..., artifact: _Optional[_Union[ArtifactInfo, _Mapping]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., reason: _Optional[str] = ..., local_cause: _Optional[_Union[LocalCause, str]] = ...) -> None: ...

class AcquireManyRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[AcquireRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[AcquireRequest, _Mapping]]] = ...) -> None: ...

class AcquireManyResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[AcquireResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[AcquireResponse, _Mapping]]] = ...) -> None: ...

class DecideRequest(_message.Message):
    __slots__ = ("id", "requests", "wait", "until_publishing", "cancel", "answer_in_parts", "takes_bundles")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    UNTIL_PUBLISHING_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    ANSWER_IN_PARTS_FIELD_NUMBER: _ClassVar[int]
    TAKES_BUNDLES_FIELD_NUMBER: _ClassVar[int]
    id: int
    requests: _containers.RepeatedCompositeFieldContainer[AcquireRequest]
    wait: WaitRequest
    until_publishing: bool
    cancel: _containers.RepeatedScalarFieldContainer[int]
    answer_in_parts: bool
    takes_bundles: bool
    def __init__(self, id: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[AcquireRequest, _Mapping]]] = ..., wait: _Optional[_Union[WaitRequest, _Mapping]] = ..., until_publishing: _Optional[bool] = ..., cancel: _Optional[_Iterable[int]] = ..., answer_in_parts: _Optional[bool] = ..., takes_bundles: _Optional[bool] = ...) -> None: ...

class DecideResponse(_message.Message):
    __slots__ = ("id", "responses", "error_code", "error_message", "event", "positions", "more", "gap_ms")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    GAP_MS_FIELD_NUMBER: _ClassVar[int]
    id: int
    responses: _containers.RepeatedCompositeFieldContainer[AcquireResponse]
    error_code: int
    error_message: str
    event: WaitEvent
    positions: _containers.RepeatedScalarFieldContainer[int]
    more: _containers.RepeatedCompositeFieldContainer[DecideResponse]
    gap_ms: int
    def __init__(self, id: _Optional[int] = ..., responses: _Optional[_Iterable[_Union[AcquireResponse, _Mapping]]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., event: _Optional[_Union[WaitEvent, _Mapping]] = ..., positions: _Optional[_Iterable[int]] = ..., more: _Optional[_Iterable[_Union[DecideResponse, _Mapping]]] = ..., gap_ms: _Optional[int] = ...) -> None: ...

class WaitRequest(_message.Message):
    __slots__ = ("key", "requester", "timeout_ms", "accept_data_wait", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_DATA_WAIT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    key: str
    requester: Requester
    timeout_ms: int
    accept_data_wait: bool
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, key: _Optional[str] = ..., requester: _Optional[_Union[Requester, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., accept_data_wait: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class WaitEvent(_message.Message):
    __slots__ = ("decision", "artifact", "lease", "reason", "local_cause", "data_ticket", "data_follows")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CAUSE_FIELD_NUMBER: _ClassVar[int]
    DATA_TICKET_FIELD_NUMBER: _ClassVar[int]
    DATA_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    artifact: ArtifactInfo
    lease: Lease
    reason: str
    local_cause: LocalCause
    data_ticket: DataTicket
    data_follows: bool
    def __init__(self, decision: _Optional[_Union[Decision, str]] = ..., artifact: _Optional[_Union[ArtifactInfo, _Mapping]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., reason: _Optional[str] = ..., local_cause: _Optional[_Union[LocalCause, str]] = ..., data_ticket: _Optional[_Union[DataTicket, _Mapping]] = ..., data_follows: _Optional[bool] = ...) -> None: ...

class PublishHeader(_message.Message):
    __slots__ = ("key", "lease", "digest", "size", "compile_time_seconds", "requester", "recipe")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPILE_TIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    key: str
    lease: Lease
    digest: str
    size: int
    compile_time_seconds: float
    requester: Requester
    recipe: Recipe
    def __init__(self, key: _Optional[str] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., digest: _Optional[str] = ..., size: _Optional[int] = ..., compile_time_seconds: _Optional[float] = ..., requester: _Optional[_Union[Requester, _Mapping]] = ..., recipe: _Optional[_Union[Recipe, _Mapping]] = ...) -> None: ...

class PublishChunk(_message.Message):
    __slots__ = ("header", "data", "zstd_data", "digest")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ZSTD_DATA_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    header: PublishHeader
    data: bytes
    zstd_data: bytes
    digest: str
    def __init__(self, header: _Optional[_Union[PublishHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., zstd_data: _Optional[bytes] = ..., digest: _Optional[str] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("artifact",)
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    artifact: ArtifactInfo
    def __init__(self, artifact: _Optional[_Union[ArtifactInfo, _Mapping]] = ...) -> None: ...

class OpenUploadRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: PublishHeader
    def __init__(self, header: _Optional[_Union[PublishHeader, _Mapping]] = ...) -> None: ...

class OpenUploadResponse(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: DataTicket
    def __init__(self, ticket: _Optional[_Union[DataTicket, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("key", "lease", "reason", "detail")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    key: str
    lease: Lease
    reason: ReleaseReason
    detail: str
    def __init__(self, key: _Optional[str] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., reason: _Optional[_Union[ReleaseReason, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("key", "digest", "relay_address", "offset", "accept_zstd", "accept_local_file", "accept_data_ticket", "accept_growing_file", "accept_url")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    RELAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_ZSTD_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LOCAL_FILE_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_DATA_TICKET_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_GROWING_FILE_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_URL_FIELD_NUMBER: _ClassVar[int]
    key: str
    digest: str
    relay_address: str
    offset: int
    accept_zstd: bool
    accept_local_file: bool
    accept_data_ticket: bool
    accept_growing_file: bool
    accept_url: bool
    def __init__(self, key: _Optional[str] = ..., digest: _Optional[str] = ..., relay_address: _Optional[str] = ..., offset: _Optional[int] = ..., accept_zstd: _Optional[bool] = ..., accept_local_file: _Optional[bool] = ..., accept_data_ticket: _Optional[bool] = ..., accept_growing_file: _Optional[bool] = ..., accept_url: _Optional[bool] = ...) -> None: ...

class DataTicket(_message.Message):
    __slots__ = ("address", "token")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    address: str
    token: bytes
    def __init__(self, address: _Optional[str] = ..., token: _Optional[bytes] = ...) -> None: ...

class FetchChunk(_message.Message):
    __slots__ = ("artifact", "data", "relay_from", "zstd_data", "local_path", "data_ticket", "local_growing", "local_available", "url")
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    RELAY_FROM_FIELD_NUMBER: _ClassVar[int]
    ZSTD_DATA_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_TICKET_FIELD_NUMBER: _ClassVar[int]
    LOCAL_GROWING_FIELD_NUMBER: _ClassVar[int]
    LOCAL_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    artifact: ArtifactInfo
    data: bytes
    relay_from: str
    zstd_data: bytes
    local_path: str
    data_ticket: DataTicket
    local_growing: bool
    local_available: int
    url: str
    def __init__(self, artifact: _Optional[_Union[ArtifactInfo, _Mapping]] = ..., data: _Optional[bytes] = ..., relay_from: _Optional[str] = ..., zstd_data: _Optional[bytes] = ..., local_path: _Optional[str] = ..., data_ticket: _Optional[_Union[DataTicket, _Mapping]] = ..., local_growing: _Optional[bool] = ..., local_available: _Optional[int] = ..., url: _Optional[str] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("key", "lease")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    key: str
    lease: Lease
    def __init__(self, key: _Optional[str] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("ttl_seconds",)
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: int
    def __init__(self, ttl_seconds: _Optional[int] = ...) -> None: ...

class DescribeKeyRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class DescribeKeyResponse(_message.Message):
    __slots__ = ("key", "program_name", "key_components", "first_seen_unix", "artifact")
    class KeyComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    key: str
    program_name: str
    key_components: _containers.ScalarMap[str, str]
    first_seen_unix: float
    artifact: ArtifactInfo
    def __init__(self, key: _Optional[str] = ..., program_name: _Optional[str] = ..., key_components: _Optional[_Mapping[str, str]] = ..., first_seen_unix: _Optional[float] = ..., artifact: _Optional[_Union[ArtifactInfo, _Mapping]] = ...) -> None: ...

class ListArtifactsRequest(_message.Message):
    __slots__ = ("after", "limit", "prefix")
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    after: str
    limit: int
    prefix: str
    def __init__(self, after: _Optional[str] = ..., limit: _Optional[int] = ..., prefix: _Optional[str] = ...) -> None: ...

class ListedArtifact(_message.Message):
    __slots__ = ("artifact", "program_name")
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_NAME_FIELD_NUMBER: _ClassVar[int]
    artifact: ArtifactInfo
    program_name: str
    def __init__(self, artifact: _Optional[_Union[ArtifactInfo, _Mapping]] = ..., program_name: _Optional[str] = ...) -> None: ...

class ListArtifactsResponse(_message.Message):
    __slots__ = ("artifacts", "next_after")
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    artifacts: _containers.RepeatedCompositeFieldContainer[ListedArtifact]
    next_after: str
    def __init__(self, artifacts: _Optional[_Iterable[_Union[ListedArtifact, _Mapping]]] = ..., next_after: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InFlight(_message.Message):
    __slots__ = ("key", "holder", "age_seconds", "waiters")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAITERS_FIELD_NUMBER: _ClassVar[int]
    key: str
    holder: str
    age_seconds: float
    waiters: int
    def __init__(self, key: _Optional[str] = ..., holder: _Optional[str] = ..., age_seconds: _Optional[float] = ..., waiters: _Optional[int] = ...) -> None: ...

class RecentMiss(_message.Message):
    __slots__ = ("key", "program_name", "differing", "age_seconds")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_NAME_FIELD_NUMBER: _ClassVar[int]
    DIFFERING_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    key: str
    program_name: str
    differing: _containers.RepeatedScalarFieldContainer[str]
    age_seconds: float
    def __init__(self, key: _Optional[str] = ..., program_name: _Optional[str] = ..., differing: _Optional[_Iterable[str]] = ..., age_seconds: _Optional[float] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job", "compiles_in_flight", "waiters")
    JOB_FIELD_NUMBER: _ClassVar[int]
    COMPILES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    WAITERS_FIELD_NUMBER: _ClassVar[int]
    job: str
    compiles_in_flight: int
    waiters: int
    def __init__(self, job: _Optional[str] = ..., compiles_in_flight: _Optional[int] = ..., waiters: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("role", "artifacts", "compiles_in_flight", "waiters", "hits", "misses", "compile_seconds_saved", "in_flight", "upstream_healthy", "upstream", "recent_misses", "jobs", "tasks_queued", "tasks_running", "tasks_done", "tasks_failed", "waiting_here", "store_bytes", "store_max_bytes", "revoked", "upstream_problem", "host_cache_bytes", "host_cache_max_bytes", "host_disk_free_bytes", "host_cache_min_free_bytes", "host_uncached", "coordinator_loop_busy", "decide_gap_ms", "etcd_writes_sampled", "etcd_write_p50_ms", "etcd_write_p99_ms", "store", "bucket_errors", "bucket_local_hits", "bucket_local_misses", "directories", "pjrt_compiles")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    COMPILES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    WAITERS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_SAVED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_FIELD_NUMBER: _ClassVar[int]
    RECENT_MISSES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    TASKS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    TASKS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    TASKS_DONE_FIELD_NUMBER: _ClassVar[int]
    TASKS_FAILED_FIELD_NUMBER: _ClassVar[int]
    WAITING_HERE_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_PROBLEM_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHE_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_DISK_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHE_MIN_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_UNCACHED_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_LOOP_BUSY_FIELD_NUMBER: _ClassVar[int]
    DECIDE_GAP_MS_FIELD_NUMBER: _ClassVar[int]
    ETCD_WRITES_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    ETCD_WRITE_P50_MS_FIELD_NUMBER: _ClassVar[int]
    ETCD_WRITE_P99_MS_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_ERRORS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_LOCAL_HITS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_LOCAL_MISSES_FIELD_NUMBER: _ClassVar[int]
    DIRECTORIES_FIELD_NUMBER: _ClassVar[int]
    PJRT_COMPILES_FIELD_NUMBER: _ClassVar[int]
    role: str
    artifacts: int
    compiles_in_flight: int
    waiters: int
    hits: int
    misses: int
    compile_seconds_saved: float
    in_flight: _containers.RepeatedCompositeFieldContainer[InFlight]
    upstream_healthy: bool
    upstream: str
    recent_misses: _containers.RepeatedCompositeFieldContainer[RecentMiss]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    tasks_queued: int
    tasks_running: int
    tasks_done: int
    tasks_failed: int
    waiting_here: int
    store_bytes: int
    store_max_bytes: int
    revoked: int
    upstream_problem: str
    host_cache_bytes: int
    host_cache_max_bytes: int
    host_disk_free_bytes: int
    host_cache_min_free_bytes: int
    host_uncached: int
    coordinator_loop_busy: float
    decide_gap_ms: int
    etcd_writes_sampled: int
    etcd_write_p50_ms: float
    etcd_write_p99_ms: float
    store: str
    bucket_errors: int
    bucket_local_hits: int
    bucket_local_misses: int
    directories: _containers.RepeatedCompositeFieldContainer[SyncedDirectory]
    pjrt_compiles: _containers.RepeatedCompositeFieldContainer[PjrtCompiles]
    def __init__(self, role: _Optional[str] = ..., artifacts: _Optional[int] = ..., compiles_in_flight: _Optional[int] = ..., waiters: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., compile_seconds_saved: _Optional[float] = ..., in_flight: _Optional[_Iterable[_Union[InFlight, _Mapping]]] = ..., upstream_healthy: _Optional[bool] = ..., upstream: _Optional[str] = ..., recent_misses: _Optional[_Iterable[_Union[RecentMiss, _Mapping]]] = ..., jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ..., tasks_queued: _Optional[int] = ..., tasks_running: _Optional[int] = ..., tasks_done: _Optional[int] = ..., tasks_failed: _Optional[int] = ..., waiting_here: _Optional[int] = ..., store_bytes: _Optional[int] = ..., store_max_bytes: _Optional[int] = ..., revoked: _Optional[int] = ..., upstream_problem: _Optional[str] = ..., host_cache_bytes: _Optional[int] = ..., host_cache_max_bytes: _Optional[int] = ..., host_disk_free_bytes: _Optional[int] = ..., host_cache_min_free_bytes: _Optional[int] = ..., host_uncached: _Optional[int] = ..., coordinator_loop_busy: _Optional[float] = ..., decide_gap_ms: _Optional[int] = ..., etcd_writes_sampled: _Optional[int] = ..., etcd_write_p50_ms: _Optional[float] = ..., etcd_write_p99_ms: _Optional[float] = ..., store: _Optional[str] = ..., bucket_errors: _Optional[int] = ..., bucket_local_hits: _Optional[int] = ..., bucket_local_misses: _Optional[int] = ..., directories: _Optional[_Iterable[_Union[SyncedDirectory, _Mapping]]] = ..., pjrt_compiles: _Optional[_Iterable[_Union[PjrtCompiles, _Mapping]]] = ...) -> None: ...

class PjrtCompiles(_message.Message):
    __slots__ = ("platform", "hits", "compiles", "local", "failed")
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    COMPILES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    platform: str
    hits: int
    compiles: int
    local: int
    failed: int
    def __init__(self, platform: _Optional[str] = ..., hits: _Optional[int] = ..., compiles: _Optional[int] = ..., local: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class SyncedDirectory(_message.Message):
    __slots__ = ("kind", "namespace_id", "namespace", "path", "entries", "bytes", "published", "installed", "refused", "publish_off", "install_off")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    INSTALLED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_OFF_FIELD_NUMBER: _ClassVar[int]
    INSTALL_OFF_FIELD_NUMBER: _ClassVar[int]
    kind: str
    namespace_id: str
    namespace: str
    path: str
    entries: int
    bytes: int
    published: int
    installed: int
    refused: int
    publish_off: str
    install_off: str
    def __init__(self, kind: _Optional[str] = ..., namespace_id: _Optional[str] = ..., namespace: _Optional[str] = ..., path: _Optional[str] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., published: _Optional[int] = ..., installed: _Optional[int] = ..., refused: _Optional[int] = ..., publish_off: _Optional[str] = ..., install_off: _Optional[str] = ...) -> None: ...

class Target(_message.Message):
    __slots__ = ("platform", "topology", "platform_version", "jaxlib_version", "libtpu_version")
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_VERSION_FIELD_NUMBER: _ClassVar[int]
    JAXLIB_VERSION_FIELD_NUMBER: _ClassVar[int]
    LIBTPU_VERSION_FIELD_NUMBER: _ClassVar[int]
    platform: str
    topology: str
    platform_version: str
    jaxlib_version: str
    libtpu_version: str
    def __init__(self, platform: _Optional[str] = ..., topology: _Optional[str] = ..., platform_version: _Optional[str] = ..., jaxlib_version: _Optional[str] = ..., libtpu_version: _Optional[str] = ...) -> None: ...

class Recipe(_message.Message):
    __slots__ = ("key", "program_name", "job", "entry", "entry_index", "program", "compile_options", "device_ids", "device_shape", "xla_flags", "target", "created_unix", "slice_devices")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_NAME_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    ENTRY_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    COMPILE_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    XLA_FLAGS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    SLICE_DEVICES_FIELD_NUMBER: _ClassVar[int]
    key: str
    program_name: str
    job: str
    entry: str
    entry_index: int
    program: bytes
    compile_options: bytes
    device_ids: _containers.RepeatedScalarFieldContainer[int]
    device_shape: _containers.RepeatedScalarFieldContainer[int]
    xla_flags: _containers.RepeatedScalarFieldContainer[str]
    target: Target
    created_unix: float
    slice_devices: int
    def __init__(self, key: _Optional[str] = ..., program_name: _Optional[str] = ..., job: _Optional[str] = ..., entry: _Optional[str] = ..., entry_index: _Optional[int] = ..., program: _Optional[bytes] = ..., compile_options: _Optional[bytes] = ..., device_ids: _Optional[_Iterable[int]] = ..., device_shape: _Optional[_Iterable[int]] = ..., xla_flags: _Optional[_Iterable[str]] = ..., target: _Optional[_Union[Target, _Mapping]] = ..., created_unix: _Optional[float] = ..., slice_devices: _Optional[int] = ...) -> None: ...

class ListRecipesRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class SubmitCompilesRequest(_message.Message):
    __slots__ = ("recipes", "replay_job", "target")
    RECIPES_FIELD_NUMBER: _ClassVar[int]
    REPLAY_JOB_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    recipes: _containers.RepeatedCompositeFieldContainer[Recipe]
    replay_job: str
    target: Target
    def __init__(self, recipes: _Optional[_Iterable[_Union[Recipe, _Mapping]]] = ..., replay_job: _Optional[str] = ..., target: _Optional[_Union[Target, _Mapping]] = ...) -> None: ...

class SubmitCompilesResponse(_message.Message):
    __slots__ = ("task_ids",)
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ClaimCompileRequest(_message.Message):
    __slots__ = ("worker", "wait_ms")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    wait_ms: int
    def __init__(self, worker: _Optional[str] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class ClaimCompileResponse(_message.Message):
    __slots__ = ("task_id", "recipe", "claim")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    recipe: Recipe
    claim: Lease
    def __init__(self, task_id: _Optional[str] = ..., recipe: _Optional[_Union[Recipe, _Mapping]] = ..., claim: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class RenewClaimRequest(_message.Message):
    __slots__ = ("task_id", "claim")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    claim: Lease
    def __init__(self, task_id: _Optional[str] = ..., claim: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class FinishCompileRequest(_message.Message):
    __slots__ = ("task_id", "claim", "ok", "detail", "key")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    claim: Lease
    ok: bool
    detail: str
    key: str
    def __init__(self, task_id: _Optional[str] = ..., claim: _Optional[_Union[Lease, _Mapping]] = ..., ok: _Optional[bool] = ..., detail: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class FinishCompileResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TaskStatus(_message.Message):
    __slots__ = ("task_id", "state", "program_name", "target", "worker", "detail", "key", "age_seconds")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    state: TaskState
    program_name: str
    target: str
    worker: str
    detail: str
    key: str
    age_seconds: float
    def __init__(self, task_id: _Optional[str] = ..., state: _Optional[_Union[TaskState, str]] = ..., program_name: _Optional[str] = ..., target: _Optional[str] = ..., worker: _Optional[str] = ..., detail: _Optional[str] = ..., key: _Optional[str] = ..., age_seconds: _Optional[float] = ...) -> None: ...

class TasksRequest(_message.Message):
    __slots__ = ("task_ids",)
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class TasksResponse(_message.Message):
    __slots__ = ("tasks",)
    TASKS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[TaskStatus]
    def __init__(self, tasks: _Optional[_Iterable[_Union[TaskStatus, _Mapping]]] = ...) -> None: ...

class PurgeRequest(_message.Message):
    __slots__ = ("keys", "digests", "reason", "dry_run")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    digests: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    dry_run: bool
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., digests: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class PurgeResponse(_message.Message):
    __slots__ = ("purged", "missing", "revoked", "tenant")
    PURGED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    purged: _containers.RepeatedScalarFieldContainer[str]
    missing: _containers.RepeatedScalarFieldContainer[str]
    revoked: _containers.RepeatedScalarFieldContainer[str]
    tenant: str
    def __init__(self, purged: _Optional[_Iterable[str]] = ..., missing: _Optional[_Iterable[str]] = ..., revoked: _Optional[_Iterable[str]] = ..., tenant: _Optional[str] = ...) -> None: ...

class Revocation(_message.Message):
    __slots__ = ("digest", "reason", "revoked_unix", "keys")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REVOKED_UNIX_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    digest: str
    reason: str
    revoked_unix: float
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, digest: _Optional[str] = ..., reason: _Optional[str] = ..., revoked_unix: _Optional[float] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class RevokedRequest(_message.Message):
    __slots__ = ("since_revision",)
    SINCE_REVISION_FIELD_NUMBER: _ClassVar[int]
    since_revision: int
    def __init__(self, since_revision: _Optional[int] = ...) -> None: ...

class RevokedResponse(_message.Message):
    __slots__ = ("revocations", "revision", "tenant")
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    revocations: _containers.RepeatedCompositeFieldContainer[Revocation]
    revision: int
    tenant: str
    def __init__(self, revocations: _Optional[_Iterable[_Union[Revocation, _Mapping]]] = ..., revision: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class ReportHitsRequest(_message.Message):
    __slots__ = ("hits", "compile_seconds_saved")
    HITS_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_SAVED_FIELD_NUMBER: _ClassVar[int]
    hits: int
    compile_seconds_saved: float
    def __init__(self, hits: _Optional[int] = ..., compile_seconds_saved: _Optional[float] = ...) -> None: ...

class ReportHitsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenDirectoryRequest(_message.Message):
    __slots__ = ("kind", "namespace", "publish_off", "install_off")
    class NamespaceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_OFF_FIELD_NUMBER: _ClassVar[int]
    INSTALL_OFF_FIELD_NUMBER: _ClassVar[int]
    kind: str
    namespace: _containers.ScalarMap[str, str]
    publish_off: str
    install_off: str
    def __init__(self, kind: _Optional[str] = ..., namespace: _Optional[_Mapping[str, str]] = ..., publish_off: _Optional[str] = ..., install_off: _Optional[str] = ...) -> None: ...

class OpenDirectoryResponse(_message.Message):
    __slots__ = ("directory",)
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    directory: SyncedDirectory
    def __init__(self, directory: _Optional[_Union[SyncedDirectory, _Mapping]] = ...) -> None: ...

class SyncDirectoryRequest(_message.Message):
    __slots__ = ("kind", "namespace_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    kind: str
    namespace_id: str
    def __init__(self, kind: _Optional[str] = ..., namespace_id: _Optional[str] = ...) -> None: ...

class SyncDirectoryResponse(_message.Message):
    __slots__ = ("published", "installed", "directory")
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    INSTALLED_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    published: int
    installed: int
    directory: SyncedDirectory
    def __init__(self, published: _Optional[int] = ..., installed: _Optional[int] = ..., directory: _Optional[_Union[SyncedDirectory, _Mapping]] = ...) -> None: ...
