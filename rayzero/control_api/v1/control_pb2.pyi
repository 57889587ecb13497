from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStatusRequest(_message.Message):
    __slots__ = ("interval_s",)
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    interval_s: float
    def __init__(self, interval_s: _Optional[float] = ...) -> None: ...

class CheckpointNowRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: Checkpoint
    def __init__(self, checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: int
    def __init__(self, workers: _Optional[int] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KillRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class KillResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("tier", "location", "step", "time")
    TIER_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    tier: str
    location: str
    step: int
    time: float
    def __init__(self, tier: _Optional[str] = ..., location: _Optional[str] = ..., step: _Optional[int] = ..., time: _Optional[float] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "node_id", "heartbeat_age_s", "step", "micro_step", "memory_bytes", "host_memory_bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_STEP_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node_id: str
    heartbeat_age_s: float
    step: int
    micro_step: int
    memory_bytes: int
    host_memory_bytes: int
    def __init__(self, rank: _Optional[int] = ..., node_id: _Optional[str] = ..., heartbeat_age_s: _Optional[float] = ..., step: _Optional[int] = ..., micro_step: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., host_memory_bytes: _Optional[int] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("run_name", "state", "attempt", "world_size", "min_workers", "max_workers", "started_at", "step", "loss", "samples_per_s", "tokens_per_s", "last_report_time", "checkpoints", "failures", "max_failures", "ranks", "message", "extra", "goodput", "wall_s", "badput_s")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class BadputSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_TIME_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    MAX_FAILURES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    BADPUT_S_FIELD_NUMBER: _ClassVar[int]
    run_name: str
    state: str
    attempt: int
    world_size: int
    min_workers: int
    max_workers: int
    started_at: float
    step: int
    loss: float
    samples_per_s: float
    tokens_per_s: float
    last_report_time: float
    checkpoints: _containers.RepeatedCompositeFieldContainer[Checkpoint]
    failures: int
    max_failures: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    message: str
    extra: _containers.ScalarMap[str, str]
    goodput: float
    wall_s: float
    badput_s: _containers.ScalarMap[str, float]
    def __init__(self, run_name: _Optional[str] = ..., state: _Optional[str] = ..., attempt: _Optional[int] = ..., world_size: _Optional[int] = ..., min_workers: _Optional[int] = ..., max_workers: _Optional[int] = ..., started_at: _Optional[float] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., samples_per_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., last_report_time: _Optional[float] = ..., checkpoints: _Optional[_Iterable[_Union[Checkpoint, _Mapping]]] = ..., failures: _Optional[int] = ..., max_failures: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., message: _Optional[str] = ..., extra: _Optional[_Mapping[str, str]] = ..., goodput: _Optional[float] = ..., wall_s: _Optional[float] = ..., badput_s: _Optional[_Mapping[str, float]] = ...) -> None: ...
