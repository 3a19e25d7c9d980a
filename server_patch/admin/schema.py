"""The types of every ``/admin`` answer: built by the server (``admin.views``), parsed by the client.

One frozen dataclass per answer (and per nested object; keyword-only, so the fields keep the
server's key order whether or not they have defaults), so a renamed or missing field is an
error where the answer is parsed (``SchemaError`` naming the answer and the field), never a
``KeyError`` deep in the CLI or the dashboard. ``to_json()`` gives exactly the JSON the server
sends (same keys, same order); ``from_json()`` takes a newer server's answer too: unknown
fields are kept aside and given back by ``to_json()``, fields a newer server added have
defaults, and a value outside a StrEnum stays its string. Adding a field to an answer is one
line here (with a default, so older servers still parse).

The StrEnums are the server's own (``lineage.model``, ``observe.outcomes``), resolved on the
first parse: importing this module loads nothing but the standard library (``apcctl``'s
``--help`` stays light), and never FastAPI, MLX or mlx-vlm.

The objects also read by JSON key (``status["server"]["pid"]``), for scripts and tests written
against the dict answers; the CLI and the dashboard read attributes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, TypeVar

if TYPE_CHECKING:  # resolved on the first parse (``_enum_namespace``): they load numpy
    from server_patch.observe.outcomes import Outcome, Phase, Stored
    from server_patch.lineage.model import EventKind, KVAdmission, RestoreKind

A = TypeVar("A", bound="Answer")

KEY = "key"  # field metadata: the JSON key when it is not the attribute's name (``pass``)
OMIT = "omit"  # field metadata: left out of the JSON when None (a key only some answers carry)


class SchemaError(ValueError):
    """An answer that does not fit its type: says which answer, which field, and why."""


class EntryKind(StrEnum):
    """What an entry is (``kind`` in ``/admin/entries``)."""

    CONVERSATION = "conversation"
    ANCHOR = "anchor"


class Residence(StrEnum):
    """Where an entry is held (``tier`` in ``/admin/entries``)."""

    RAM = "ram"
    RAM_DISK = "ram+disk"
    DISK = "disk"


def _enum_namespace() -> dict[str, Any]:
    from server_patch.observe.outcomes import Outcome, Phase, Stored
    from server_patch.lineage.model import EventKind, KVAdmission, RestoreKind

    return {"Outcome": Outcome, "Phase": Phase, "Stored": Stored, "EventKind": EventKind,
            "KVAdmission": KVAdmission, "RestoreKind": RestoreKind}


def _omit(default: Any = None) -> Any:
    return field(default=default, metadata={OMIT: True})


class Answer:
    """The JSON round trip every answer type shares."""

    NAME: ClassVar[str] = ""  # how errors name the answer (``/admin/status``); the class name if ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None and f.metadata.get(OMIT):
                continue
            out[f.metadata.get(KEY, f.name)] = _dump(value)
        out.update(getattr(self, "_extra", {}))
        return out

    @classmethod
    def from_json(cls: type[A], data: Any, where: str = "") -> A:
        """Parse one answer; ``where`` names it in errors (the answer's path inside a larger one)."""
        where = where or cls.NAME or cls.__name__
        if isinstance(data, Answer):
            data = data.to_json()
        if not isinstance(data, Mapping):
            raise SchemaError(f"{where}: expected an object, got {type(data).__name__}")
        hints = _hints(cls)
        values: dict[str, Any] = {}
        known = set()
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            key = f.metadata.get(KEY, f.name)
            known.add(key)
            if key in data:
                values[f.name] = _load(hints[f.name], data[key], f"{where}.{key}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SchemaError(f"{where}: missing field {key!r} (the server's answer has "
                                  f"{', '.join(map(repr, data)) or 'no fields'})")
        answer = cls(**values)
        extra = {k: v for k, v in data.items() if k not in known}
        if extra:
            object.__setattr__(answer, "_extra", extra)
        return answer

    @classmethod
    def json_keys(cls) -> tuple[str, ...]:
        """The JSON keys this type knows, in the server's order."""
        return tuple(f.metadata.get(KEY, f.name) for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    def __getitem__(self, key: str) -> Any:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.metadata.get(KEY, f.name) == key and not (f.metadata.get(OMIT) and getattr(self, f.name) is None):
                return getattr(self, f.name)
        extra = getattr(self, "_extra", {})
        if key in extra:
            return extra[key]
        raise KeyError(f"{type(self).__name__} has no field {key!r}")

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def keys(self) -> Any:
        """The JSON keys this answer carries (so ``{**answer}`` and ``dict(answer)`` read as its JSON's top level)."""
        return self.to_json().keys()

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key, _ABSENT) is not _ABSENT

    def __eq__(self, other: object) -> bool:
        """Equal to the same answer, and to its JSON (what a script compares it with)."""
        if isinstance(other, Answer):
            return type(self) is type(other) and self.to_json() == other.to_json()
        if isinstance(other, Mapping):
            return self.to_json() == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def of(cls: type[A], value: "A | Mapping[str, Any]", where: str = "") -> A:
        """``value`` as this type: itself, or parsed from its JSON (a recording, the event stream)."""
        return value if isinstance(value, cls) else cls.from_json(value, where)


_ABSENT = object()


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, localns=_enum_namespace())


def _dump(value: Any) -> Any:
    if isinstance(value, Answer):
        return value.to_json()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list):
        return [_dump(v) for v in value]
    return value


