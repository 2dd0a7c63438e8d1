"""Typed configuration of the router and its supervised workers.

One `Config` comes either from a TOML file (`dflashd serve --config FILE.toml`) or from command-line
flags (`dflashd serve --model M.gguf ...`, `dflashd router --bind ...`); both paths end in the same
dataclasses, validated once here, so the rest of the router never sees an unchecked value.

TOML layout (every key optional unless marked; unknown keys are errors, so typos do not pass):

    [server]
    host = "127.0.0.1"              # HTTP listener (llama-server's --host)
    port = 8080                     # (--port); 0 picks a free port
    api_keys = ["sk-..."]           # (--api-key); or
    api_key_file = "/etc/dflashd/api-keys"   # one key per line (--api-key-file)
    bind = "tcp://127.0.0.1:0"      # the workers' ZeroMQ socket; 0 = a free port
    n_predict = -1                  # cap on completion tokens per request (-1 = none; --n-predict)
    log_prompts = false             # log prompt text (debug only)
    admission_timeout_s = 30.0      # how long a request waits for a free healthy worker
    max_attempts = 3                # workers one request may be tried on
    max_inflight_per_worker = 2     # GENERATEs outstanding on one worker (the rest wait in the router)
    restart_backoff_s = 0.5         # first restart delay of a crashed worker (doubles per crash)
    restart_backoff_max_s = 30.0
    max_start_failures = 8          # crashes before ready in a row, then the worker is given up: failed

    [[models]]
    id = "qwen3.6-27b"              # the name clients send as "model" (default: the file's stem)
    path = "/models/qwen3.6-27b-q4_k_m.gguf"   # required: the router reads its metadata (template, tokenizer)
    draft = "/models/qwen3.6-27b-dflash.gguf"   # DFlash draft: GGUF, or a z-lab directory
    draft_max = 15                  # speculative defaults of its workers (--draft-max; 0 = off)
    draft_min = 0                   # (--draft-min)
    draft_margin = 0.0              # (--draft-margin; top-1 - top-2 draft probability, 0 = off)
    ctx_size = 32768                # (--ctx-size) per worker
    aliases = ["qwen"]
    sampling = { temperature = 0.0 }   # defaults for requests that do not say (llama-server names)
    devices = ["cuda:0", "hip:0"]   # one local worker per entry; [] = only remote workers
    # or, per worker:  [[models.workers]]  device = "cuda:1"  ctx_size = 8192  env = {..}  args = [..]
"""
from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from daemons.sampling import SamplingError, SamplingParams

__all__ = [
    "ConfigError", "WorkerSpec", "ModelSpec", "ServerConfig", "Config",
    "load_config", "parse_config", "read_api_key_file", "parse_device", "device_isolation", "check_draft_options",
    "DEFAULT_HOST", "DEFAULT_PORT",
]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
_DEVICE_RE = re.compile(r"(cpu)|(cuda|hip):([0-9]{1,3})")
_MODEL_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,255}")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ConfigError(ValueError):
    """A configuration file or flag that cannot be used; the message is one line naming the key."""


def parse_device(device: str) -> tuple[str, int | None]:
    """`cpu` -> ("cpu", None); `cuda:N` / `hip:N` -> (backend, N)."""
    m = _DEVICE_RE.fullmatch(device) if isinstance(device, str) else None
    if m is None:
        raise ConfigError(f"device {device!r} is not cpu, cuda:N or hip:N")
    if m.group(1):
        return "cpu", None
    return m.group(2), int(m.group(3))


def device_isolation(device: str) -> tuple[dict[str, str], str]:
    """(environment, device the worker is told) for a worker pinned to `device`.

    A GPU worker sees only its own device: `cuda:3` runs with CUDA_VISIBLE_DEVICES=3 and is told
    `cuda:0`, which is what that device is called inside the isolated process.  The other vendor's
    variable is emptied so a mixed CUDA + ROCm box cannot hand the worker the wrong kind of GPU; a
    CPU worker sees no GPU at all."""
    backend, index = parse_device(device)
    if backend == "cpu":
        return {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}, "cpu"
    if backend == "cuda":
        return {"CUDA_VISIBLE_DEVICES": str(index), "HIP_VISIBLE_DEVICES": ""}, "cuda:0"
    return {"HIP_VISIBLE_DEVICES": str(index), "ROCR_VISIBLE_DEVICES": str(index),
            "CUDA_VISIBLE_DEVICES": ""}, "hip:0"


