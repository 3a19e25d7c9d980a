"""Every ``APC_*`` setting in one registry: its name, type, default and why; the values in force.

Settings read into a dataclass (``LineageConfig``, ``SegmentSettings``, ``CopyFreeSettings``,
``AdminLimits``) are listed from the dataclass itself, so their defaults are written once: a
``_Group`` names the class, how a field maps to a variable, and why each field exists. The
others are listed here with their defaults. Readers ask ``value(name)`` (parsed by the one
parser in ``server_patch.envconfig``), ``apcctl config show`` prints ``in_force()``, and
``docs/settings.md`` is ``markdown()`` (a test keeps it equal).

This module imports no other part of the server at import time (the dataclass groups are
imported when the whole list is first asked for), so any reader may import it.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

from server_patch.envconfig import ValueType, parse_typed, type_for

T = ValueType
DEFAULT, ENV, CONFIG = "default", "env", "config"  # where a value in force came from

# Variables only mlx-vlm 0.7.10 reads (``mlx_vlm/server/runtime_config.py``, ``mlx_vlm/apc.py``):
# apcctl sets some of them for the stock server it compares against. Not apcctl's settings.
MLX_VLM_OWNED = frozenset({
    "APC_ENABLED", "APC_DISK_ENABLED", "APC_DISK_PATH", "APC_DISK_MAX_GB", "APC_MEMORY_MAX_GB",
    "APC_CHECKPOINT_ENTRIES", "APC_CHECKPOINT_INTERVAL_TOKENS", "APC_CHECKPOINT_GUARD_TOKENS",
    "APC_EXACT_MIN_TOKENS",
})


@dataclass(frozen=True)
class Setting:
    """One environment variable: how it is read, its default, why it exists, who reads it.

    ``default`` is the parsed value used when the variable is unset or blank (None: nothing);
    ``default_text`` shows a default that depends on something else (the state directory), and
    ``derive`` ("module:function") names the reader's function that computes it, for ``in_force``.
    """

    name: str
    type: ValueType
    default: Any
    why: str
    group: str
    readers: tuple[str, ...]
    default_text: str = ""
    choices: tuple[str, ...] = ()
    secret: bool = False
    derive: str = ""

    def parse(self, raw: str) -> Any:
        """``raw`` as this setting's type; a ``ValueError`` naming the variable when it is not."""
        value = parse_typed(self.type, self.name, raw)
        if self.choices and value not in self.choices:
            raise ValueError(f"{self.name}={raw!r} is not one of {', '.join(self.choices)}")
        return value

    def raw(self, env: Mapping[str, str] | None = None) -> str | None:
        """The variable's text as set (None when unset), for readers that must see a blank value."""
        return (os.environ if env is None else env).get(self.name)

    def read(self, env: Mapping[str, str] | None = None) -> Any:
        """The value in force: the parsed variable, or the default when it is unset or blank."""
        raw = self.raw(env)
        if raw is None or not raw.strip():
            return self.default
        return self.parse(raw)

    def shown(self, value: Any) -> str:
        """A value as the table shows it (sizes in binary units, secrets hidden)."""
        if value is None:
            return ""
        if self.secret:
            return "(set)"
        if self.type is T.SIZE:
            return format_size(int(value))
        if self.type is T.BOOL:
            return "1" if value else "0"
        if self.type is T.FRACTION:
            return f"{value:.4g}".rstrip("0").rstrip(".") if value else "0"
        if isinstance(value, tuple):
            return ",".join(str(v) for v in value)
        return str(value)

    @property
    def default_shown(self) -> str:
        return self.default_text or self.shown(self.default) or "unset"


def format_size(n: int) -> str:
    """Bytes in the largest binary unit that divides them (``64M``, ``48G``), else plain."""
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _s(name: str, type_: ValueType, default: Any, why: str, group: str, *readers: str, **extra: Any) -> Setting:
    return Setting(name, type_, default, why, group, readers, **extra)