def _load(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):  # ``X | None``, ``SomeEnum | str``: the first that fits
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _load(inner[0], value, where) if inner else value
    if origin is list:
        if not isinstance(value, list):
            raise SchemaError(f"{where}: expected a list, got {type(value).__name__}")
        return [_load(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)] if args else value
    if isinstance(hint, type) and issubclass(hint, Answer):
        return hint.from_json(value, where)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            return value  # a newer server's value: kept as its string
    return value


# ---------------------------------------------------------------------- entries and anchors


@dataclass(frozen=True, eq=False, kw_only=True)
class CheckpointInfo(Answer):
    """A restore point inside an entry (``bytes``, ``created``, ``last_hit``: None on disk only)."""

    length: int
    kind: RestoreKind | str
    bytes: int | None = None
    created: float | None = None
    last_hit: float | None = None
    hits: int = 0


@dataclass(frozen=True, eq=False, kw_only=True)
class EntryInfo(Answer):
    """One lineage entry or anchor, held in RAM (and maybe on disk), or only on disk."""

    NAME = "/admin/entries/{id}"

    id: str
    kind: EntryKind | str
    pinned: bool
    length: int
    bytes: int
    kv_bytes: int = 0
    kv_buffer_bytes: int | None = _omit()  # held in RAM only
    checkpoint_bytes: int = 0
    created: float | None = None
    last_used: float | None = None
    last_hit: float | None = None
    hits: int = 0
    tier: Residence | str = Residence.RAM
    disk_bytes: int = 0
    label: str = ""
    namespace: str = ""
    checkpoints: list[CheckpointInfo] = field(default_factory=list)

    @property
    def is_anchor(self) -> bool:
        return self.kind == EntryKind.ANCHOR

    @property
    def only_on_disk(self) -> bool:
        return self.tier == Residence.DISK


@dataclass(frozen=True, eq=False, kw_only=True)
class Budgets(Answer):
    """Used and limit per budget (``LineageCache.budgets()``, or the configured ones before the cache)."""

    ram_used: int
    ram_limit: int
    conversation_bytes: int
    disk_queue_bytes: int = 0  # (newer than the others)
    held_bytes: int = 0  # entries a queued request holds until its admission (``lineage.holds``); newer
    loading_bytes: int = 0  # disk loads in flight, counted in the RAM budget; newer
    anchor_bytes: int
    anchor_bytes_limit: int
    anchor_count: int  # pinned anchors in RAM: what the anchor caps bound
    anchor_count_limit: int
    pinned_on_disk: int = 0  # pinned anchors held only on disk (after a restart, until restored); newer
    disk_used: int
    disk_limit: int
    entries: int
    disk_files: int

    @property
    def pinned(self) -> int:
        """Pinned anchors wherever they are: in RAM (``anchor_count``) or only on disk."""
        return self.anchor_count + self.pinned_on_disk