@dataclass(frozen=True)
class WorkerSpec:
    device: str = "cpu"
    ctx_size: int | None = None  # None = the model's ctx_size
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment for this worker
    args: tuple[str, ...] = ()  # extra `dflashd worker` arguments


@dataclass(frozen=True)
class ModelSpec:
    id: str
    path: Path | None  # None only for models known from a worker's HELLO
    draft: Path | None = None
    # speculative defaults passed to the workers (None = the worker's own default)
    draft_max: int | None = None
    draft_min: int | None = None
    draft_margin: float | None = None
    ctx_size: int | None = None
    aliases: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    workers: tuple[WorkerSpec, ...] = ()


@dataclass(frozen=True)
class ServerConfig:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_keys: tuple[str, ...] = ()
    bind: str = "tcp://127.0.0.1:0"
    n_predict: int = -1
    log_prompts: bool = False
    admission_timeout_s: float = 30.0
    max_attempts: int = 3
    max_inflight_per_worker: int = 2
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 30.0
    max_start_failures: int = 8
    heartbeat_interval_s: float = 1.0
    heartbeat_liveness: int = 3
    max_body_bytes: int = 32 << 20


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    models: tuple[ModelSpec, ...] = ()

    def with_server(self, **changes: Any) -> "Config":
        return replace(self, server=replace(self.server, **changes))


# ---- validation helpers ---------------------------------------------------------------------------