_STATE = "server_patch.paths"
_SCALARS: tuple[Setting, ...] = (
    _s("APC_STATE_DIR", T.PATH, None, "Where the admin token, the journal and other per-server state live "
       "(not the disk tier's files); `apcctl serve` gives each managed server its own.", "state", _STATE,
       default_text="the per-user state dir (platformdirs)", derive="server_patch.paths:state_dir"),
    _s("APC_ADMIN_TOKEN", T.TEXT, None, "The admin bearer token. A blank value stops the server: an empty "
       "token would let anyone in. Unset: the token file.", "admin", "server_patch.infra.auth", "apcctl.config",
       default_text="unset: the token file", secret=True),
    _s("APC_ADMIN_TOKEN_FILE", T.PATH, None, "The token file, created once (0600) with a random token when "
       "missing or blank.", "admin", "server_patch.infra.auth", default_text="<state dir>/admin-token",
       derive="server_patch.infra.auth:default_token_path"),
    _s("APC_JOURNAL", T.BOOL, True, "The on-disk journal of every request record and cache event that "
       "`apcctl report` reads; 0 turns it off.", "journal", "server_patch.integration.journal"),
    _s("APC_JOURNAL_DIR", T.PATH, None, "Where the journal's rotating files are.", "journal",
       "server_patch.integration.journal", "apcctl.commands.report", default_text="<state dir>/journal",
       derive="server_patch.integration.journal:directory_from_env"),
    _s("APC_JOURNAL_MAX_BYTES", T.SIZE, 64 << 20, "Size of one journal file before it rotates (at least 1K).",
       "journal", "server_patch.integration.journal"),
    _s("APC_JOURNAL_FILES", T.INT, 8, "Journal files kept in all, the live one included: with the size, "
       "about a week of traffic.", "journal", "server_patch.integration.journal"),
    _s("APC_JOURNAL_SNAPSHOT_S", T.FLOAT, 60.0, "The least time between two budget snapshots in the journal "
       "(what a report draws bytes per tier from).", "journal", "server_patch.integration.journal"),
    _s("APC_DRIFT", T.BOOL, True, "Name what the client changed in each prompt against the nearest earlier one "
       "of its namespace (position, segment, cause; /admin and the journal only); 0 turns it off.", "journal",
       "server_patch.drift.detector"),
    _s("APC_DRIFT_TEXT", T.BOOL, True, "Keep a short decoded text diff around each divergence; 0 keeps the "
       "cause and position without prompt text.", "journal", "server_patch.drift.detector"),
    _s("APC_DRIFT_POINTS", T.BOOL, True, "Restore points where clients part from their earlier prompts: "
       "each prompt's generation-prompt start (a retry that drops the reply), and where a namespace was "
       "seen to rebuild its history on resume; 0 captures none.", "journal", "server_patch.drift.detector"),
    _s("APC_LINEAGE_DISK", T.BOOL, True, "The disk tier: entries evicted from RAM are written to disk and "
       "restored from it, across restarts too; 0 keeps RAM only.", "disk", "server_patch.disk_paths"),
    _s("APC_DISK_LOAD_WAIT_MS", T.FLOAT, 30000.0, "How long a request whose restore point is on disk waits "
       "in the queue for its file to load off the generation thread (the batch decodes meanwhile); past "
       "that it is admitted cold and the file kept.", "disk", "server_patch.integration.loading"),
    _s("APC_STAGE_MIN_TOKENS", T.INT, 2048, "A queued request whose RAM restore would take the batch "
       "merge's copy (a checkpoint below the entry's head, an anchor, an entry it cannot be lent) and "
       "restores at least this many tokens, while other rows decode, waits in the queue while that copy "
       "is made on a thread of its own (the batch decodes meanwhile); the merge then adopts it. Past "
       "`APC_DISK_LOAD_WAIT_MS` or on a failure it is merged as before. 0: every such copy is made by the "
       "merge, on the generation thread, as before.", "copy-free", "server_patch.integration.staging"),
    _s("APC_LINEAGE_DISK_PATH", T.PATH, None, "The disk tier's directory, locked by one server at a time.",
       "disk", "server_patch.disk_paths",
       default_text="the per-user cache dir (platformdirs)/lineage",
       derive="server_patch.disk_paths:default_disk_root"),
    _s("APC_LINEAGE_DISK_MIN_FREE", T.FRACTION, 0.05, "Free space the disk writer leaves on the volume "
       "(0.05 or 5%): the cache is never what fills the disk.", "disk", "server_patch.disk.space"),
    _s("APC_SHARED_DISK_PATH", T.PATH, None, "The fleet's shared disk tier: this server also restores "
       "from its peers' subdirectories of this directory, read-only (its own stays APC_LINEAGE_DISK_PATH; "
       "`fleet up` sets both). Unset: no peers.", "disk", "server_patch.disk.peers"),
    _s("APC_SHARED_DISK_SCAN_MS", T.FLOAT, 1000.0, "How often the peers' directories are rescanned (a "
       "directory whose mtime did not change is not listed again; only new files' headers are read).",
       "disk", "server_patch.disk.peers"),
    _s("APC_SHARED_DISK_RETENTION_S", T.FLOAT, 604800.0, "A peer server gone (its lock free) whose newest "
       "file is older than this: its files are removed by the first peer that scans them (7 days; 0: never). "
       "Until then its sessions restore from them.", "disk", "server_patch.disk.retention"),
    _s("APC_SPARSE_ATTENTION", T.BOOL, True, "The patched glm5_next sparse-attention paths (read at import); "
       "0 sends every chunk to stock's `_attend` (docs/sparse-attention.md).", "sparse",
       "server_patch.sparse.dispatch"),
    _s("APC_PROFILE_FLAG", T.PATH, None, "The flag file whose presence turns per-layer forward timing on "
       "(`apcctl profile`).", "profile", "server_patch.sparse.profiler",
       default_text="<state dir>/profile/layers.flag", derive="server_patch.sparse.profiler:flag_path"),
    _s("APC_PROFILE_LOG", T.PATH, None, "Where profiled forwards write one JSON line each.", "profile",
       "server_patch.sparse.profiler", default_text="<flag>.jsonl", derive="server_patch.sparse.profiler:log_path"),
    _s("APC_LOG_FILE", T.PATH, None, "Send all server output to this file, rotating while it runs "
       "(`apcctl serve` sets it).", "log", "server_patch.launch", default_text="unset: the terminal"),
    _s("APC_LOG_MAX_BYTES", T.SIZE, 64 << 20, "Size of the log file before it rotates.", "log",
       "server_patch.launch"),
    _s("APC_LOG_BACKUPS", T.INT, 4, "Rotated log files kept.", "log", "server_patch.launch"),
    _s("APC_LOG_ADMIN_REQUESTS", T.BOOL, False, "Log the admin reads that succeed (GET `/admin/...`, which "
       "the dashboard polls several times a second) in the access log; admin writes and failures are "
       "always logged.", "log", "server_patch.admin.access_log"),
    _s("APC_DECODE_STALL_MS", T.FLOAT, 250.0, "While other rows decode, a prefill chunk is sized to take "
       "about this long (from the server's measured prefill rate), so no stream waits longer for one chunk; "
       "with no row decoding, prefill keeps mlx-vlm's full chunk. 0: mlx-vlm's fixed chunk, as stock.",
       "pacing", "server_patch.pacing"),
    _s("APC_COPY_COUNTER", T.BOOL, False, "Count the bytes every cache copy moves (a debug counter for "
       "benches; it wraps mlx-vlm methods). Same as the launcher's `--copy-counter`.", "copy counter", "server_patch.copyfree.counter"),
    _s("APC_COPY_COUNTER_FILE", T.PATH, None, "Where the copy counter rewrites its totals as JSON.",
       "copy counter", "server_patch.copyfree.counter"),
    _s("APC_SERVED_MODEL_NAME", T.LIST, (), "Names a request's `model` may use for the `--model` served "
       "(vLLM's `--served-model-name`); its path always works, normalised. Same as the launcher's "
       "`--served-model-name`.", "serving", "server_patch.serving.served", "server_patch.launch"),
    _s("APC_LOAD_REQUESTED_MODEL", T.BOOL, False, "mlx-vlm's own behaviour: a request naming another model "
       "loads it, unloading the served one and its cache. 0: such a request gets 404 `model_not_found`; "
       "switching is `POST /admin/model` (admin token).", "serving", "server_patch.serving.served"),
    _s("APC_SPECULATIVE_DRAFTER", T.TEXT, None, "Set by the launcher, not by hand: the `--draft-model` it "
       "serves, so the intake refuses `logprobs` (mlx-vlm 0.7.10's speculative batches compute none).",
       "serving", "server_patch.speculative.support"),
    _s("APC_ALLOWED_ORIGINS", T.LIST, (), "Web origins (`http://host:port`) allowed to call the inference "
       "routes cross-origin, with CORS; `*`: every origin, as stock mlx-vlm. Unset: none (403). Same as "
       "the launcher's `--allowed-origins`.", "serving", "server_patch.serving.origins", "server_patch.launch"),
    _s("APC_ALLOWED_HOSTS", T.LIST, (), "Host names the server answers to besides IP addresses, "
       "`localhost`, this machine's name, `*.local`/`*.internal` and the `--host` name (DNS rebinding: "
       "any other `Host` gets 403); `*`: any.",
       "serving", "server_patch.serving.origins"),
    _s("APC_TENANT_FROM_USER", T.BOOL, False, "Take the cache tenant from a request's `user` (OpenAI) or "
       "`metadata.user_id` (Anthropic) field when it sends no (or a blank) tenant header. The field is only as "
       "trustworthy as the client that sends it: with API keys each key stays its own namespace anyway.",
       "tenant", "server_patch.tenancy.middleware"),
    _s("APC_DEFAULT_TENANT", T.TEXT, None, "mlx-vlm's tenant for a request without one (stock 0.7.10 reads it); "
       "a request with an API key or a `cache_salt` keeps it as the tenant part of its namespace.", "tenant",
       "server_patch.tenancy.middleware", default_text="unset: one shared tenant"),
    _s("APC_API_KEYS", T.LIST, (), "Inference API keys, comma-separated (`--api-key`): every route but "
       "`/health`, `/admin` and mlx-vlm's management writes (admin token) then needs `Authorization: Bearer <key>`, and each key is its own cache "
       "namespace. Set but blank stops the server.", "tenant", "server_patch.tenancy.keys", secret=True,
       default_text="unset: no keys"),
    _s("APC_API_KEY_FILE", T.PATH, None, "A file of inference API keys, one per line, `#` comments "
       "(`--api-key-file`); made 0600 if others can read it. Same effect as `APC_API_KEYS`; both may be set.",
       "tenant", "server_patch.tenancy.keys"),
    _s("APC_MEDIA_PRIVATE_URLS", T.BOOL, False, "Let requests name media URLs on private, loopback and "
       "link-local hosts (stock fetches any URL; 0 refuses them with a 400 before connecting, every redirect "
       "hop included).", "intake", "server_patch.intake.media"),
    _s("APC_ALLOWED_LOCAL_MEDIA_PATH", T.PATH, None, "A directory whose files requests may name as media "
       "(local paths, `file://`; vLLM's `--allowed-local-media-path`). Unset: no local file is read (stock "
       "reads any).", "intake", "server_patch.intake.media", default_text="unset: no local files"),
    _s("APC_METRICS_PUBLIC", T.BOOL, False, "Answer mlx-vlm's `GET /metrics` in full to anyone, as stock "
       "does; 0 keeps its per-request records (`latest`, `recent`, `last_error`) for the admin token, "
       "and with API keys all of it (its totals cover every key).",
       "intake", "server_patch.intake.metrics_view"),
    _s("APC_CANCEL_ON_DISCONNECT", T.BOOL, True, "Stop a request whose client disconnected, non-streamed "
       "ones too, at the next step (0: stock, a non-streamed request decodes to `max_tokens` unread).",
       "intake", "server_patch.intake.client_gone"),
    _s("APC_DRAIN_STREAM_DEADLINE_S", T.FLOAT, 60.0, "A request still in flight this many seconds after a "
       "drain began (`apcctl restart`) is ended: a stream gets a final SSE error (`drain_deadline`), a "
       "request with no answer yet a 503, a client that cannot take it a closed connection; 0 waits for "
       "every request.", "admin", "server_patch.infra.drain_deadline"),
    _s("APC_CANARY_INTERVAL_S", T.FLOAT, 0.0, "Seconds between scheduled restore checks while idle "
       "(0: only `apcctl verify`).", "canary", "server_patch.canary.runner"),
    _s("APC_CANARY_IDLE_S", T.FLOAT, 1.0, "Idle time after the last request before a check may run.",
       "canary", "server_patch.canary.runner"),
    _s("APC_CANARY_CHUNK", T.INT, 128, "Tokens per check chunk: a request waits for at most one.", "canary",
       "server_patch.canary.runner"),
    _s("APC_CANARY_MAX_TOKENS", T.INT, 8192, "Longest restore point checked cold; longer ones check a "
       "window.", "canary", "server_patch.canary.runner"),
    _s("APC_CANARY_ON_FAIL", T.TEXT, "log", "What a failed check does: `log` it, or `cold`: restore nothing "
       "of that kind until `apcctl verify --clear`.", "canary", "server_patch.canary.book",
       choices=("log", "cold")),
    _s("APC_CANARY_ATOL", T.FLOAT, None, "Absolute logit tolerance of a check.", "canary",
       "server_patch.canary.compare", default_text="by the logits' dtype"),
    _s("APC_CANARY_RTOL", T.FLOAT, None, "Relative logit tolerance of a check.", "canary",
       "server_patch.canary.compare", default_text="by the logits' dtype"),
    _s("APC_TEST_FAULTS", T.BOOL, False, "Arms the test-only fault hooks below (the fault-injection "
       "suite), and makes fail-closed handlers re-raise (a test sees the bug); nothing else reads them.",
       "test faults", "server_patch.disk.faults", "server_patch.canary.faults", "server_patch.failclosed"),
    _s("APC_TEST_FAULT_DISK_STALL_S", T.FLOAT, 0.0, "Every disk write sleeps this long before its rename.",
       "test faults", "server_patch.disk.faults"),
    _s("APC_TEST_FAULT_DISK_ENOSPC", T.BOOL, False, "Every disk write fails with ENOSPC.", "test faults",
       "server_patch.disk.faults"),
    _s("APC_TEST_FAULT_DISK_LOAD_HOLD_FILE", T.PATH, None, "A queued request's disk load waits while this "
       "file exists (it writes `PATH.held` first).", "test faults", "server_patch.disk.faults"),
    _s("APC_TEST_FAULT_STAGE_HOLD_FILE", T.PATH, None, "A queued request's staged copy waits while this "
       "file exists (it writes `PATH.held` first).", "test faults", "server_patch.disk.faults"),
    _s("APC_TEST_FAULT_JOIN_SPARES_HOLD_FILE", T.PATH, None, "The stager's making of a join's buffers ahead "
       "waits while this file exists (it writes `PATH.held` first).", "test faults", "server_patch.disk.faults"),
    _s("APC_TEST_FAULT_CORRUPT_STATE", T.LIST, (), "Checkpoint kinds whose recurrent state is corrupted "
       "(`all`: every kind).", "test faults", "server_patch.canary.faults"),
    _s("APC_TEST_FAULT_CANARY_PAUSE_FILE", T.PATH, None, "A check pauses while this file exists.",
       "test faults", "server_patch.canary.faults"),
    _s("APC_TEST_FAULT_CLOCK_STEP_FILE", T.PATH, None, "Seconds in this file are added to the server's "
       "wall clock (a stepped clock), read on every call.", "test faults", "server_patch.clock"),
)