ABSORBED_INTO = "absorbed into "  # how a 404 for an absorbed entry names its absorber (``absorber_in``)


def not_held(entry_id: str, absorbed_into: str | None) -> str:
    """The 404 message of ``GET /admin/entries/{id}``: an absorbed entry names the entry that
    holds its state now, so the CLI can show that one (``absorber_in``) as the dashboard does."""
    if absorbed_into is None:
        return f"no entry {entry_id!r}"
    return f"no entry {entry_id!r}: it was {ABSORBED_INTO}{absorbed_into} (its conversation's longer entry)"


def absorber_in(message: str) -> str | None:
    """The absorber a ``not_held`` message names, or None."""
    _, found, rest = message.partition(ABSORBED_INTO)
    return rest.split(" ", 1)[0] or None if found else None


@dataclass(frozen=True, eq=False, kw_only=True)
class Entries(Answer):
    """``GET /admin/entries``; ``started`` False before the first request (configured budgets)."""

    NAME = "/admin/entries"

    entries: list[EntryInfo]
    budgets: Budgets
    started: bool


@dataclass(frozen=True, eq=False, kw_only=True)
class Anchors(Answer):
    NAME = "/admin/anchors"

    anchors: list[EntryInfo]


@dataclass(frozen=True, eq=False, kw_only=True)
class Evicted(Answer):
    NAME = "DELETE /admin/entries/{id}"

    evicted: str
    freed_bytes: int


@dataclass(frozen=True, eq=False, kw_only=True)
class NewAnchor(Answer):
    NAME = "POST /admin/anchors"

    anchor: EntryInfo
    created: bool


# ---------------------------------------------------------------------- requests and events


@dataclass(frozen=True, eq=False, kw_only=True)
class RequestRecord(Answer):
    """One request's timing record (``integration.timings.RequestTiming.as_dict()``, field for field)."""

    NAME = "request record"

    seq: int
    started: float
    prompt_tokens: int
    restore_kind: RestoreKind | str = "cold"
    restored_tokens: int = 0
    entry_id: str = ""
    kv_admission: KVAdmission | str = ""
    lookup_ms: float = 0.0
    admission_ms: float = 0.0
    loading_ms: float = 0.0  # queued while its disk restore point loaded (``integration.loading``)
    loading_steps: int = 0  # the decode steps the batch took meanwhile
    prefill_ms: float = 0.0
    commit_ms: float = 0.0
    ttft_ms: float = 0.0
    request_id: str = ""
    captures: list[str] = field(default_factory=list)
    reply_tokens: int = 0
    copies: dict[str, int] = field(default_factory=dict)
    outcome: Outcome | str = ""
    phase: Phase | str = ""
    stored: Stored | str = ""
    oracle: int = 0  # the live oracle (``lineage.misses``): what an unbounded cache would have restored
    lost: dict[str, int] = field(default_factory=dict)  # and what this one restored less, by reason
    lost_why: str = ""  # why a disk file it would have restored from was rejected
    # What the client changed against the nearest earlier prompt of its namespace (issue 37,
    # ``server_patch.drift``): position, segment, cause, tokens, and (APC_DRIFT_TEXT) context,
    # removed, added; {}: nothing changed, or off.
    drift: dict[str, Any] = field(default_factory=dict)
    # Waiting for other requests' work on the generation thread (``integration.waits``), accruing
    # until the row ends (``ended``: final); ``waited`` by work ({"prefill": ms, ...}).
    waited_ms: float = 0.0
    waited: dict[str, float] = field(default_factory=dict)
    delayed_steps: int = 0  # its decode steps that work pushed back
    # Its inter-token gaps while decoding (issue 40), each {"ms", "from", "to", "parts": {part: ms}}
    # with parts that add up to "ms": its own "step", others' work by kind, "unattributed". The
    # largest, the largest few that held others' work (largest first), and how many gaps.
    worst_gap: dict[str, Any] = field(default_factory=dict)
    gaps: list[dict[str, Any]] = field(default_factory=list)
    gap_count: int = 0
    ended: bool = False


@dataclass(frozen=True, eq=False, kw_only=True)
class Requests(Answer):
    NAME = "/admin/requests"

    requests: list[RequestRecord]


