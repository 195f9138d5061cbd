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

class ReleaseReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELEASE_REASON_UNSPECIFIED: _ClassVar[ReleaseReason]
    COMPILE_FAILED: _ClassVar[ReleaseReason]
    BELOW_THRESHOLD: _ClassVar[ReleaseReason]
    ABANDONED: _ClassVar[ReleaseReason]
DECISION_UNSPECIFIED: Decision
HIT: Decision
COMPILE: Decision
WAIT: Decision
COMPILE_LOCALLY: Decision
RELEASE_REASON_UNSPECIFIED: ReleaseReason
COMPILE_FAILED: ReleaseReason
BELOW_THRESHOLD: ReleaseReason
ABANDONED: ReleaseReason

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
    __slots__ = ("key", "digest", "size", "compile_time_seconds", "created_unix")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPILE_TIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    key: str
    digest: str
    size: int
    compile_time_seconds: float
    created_unix: float
    def __init__(self, key: _Optional[str] = ..., digest: _Optional[str] = ..., size: _Optional[int] = ..., compile_time_seconds: _Optional[float] = ..., created_unix: _Optional[float] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("id", "ttl_seconds", "revision")
    ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    id: int
    ttl_seconds: int
    revision: int
    def __init__(self, id: _Optional[int] = ..., ttl_seconds: _Optional[int] = ..., revision: _Optional[int] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("key", "requester", "key_components", "program_name", "key_seconds")
    class KeyComponentsEntry(_message.Message):
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
    key: str
    requester: Requester
    key_components: _containers.ScalarMap[str, str]
    program_name: str
    key_seconds: float
    def __init__(self, key: _Optional[str] = ..., requester: _Optional[_Union[Requester, _Mapping]] = ..., key_components: _Optional[_Mapping[str, str]] = ..., program_name: _Optional[str] = ..., key_seconds: _Optional[float] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("decision", "artifact", "lease", "reason")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    artifact: ArtifactInfo
    lease: Lease
    reason: str
    def __init__(self, decision: _Optional[_Union[Decision, str]] = ..., artifact: _Optional[_Union[ArtifactInfo, _Mapping]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

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

class WaitRequest(_message.Message):
    __slots__ = ("key", "requester", "timeout_ms")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    key: str
    requester: Requester
    timeout_ms: int
    def __init__(self, key: _Optional[str] = ..., requester: _Optional[_Union[Requester, _Mapping]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class WaitEvent(_message.Message):
    __slots__ = ("decision", "artifact", "lease", "reason")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    artifact: ArtifactInfo
    lease: Lease
    reason: str
    def __init__(self, decision: _Optional[_Union[Decision, str]] = ..., artifact: _Optional[_Union[ArtifactInfo, _Mapping]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class PublishHeader(_message.Message):
    __slots__ = ("key", "lease", "digest", "size", "compile_time_seconds", "requester")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPILE_TIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    key: str
    lease: Lease
    digest: str
    size: int
    compile_time_seconds: float
    requester: Requester
    def __init__(self, key: _Optional[str] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., digest: _Optional[str] = ..., size: _Optional[int] = ..., compile_time_seconds: _Optional[float] = ..., requester: _Optional[_Union[Requester, _Mapping]] = ...) -> None: ...

class PublishChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PublishHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PublishHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("artifact",)
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    artifact: ArtifactInfo
    def __init__(self, artifact: _Optional[_Union[ArtifactInfo, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("key", "digest")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    key: str
    digest: str
    def __init__(self, key: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class FetchChunk(_message.Message):
    __slots__ = ("artifact", "data")
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    artifact: ArtifactInfo
    data: bytes
    def __init__(self, artifact: _Optional[_Union[ArtifactInfo, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

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
    __slots__ = ("role", "artifacts", "compiles_in_flight", "waiters", "hits", "misses", "compile_seconds_saved", "in_flight", "upstream_healthy", "upstream", "recent_misses", "jobs")
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
    def __init__(self, role: _Optional[str] = ..., artifacts: _Optional[int] = ..., compiles_in_flight: _Optional[int] = ..., waiters: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., compile_seconds_saved: _Optional[float] = ..., in_flight: _Optional[_Iterable[_Union[InFlight, _Mapping]]] = ..., upstream_healthy: _Optional[bool] = ..., upstream: _Optional[str] = ..., recent_misses: _Optional[_Iterable[_Union[RecentMiss, _Mapping]]] = ..., jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ...) -> None: ...