@dataclass(frozen=True)
class _Group:
    """Settings read into one frozen dataclass: which class, how a field is named, why each is."""

    group: str
    target: str  # "module:Class"
    names: Callable[[Any], Mapping[str, str]]  # the class's module -> {field: variable}
    why: Mapping[str, str]
    readers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # extra readers by field
    default_texts: Mapping[str, str] = field(default_factory=dict)  # a default computed at start, by field

    def settings(self) -> list[Setting]:
        module_name, class_name = self.target.split(":")
        module = importlib.import_module(module_name)
        cls = getattr(module, class_name)
        defaults = {f.name: f.default for f in fields(cls)}
        out = []
        for field_name, variable in self.names(module).items():
            default = defaults[field_name]
            extra = self.readers.get(field_name, ())
            out.append(Setting(variable, type_for(default, field_name), default, self.why.get(field_name, ""),
                               self.group, (module_name, *extra),
                               default_text=self.default_texts.get(field_name, "")))
        return out


def _lineage_names(module: Any) -> dict[str, str]:
    return module.LineageConfig.env_names()


def _intake_names(module: Any) -> dict[str, str]:
    return {f.name: f"{module.PREFIX}{f.name.upper()}" for f in fields(module.IntakeLimits)}


def _admin_names(module: Any) -> dict[str, str]:
    return {f.name: f"APC_ADMIN_{f.name.upper()}" for f in fields(module.AdminLimits)}