@dataclass(frozen=True, eq=False, kw_only=True)
class CacheEvent(Answer):
    """A cache event of ``/admin/events`` (``event: cache``)."""

    NAME = "cache event"

    seq: int
    time: float
    type: str
    event: EventKind | str
    entry_id: str
    length: int
    bytes: int
    detail: str


# ---------------------------------------------------------------------- status


@dataclass(frozen=True, eq=False, kw_only=True)
class ServerInfo(Answer):
    """Which process answers: a restart changes ``pid`` and ``started``."""

    model: str | None = None
    pid: int
    create_time: float | None = None
    uptime_s: float | None = None
    started: float | None = None
    mlx_vlm_version: str | None = None
    patch_version: str | None = None
    fingerprint: str | None = None


@dataclass(frozen=True, eq=False, kw_only=True)
class Traffic(Answer):
    """``POST /admin/drain`` and ``/undrain``: requests in flight and the drain."""

    NAME = "/admin/drain"

    in_flight: int = 0
    draining: bool = False
    retry_after_s: int = 5
    since_last_finished_s: float | None = None
    rejected_while_draining: int = 0


@dataclass(frozen=True, eq=False, kw_only=True)
class Idle(Traffic):
    """``idle`` of the status: the traffic, and requests queued in mlx-vlm's generator."""

    queued: int = 0


@dataclass(frozen=True, eq=False, kw_only=True)
class Pool(Answer):
    """MLX's allocator (``mx.get_active_memory`` and friends)."""

    active_bytes: int | None = None
    cache_bytes: int | None = None
    peak_bytes: int | None = None


@dataclass(frozen=True, eq=False, kw_only=True)
class AdminInfo(Answer):
    """The admin endpoint's own state: open event streams and its limits (``guard.AdminLimits``)."""

    event_streams: int
    max_event_streams: int | None = _omit()
    max_body_bytes: int | None = _omit()


@dataclass(frozen=True, eq=False, kw_only=True)
class CanaryBrief(Answer):
    """Restore kinds the canary found suspect, and what requests do about them."""

    suspects: list[str] = field(default_factory=list)
    on_fail: str = "log"


@dataclass(frozen=True, eq=False, kw_only=True)
class Hits(Answer):
    """The server's hit summary (``lineage.summary.hit_summary``): zeros before the cache starts."""

    requests: int = 0
    hits: int = 0
    hit_rate: float | None = None
    by_kind: dict[str, int] = field(default_factory=dict)
    # Disk restores (``by_kind["disk"]``) by the kind of point their plan restored (entry, anchor, ...).
    disk_by_point: dict[str, int] = field(default_factory=dict)
    cancelled_queued: int = 0
    reused_tokens: int = 0
    prefill_tokens: int = 0
    token_hit_rate: float | None = None


@dataclass(frozen=True, eq=False, kw_only=True)
class LineageInfo(Answer):
    """The running cache: budgets, counters, state layout, disk tier and configuration."""

    budgets: Budgets
    stats: dict[str, int]
    layout: str | None = None
    disk_path: str | None = None
    disk_pending_writes: int = 0
    disk: dict[str, Any] | None = None  # ``DiskStore.health()``; None with the disk tier off
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, eq=False, kw_only=True)
class DiskVolume(Answer):
    """The disk tier's volume; only ``enabled`` when the tier is off."""

    enabled: bool
    path: str | None = _omit()
    free_bytes: int | None = _omit()
    total_bytes: int | None = _omit()
    files_bytes: int | None = _omit()
    files: int | None = _omit()