def _check_keys(table: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _get(table: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = None) -> Any:
    if key not in table:
        return default
    value = table[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ConfigError(f"{where}.{key} must be {kinds[0].__name__}, got a boolean")
    if not isinstance(value, kinds):
        raise ConfigError(f"{where}.{key} must be {kinds[0].__name__}, got {type(value).__name__}")
    return value


def _positive_int(value: Any, where: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where} must be an integer >= {minimum}, got {value!r}")
    return value


def _positive_float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{where} must be a number > 0, got {value!r}")
    return float(value)


def _str_list(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} must be a list of strings")
    return tuple(value)


def check_model_id(model_id: str, where: str) -> str:
    if not isinstance(model_id, str) or not _MODEL_ID_RE.fullmatch(model_id):
        raise ConfigError(f"{where} {model_id!r} must match {_MODEL_ID_RE.pattern}")
    return model_id


def check_endpoint(endpoint: str, where: str = "bind") -> str:
    if not isinstance(endpoint, str) or not re.fullmatch(r"(tcp://[^\s/]+:[0-9]{1,5}|ipc://\S+|inproc://\S+)", endpoint):
        raise ConfigError(f"{where} {endpoint!r} is not a ZeroMQ endpoint (tcp://HOST:PORT or ipc://PATH)")
    return endpoint


def read_api_key_file(path: str | os.PathLike) -> tuple[str, ...]:
    """Keys from a file, one per line; blank lines and lines starting with # are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read API key file {os.fspath(path)}: {getattr(e, 'strerror', None) or e}") from None
    keys = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))
    if not keys:
        raise ConfigError(f"API key file {os.fspath(path)} holds no key")
    return keys


def _check_api_keys(keys: tuple[str, ...]) -> tuple[str, ...]:
    for k in keys:
        if not k or any(c.isspace() for c in k) or not k.isprintable():
            raise ConfigError("an API key must be printable text without spaces")
    return keys


def _sampling(table: Any, where: str) -> SamplingParams:
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    allowed = {"temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
               "frequency_penalty", "presence_penalty", "seed"}
    _check_keys(table, allowed, where)
    try:
        return SamplingParams.from_mapping(table)
    except (SamplingError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _resolve(path_text: Any, base: Path, where: str, *, must_exist: bool = True) -> Path:
    if not isinstance(path_text, str) or not path_text:
        raise ConfigError(f"{where} must be a non-empty string")
    p = Path(path_text).expanduser()
    if not p.is_absolute():
        p = base / p
    if must_exist and not p.is_file():
        raise ConfigError(f"{where}: no such file {p}")
    return p


def _worker(table: Any, where: str) -> WorkerSpec:
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    _check_keys(table, {"device", "ctx_size", "env", "args", "count"}, where)
    device = _get(table, "device", str, where, "cpu")
    try:
        parse_device(device)
    except ConfigError as e:
        raise ConfigError(f"{where}.device: {e}") from None
    ctx = table.get("ctx_size")
    if ctx is not None:
        _positive_int(ctx, f"{where}.ctx_size")
    env = _get(table, "env", dict, where, {})
    for k, v in env.items():
        if not _ENV_NAME_RE.fullmatch(k) or not isinstance(v, str):
            raise ConfigError(f"{where}.env: {k!r} must be a variable name with a string value")
    args = _str_list(table.get("args", []), f"{where}.args")
    return WorkerSpec(device=device, ctx_size=ctx, env=dict(env), args=args)


def _model(table: Any, where: str, base: Path) -> ModelSpec:
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    _check_keys(table, {"id", "path", "draft", "draft_max", "draft_min", "draft_margin", "ctx_size", "aliases",
                        "sampling", "devices", "workers"}, where)
    if "path" not in table:
        raise ConfigError(f"{where}.path is required (the router reads the model's chat template and tokenizer)")
    path = _resolve(table["path"], base, f"{where}.path")
    draft = _resolve_draft(table["draft"], base, f"{where}.draft") if "draft" in table else None
    draft_max, draft_min, draft_margin = check_draft_options(
        draft, table.get("draft_max"), table.get("draft_min"), table.get("draft_margin"), f"{where}.")
    model_id = check_model_id(_get(table, "id", str, where, path.stem), f"{where}.id")
    ctx = table.get("ctx_size")
    if ctx is not None:
        _positive_int(ctx, f"{where}.ctx_size")
    aliases = tuple(check_model_id(a, f"{where}.aliases[]") for a in _str_list(table.get("aliases", []), f"{where}.aliases"))
    sampling = _sampling(table["sampling"], f"{where}.sampling") if "sampling" in table else SamplingParams()
    if "devices" in table and "workers" in table:
        raise ConfigError(f"{where}: give either devices or [[models.workers]], not both")
    workers: list[WorkerSpec] = []
    if "devices" in table:
        for i, d in enumerate(_str_list(table["devices"], f"{where}.devices")):
            workers.append(_worker({"device": d}, f"{where}.devices[{i}]"))
    elif "workers" in table:
        if not isinstance(table["workers"], list):
            raise ConfigError(f"{where}.workers must be an array of tables")
        for i, w in enumerate(table["workers"]):
            spec = _worker(w, f"{where}.workers[{i}]")
            count = _positive_int(w.get("count", 1), f"{where}.workers[{i}].count")
            workers.extend([spec] * count)
    else:
        workers.append(WorkerSpec())
    return ModelSpec(id=model_id, path=path, draft=draft, draft_max=draft_max, draft_min=draft_min,
                     draft_margin=draft_margin, ctx_size=ctx, aliases=aliases, sampling=sampling,
                     workers=tuple(workers))


def _resolve_draft(path_text: Any, base: Path, where: str) -> Path:
    """A draft path: a GGUF file or a z-lab directory (config.json + safetensors)."""
    p = _resolve(path_text, base, where, must_exist=False)
    if not (p.is_file() or (p.is_dir() and (p / "config.json").is_file())):
        raise ConfigError(f"{where}: no draft at {p} (a GGUF file or a directory holding config.json)")
    return p


def check_draft_options(draft: Path | None, draft_max: Any, draft_min: Any, draft_margin: Any,
                        prefix: str = "") -> tuple[int | None, int | None, float | None]:
    """Validate a model's speculative defaults (TOML keys or --draft-* flags; None = not given)."""
    if draft_max is not None:
        if isinstance(draft_max, bool) or not isinstance(draft_max, int) or not 0 <= draft_max <= 256:
            raise ConfigError(f"{prefix}draft_max must be an integer in 0..256 (0 = no speculation), got {draft_max!r}")
    if draft_min is not None:
        if isinstance(draft_min, bool) or not isinstance(draft_min, int) or not 0 <= draft_min <= 256:
            raise ConfigError(f"{prefix}draft_min must be an integer in 0..256, got {draft_min!r}")
    if draft_margin is not None:
        if isinstance(draft_margin, bool) or not isinstance(draft_margin, (int, float)) \
                or not math.isfinite(draft_margin) or not 0.0 <= draft_margin <= 1.0:
            raise ConfigError(f"{prefix}draft_margin must be a number in [0, 1] (0 = off), got {draft_margin!r}")
        draft_margin = float(draft_margin)
    if draft_max is not None and draft_min is not None and draft_min > draft_max:
        raise ConfigError(f"{prefix}draft_min {draft_min} exceeds {prefix}draft_max {draft_max}")
    if draft is None and any(v is not None for v in (draft_max, draft_min, draft_margin)):
        raise ConfigError(f"{prefix}draft_max, {prefix}draft_min and {prefix}draft_margin need {prefix}draft")
    return draft_max, draft_min, draft_margin


def _server(table: Any, base: Path) -> ServerConfig:
    where = "server"
    if not isinstance(table, dict):
        raise ConfigError("[server] must be a table")
    allowed = {f for f in ServerConfig.__dataclass_fields__} | {"api_key_file"}
    _check_keys(table, allowed, where)
    s = ServerConfig()
    changes: dict[str, Any] = {}
    if "host" in table:
        changes["host"] = _get(table, "host", str, where)
    if "port" in table:
        port = _get(table, "port", int, where)
        if not 0 <= port <= 65535:
            raise ConfigError(f"server.port must be in 0..65535, got {port}")
        changes["port"] = port
    keys: tuple[str, ...] = ()
    if "api_keys" in table:
        keys += _str_list(table["api_keys"], "server.api_keys")
    if "api_key_file" in table:
        keys += read_api_key_file(_resolve(table["api_key_file"], base, "server.api_key_file"))
    changes["api_keys"] = _check_api_keys(keys)
    if "bind" in table:
        changes["bind"] = check_endpoint(table["bind"], "server.bind")
    if "n_predict" in table:
        n = _get(table, "n_predict", int, where)
        if n < -1 or n == 0:
            raise ConfigError(f"server.n_predict must be -1 (no cap) or >= 1, got {n}")
        changes["n_predict"] = n
    if "log_prompts" in table:
        changes["log_prompts"] = _get(table, "log_prompts", bool, where)
    for name in ("admission_timeout_s", "restart_backoff_s", "restart_backoff_max_s", "heartbeat_interval_s"):
        if name in table:
            changes[name] = _positive_float(table[name], f"server.{name}")
    for name in ("max_attempts", "max_inflight_per_worker", "max_start_failures", "heartbeat_liveness",
                 "max_body_bytes"):
        if name in table:
            changes[name] = _positive_int(table[name], f"server.{name}")
    return replace(s, **changes)


def parse_config(data: Mapping[str, Any], base: Path = Path(".")) -> Config:
    """Validate a decoded TOML document; relative paths are resolved against `base`."""
    _check_keys(data, {"server", "models"}, "config")
    server = _server(data.get("server", {}), base)
    raw_models = data.get("models", [])
    if not isinstance(raw_models, list):
        raise ConfigError("models must be an array of tables ([[models]])")
    models = tuple(_model(m, f"models[{i}]", base) for i, m in enumerate(raw_models))
    check_unique_names(models)
    return Config(server=server, models=models)


def check_unique_names(models: tuple[ModelSpec, ...]) -> None:
    seen: dict[str, str] = {}
    for m in models:
        for name in (m.id, *m.aliases):
            if name in seen:
                raise ConfigError(f"model name {name!r} is used twice (by {seen[name]} and {m.id})")
            seen[name] = m.id


def load_config(path: str | os.PathLike) -> Config:
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config {p}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    try:
        return parse_config(data, base=p.resolve().parent)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