_GROUPS: tuple[_Group, ...] = (
    _Group("lineage", "server_patch.lineage.config:LineageConfig", _lineage_names, {
        "enabled": "The whole patch: 0 runs stock mlx-vlm 0.7.10 with none of it.",
        "entry_offset": "Where an entry sits: n - 1, because 0.7.10 prefills [:n-1] (the server refuses "
                        "anything else; other values are for the simulator).",
        "guard_tokens": "The guard checkpoint sits this many tokens before the end (1: none, the entry at "
                        "n - 1 is its own resend point).",
        "guard_min_suffix": "A guard is only captured when the uncached suffix is at least this long.",
        "divergence_min_gain": "A divergence checkpoint needs to save at least this many tokens over the "
                               "restore point.",
        "periodic_stride": "A periodic checkpoint every this many tokens, for structure the server does "
                           "not know (0: none).",
        "segment_min_gap": "A segment checkpoint is only captured this far from every other restore point.",
        "min_tokens": "No restore point shorter than this.",
        "max_checkpoints": "Checkpoints an entry keeps; more are thinned.",
        "thin_order": "Checkpoint classes in the order thinning drops them.",
        "ram_budget_bytes": "Bytes of entries and checkpoints held in RAM.",
        "anchor_max_entries": "Pinned anchors kept in RAM, shared fairly: over a cap, the least recently used "
                              "anchor of the API key (else namespace) holding the most leaves first.",
        "anchor_max_bytes": "Bytes the pinned anchors may hold (inside the RAM budget).",
        "disk_max_bytes": "Bytes the disk tier may hold.",
        "disk_low_watermark": "Disk eviction frees down to this fraction of the disk budget.",
        "disk_write_delay_s": "An entry is written to disk once idle this long (one still being extended "
                              "is not worth writing).",
        "shutdown_flush_s": "On SIGTERM, unwritten entries are flushed for at most this long.",
        "reply_reuse": "A finished request's entry moves past its reply, so a next prompt that re-renders "
                       "the reply prefills only what is new (0: the entry stays at the prompt end).",
        "shadow_budget_bytes": "Bytes of the live oracle's shadow index (hashes of what each namespace "
                               "processed, never token text; oldest evicted first): what an unbounded cache "
                               "would have restored, and why each missing token was missed (0: off).",
        "shadow_block_tokens": "Tokens per shadow block (1..16): the oracle is rounded down to it; larger "
                               "blocks cost fewer bytes.",
    }, {"enabled": ("server_patch.launch",)},
       {"disk_max_bytes": "half the disk tier's volume, at most 1T"}),
    _Group("segments", "server_patch.boundaries.settings:SegmentSettings",
           lambda module: {field: key for key, field in module.ENV.items()}, {
               "enabled": "Chat-template segment boundaries as restore points (0: the anchor only).",
               "fallback_stride": "Segments every this many tokens where no template boundary is known "
                                  "(0: none).",
               "tool_boundaries": "A boundary after each tool inside the tools block (docs/segments.md).",
               "system_paragraphs": "Paragraph breaks per system message reported, the last ones, and as "
                                    "many line/heading/section points where a long system text has "
                                    "them (-1: all; 0: none; docs/segments.md).",
               "anchor_tail_tokens": "A trailing system part shorter than this (a clock) stays out of the "
                                     "anchor.",
               "max_new_renders": "Template renders one request may add to the cache (0: no limit).",
           }),
    _Group("copy-free", "server_patch.copyfree.settings:CopyFreeSettings", lambda module: module.ENV, {
        "enabled": "The capacity-reserving batch merge and deferred adoption (0: stock's merge and a row "
                   "copy at every commit, for A/B runs).",
        "adopt": "Adopt a lone request's own KV buffer at its end instead of copying its row.",
        "lend": "Lend an entry's buffer to the lone request that extends it, so a warm turn copies no KV.",
        "join": "A row joining or leaving the decoding batch moves each KV row once, at its own width "
                "(0: mlx-vlm's extend/filter, which copy every row at the longest row's width).",
        "grow": "A decoding batch outgrowing its KV buffer grows into one made ahead off the generation "
                "thread, timed as `grow` (needs APC_COPYFREE_JOIN; 0: mlx-vlm's concatenation into fresh memory).",
        "join_wait_ms": "A finished prompt batch waits at most this long (others keep decoding) for the joint "
                        "buffers the stager is still making for its join, instead of allocating them while "
                        "every stream waits (0: never waits).",
        "lend_headroom": "Extra rows a lone request's merge allocates, so its next turns fit in place.",
        "decode_reserve": "Rows of decode headroom the merge allocates past the prompt end.",
        "adopt_dead_fraction": "Adopt only while the rows past the entry are at most this fraction of it...",
        "adopt_dead_min": "... or at most this many rows; a longer reply is compacted by one copy. The same "
                          "bound caps the room a prompt-end copy leaves for its reply.",
        "pool_clear": "Clear MLX's buffer pool after every prefill chunk, as stock does.",
        "pool_limit_gb": "The most freed memory (GB) MLX keeps for reuse (mx.set_cache_limit).",
        "pool_idle_s": "Release the pool after this many seconds without prefill work (0: never).",
    }),
    _Group("intake", "server_patch.intake.limits:IntakeLimits", _intake_names, {
        "max_body_bytes": "The largest inference request body (413 above); OpenAI's own payload cap.",
        "max_json_depth": "How deep a request's JSON may nest (400 deeper): stock's parser fails past ~1000.",
    }),
    _Group("admin", "server_patch.infra.guard:AdminLimits", _admin_names, {
        "max_event_streams": "Concurrent `/admin/events` streams; more get 429.",
        "max_body_bytes": "The largest request body on `/admin` and the management routes (413 above).",
    }),
)