@dataclass(frozen=True, eq=False, kw_only=True)
class Sizing(Answer):
    """Budgets, physical memory, the disk volume, and what this machine cannot honour."""

    budgets: Budgets
    ram_total_bytes: int | None
    disk: DiskVolume
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True, eq=False, kw_only=True)
class Status(Answer):
    """``GET /admin/status``; ``lineage`` None before the first request creates the cache."""

    NAME = "/admin/status"

    server: ServerInfo
    idle: Idle = field(default_factory=Idle)
    pool: Pool | None = None
    admin: AdminInfo | None = _omit()
    canary: CanaryBrief | None = _omit()
    hits: Hits = field(default_factory=Hits)
    lineage: LineageInfo | None = None
    sizing: Sizing | None = _omit()
    # The live oracle's totals (``lineage.misses.MissBook.totals``); absent before the cache.
    oracle: dict[str, Any] | None = _omit()
    # APC_* values this process was started with but cannot read (``settings.problems``): what
    # reads one runs without it (the journal turns itself off); absent from older servers.
    invalid_settings: list[str] = field(default_factory=list)

    @property
    def started(self) -> bool:
        """Whether the cache exists (it starts with the first request)."""
        return self.lineage is not None

    @property
    def budgets(self) -> Budgets | None:
        """The running cache's budgets, else the configured ones."""
        return self.lineage.budgets if self.lineage else self.sizing.budgets if self.sizing else None


# ---------------------------------------------------------------------- verbs


@dataclass(frozen=True, eq=False, kw_only=True)
class FlushReport(Answer):
    """``POST /admin/flush`` (``admin.flush``): what reached the disk, and why not all of it."""

    NAME = "/admin/flush"

    queued: int
    written: int
    failed: int
    unwritten: list[str]
    pending: int
    complete: bool
    reason: str | None
    disk_enabled: bool


@dataclass(frozen=True, eq=False, kw_only=True)
class CanaryState(Answer):
    """``GET /admin/verify``: counters, the last result, suspect kinds and the schedule."""

    NAME = "/admin/verify"

    counts: dict[str, int]
    last: dict[str, Any] | None
    suspects: dict[str, dict[str, Any]]
    on_fail: str
    time: float | None = None
    queued: int = 0
    running: bool = False
    loading: int = 0  # disk files the canary's loader thread is reading now
    interval_s: float | None = None
    idle_s: float | None = None
    chunk: int | None = None
    max_tokens: int | None = None
    recent: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True, eq=False, kw_only=True)
class VerifyReport(Answer):
    """``POST /admin/verify``: the points checked and their results."""

    NAME = "POST /admin/verify"

    complete: bool
    points: int
    results: list[dict[str, Any]]
    passed: int = field(default=0, metadata={KEY: "pass"})
    failed: int = field(default=0, metadata={KEY: "fail"})
    skipped: int = field(default=0, metadata={KEY: "skip"})
    errors: int = 0
    abandoned: int = 0
    suspects: list[str] = field(default_factory=list)
    on_fail: str = "log"


@dataclass(frozen=True, eq=False, kw_only=True)
class Cleared(Answer):
    NAME = "POST /admin/verify/clear"

    cleared: list[str]
    suspects: list[str]


@dataclass(frozen=True, eq=False, kw_only=True)
class ModelRuntimes(Answer):
    open_runtimes: int
    threads: list[str]
    runtime_started: float | None = None
    worker_threads: dict[str, int] = field(default_factory=dict)  # the park's threads, and the idle ones


@dataclass(frozen=True, eq=False, kw_only=True)
class ModelInfo(Answer):
    """``GET /admin/model``: the served model (by group), the loaded one, open lineage runtimes."""

    NAME = "/admin/model"

    served: dict[str, Any]
    loaded_model: str | None
    lineage: ModelRuntimes


# Every answer type with the route that sends it (the tests parse a real server's answers with these).
ROUTES: dict[str, type[Answer]] = {
    "GET /admin/status": Status, "GET /admin/entries": Entries, "GET /admin/entries/{id}": EntryInfo,
    "DELETE /admin/entries/{id}": Evicted, "GET /admin/anchors": Anchors, "POST /admin/anchors": NewAnchor,
    "POST /admin/anchors/{id}/pin": EntryInfo, "POST /admin/anchors/{id}/unpin": EntryInfo,
    "GET /admin/requests": Requests, "POST /admin/flush": FlushReport, "POST /admin/drain": Traffic,
    "POST /admin/undrain": Traffic, "GET /admin/verify": CanaryState, "POST /admin/verify": VerifyReport,
    "POST /admin/verify/clear": Cleared, "GET /admin/model": ModelInfo, "POST /admin/model": ModelInfo,
}