_BY_NAME = {s.name: s for s in _SCALARS}


@functools.cache
def registry() -> tuple[Setting, ...]:
    """Every setting, by group then name."""
    every = [*_SCALARS, *(s for group in _GROUPS for s in group.settings())]
    return tuple(sorted(every, key=lambda s: (s.group, s.name)))


def setting(name: str) -> Setting:
    """The registered setting called ``name`` (a ``KeyError`` for an unknown one)."""
    found = _BY_NAME.get(name)
    if found is not None:
        return found
    for candidate in registry():
        if candidate.name == name:
            return candidate
    raise KeyError(f"{name} is not a registered setting (server_patch/settings.py)")


def value(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The value in force of setting ``name`` in ``env`` (default: this process's environment)."""
    return setting(name).read(env)


@dataclass(frozen=True)
class InForce:
    """A setting's value in force, where it came from, and why it could not be read (if so)."""

    setting: Setting
    value: Any
    source: str
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        s = self.setting
        value = "(set)" if (s.secret and self.value is not None) else self.value
        return {"name": s.name, "group": s.group, "type": str(s.type), "value": _jsonable(value),
                "shown": "" if self.error else (s.shown(self.value) if self.value is not None else s.default_shown),
                "source": self.source, "default": None if s.secret else _jsonable(s.default),
                "default_shown": s.default_shown, "error": self.error or None, "why": s.why}


def problems(env: Mapping[str, str], names: Any = None) -> list[str]:
    """Why each registered variable set in ``env`` (only ``names``, if given) cannot be read: the
    check ``apcctl config show``, ``serve`` and ``restart``'s plan make before a server runs
    with it, and that a running server reports (a reader that falls back on a bad value, as
    the journal does by turning itself off, would otherwise do so silently)."""
    out = []
    for s in registry():
        raw = env.get(s.name)
        if raw is None or not raw.strip() or (names is not None and s.name not in names):
            continue
        try:
            s.parse(raw)
        except ValueError as exc:
            out.append(str(exc))
    return out


def unknown(names: Any) -> list[str]:
    """``APC_*`` names in ``names`` that no setting (nor mlx-vlm's own cache) reads, each with
    the registered name it was probably meant to be: a typo would otherwise be ignored."""
    import difflib

    known = {s.name for s in registry()} | MLX_VLM_OWNED
    out = []
    for name in names:
        if name.startswith("APC_") and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
            out.append(f"{name} is not a setting" + (f" (did you mean {close[0]}?)" if close else "")
                       + "; apcctl config show --markdown lists them")
    return out


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def in_force(env: Mapping[str, str] | None = None, config: Mapping[str, str] | None = None) -> list[InForce]:
    """Every setting's value in ``env`` (this process's by default), with ``config`` (values a
    config file supplies where the environment sets none, as ``apcctl serve`` applies them).
    Derived defaults are computed by their readers from this process's environment."""
    env = os.environ if env is None else env
    out = []
    for s in registry():
        raw, source = env.get(s.name), ENV
        if (raw is None or not raw.strip()) and config and s.name in config:
            raw, source = config[s.name], CONFIG
        if raw is None or not raw.strip():
            out.append(InForce(s, _derived(s) if s.derive else s.default, DEFAULT))
            continue
        try:
            out.append(InForce(s, s.parse(raw), source))
        except ValueError as exc:
            out.append(InForce(s, None, source, str(exc)))
    return out


def _derived(s: Setting) -> Any:
    """The default a reader computes (a path under the state directory, say), as a string."""
    module_name, function = s.derive.split(":")
    try:
        return str(getattr(importlib.import_module(module_name), function)())
    except Exception:  # a default that cannot be computed here is shown as its description
        return None


def markdown() -> str:
    """docs/settings.md: every setting by group, with its type, default and why."""
    lines = [
        "# Settings",
        "",
        "Every `APC_*` environment variable the patched server and apcctl read, generated from the",
        "registry in `server_patch/settings.py` (`tests/test_settings.py` keeps this file equal to",
        "`apcctl config show --markdown`). `apcctl config show [--json]` prints the values in force and",
        "where each came from.",
        "",
        "Types: `bool` is 1/0, true/false, yes/no or on/off; `size` is bytes or a number with a binary",
        "unit (`64M`, `1.5G`, `48GiB`); `fraction` is `0.05` or `5%`; `list` is comma-separated. A bad",
        "value stops the server with a message naming the variable.",
        "",
        "Not listed: the `APC_*` variables of mlx-vlm 0.7.10's own prompt cache, which apcctl only",
        "sets for the stock server it compares against (" + ", ".join(f"`{n}`" for n in sorted(MLX_VLM_OWNED))
        + ").",
    ]
    group = None
    for s in registry():
        if s.group != group:
            group = s.group
            lines += ["", f"## {group}", "", "| variable | type | default | why | read by |",
                      "|---|---|---|---|---|"]
        kind = f"{s.type} ({'/'.join(s.choices)})" if s.choices else str(s.type)
        readers = ", ".join(f"`{r}`" for r in s.readers)
        lines.append(f"| `{s.name}` | {kind} | {s.default_shown} | {s.why.replace('|', '/')} | {readers} |")
    return "\n".join(lines) + "\n"
