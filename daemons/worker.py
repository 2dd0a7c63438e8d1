"""The worker core shared by every architecture and both transports.

A worker serves one model on one device.  This module holds everything that does not depend on how
messages travel (``worker_zmq``: framed ZeroMQ; ``worker_stdio``: the reference's stdin/stream-fd
lines) or on the architecture (``ModelRuntime`` adapts a model; ``Qwen35Runtime`` is the qwen35 one):

- ``WorkerConfig``: the typed configuration (built from ``dflashd worker`` flags; no environment
  variables).
- ``WorkerCore``: a FIFO of router messages run by one compute loop (``run``), one model step at a
  time.  CANCEL, STATS and SHUTDOWN act at once from the transport's I/O thread (``submit``); the
  compute loop checks for cancellation before every prefill chunk and every decode step, so a
  running generation stops within one step.  Replies leave through ``sink(message)``, a callable the
  transport provides (it must be thread-safe: the I/O thread and the compute loop both call it).
- Snapshot slots: the full state at a prefix (KV cache, conv and DeltaNet state, ``n_past``, the
  sampler's RNG position) copied into numbered slots in host memory under a byte budget.
- PARK / UNPARK: drop every reference to the weights (the qwen35 model memory-maps its GGUF, so the
  pages go when the map goes), measure the released resident memory with psutil; reload on UNPARK.

Prefill schedule (why snapshots restore exactly).  The prompt is prefilled in pieces cut at absolute
multiples of ``prefill_chunk`` and, when a snapshot is saved, at the save position; the last prompt
token always goes through the decode loop (``ModelRuntime.decode``).  A run restored from a slot at
position P therefore executes exactly the model calls the saving run executed after P, and yields
bit-identical tokens; a slot saved at a chunk boundary also reproduces a run that saved nothing.
"""
from __future__ import annotations

import abc
import hashlib
import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import numpy as np

from daemons import memory
from daemons.generate import GenerationEvent, GenerationRequest, generate
from daemons.sampling import Sampler, SamplingParams
from protocol.messages import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_LIVENESS,
    MAX_CONTEXT,
    MAX_SLOTS,
    PROTOCOL_VERSION,
    WORKER_ID_RE,
    Cancel,
    Capacity,
    Done,
    ErrorCode,
    ErrorMessage,
    FinishReason,
    FreeSnapshot,
    Generate,
    Heartbeat,
    Hello,
    ListSlots,
    Load,
    Message,
    Park,
    Parked,
    ParkTarget,
    Restore,
    Shutdown,
    SlotInfo,
    Slots,
    Snapshot,
    Stats,
    StatsReply,
    Timings,
    Tokens,
    Unpark,
    Unparked,
    Usage,
    one_line,
)

__all__ = [
    "WorkerConfig", "WorkerConfigError", "WorkerStartupError", "RequestFailed",
    "ModelRuntime", "Qwen35Runtime", "RUNTIMES", "create_runtime", "model_fingerprint",
    "default_worker_id", "WorkerCore", "SnapshotSlot", "CancelReport",
]

log = logging.getLogger("dflashd.worker")

DEFAULT_CTX_SIZE = 4096
DEFAULT_SNAPSHOT_BUDGET = 1 << 30
DEFAULT_PREFILL_CHUNK = 512
DEFAULT_MAX_QUEUED = 16
DEFAULT_STALL_TIMEOUT_S = 300.0


class WorkerConfigError(ValueError):
    """A worker setting is invalid (one line, for the CLI)."""


class WorkerStartupError(RuntimeError):
    """The worker could not start serving (model failed to load, device unusable, ...).
    ``code`` is the ErrorCode a WORKER_DEAD frame carries."""

    def __init__(self, code: ErrorCode, message: str):
        self.code = ErrorCode(code)
        super().__init__(one_line(message, 1000))


class RequestFailed(Exception):
    """A request (or control command) fails with an ERROR reply carrying ``code``."""

    def __init__(self, code: ErrorCode, message: str):
        self.code = ErrorCode(code)
        self.message = one_line(message)
        super().__init__(f"{self.code.value}: {self.message}")


class _Cancelled(Exception):
    """Raised inside the compute loop when the running request was cancelled during prefill."""


# ---- configuration ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs to start.  Built from CLI flags (``daemons.worker_cli``)."""

    model_path: str
    device: str = "cpu"
    draft_path: str | None = None
    n_ctx: int = DEFAULT_CTX_SIZE  # tokens one sequence may hold; 0 = the model's trained context
    n_snapshot_slots: int = MAX_SLOTS  # snapshot slots offered (slot numbers 0..n-1)
    snapshot_budget_bytes: int = DEFAULT_SNAPSHOT_BUDGET  # host memory all snapshots may hold
    worker_id: str | None = None  # None: "<arch>-<device>@<host>"
    model_alias: str | None = None  # model_id in HELLO; None: the file name without .gguf
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    heartbeat_liveness: int = HEARTBEAT_LIVENESS
    # A compute step running longer than this is a hung worker: it reports WORKER_DEAD and exits
    # (its I/O thread would otherwise keep heartbeating for a loop that never comes back).  0 = off.
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    max_queued: int = DEFAULT_MAX_QUEUED  # GENERATEs waiting behind the running one; more -> busy
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens per model call (llama's --batch-size)

    def __post_init__(self) -> None:
        def bad(msg: str) -> WorkerConfigError:
            return WorkerConfigError(msg)

        if not isinstance(self.model_path, str) or not self.model_path:
            raise bad("a model path is required")
        if not isinstance(self.device, str) or not _valid_device(self.device):
            raise bad(f"device must be cpu, cuda:N or hip:N, got {self.device!r}")
        if not isinstance(self.n_ctx, int) or not 0 <= self.n_ctx <= MAX_CONTEXT:
            raise bad(f"context size must be in 0..{MAX_CONTEXT} (0 = the model's), got {self.n_ctx!r}")
        if not isinstance(self.n_snapshot_slots, int) or not 0 <= self.n_snapshot_slots <= MAX_SLOTS:
            raise bad(f"snapshot slots must be in 0..{MAX_SLOTS}, got {self.n_snapshot_slots!r}")
        if not isinstance(self.snapshot_budget_bytes, int) or self.snapshot_budget_bytes < 0:
            raise bad(f"snapshot budget must be a non-negative byte count, got {self.snapshot_budget_bytes!r}")
        if self.worker_id is not None and not WORKER_ID_RE.fullmatch(self.worker_id):
            raise bad(f"worker id {self.worker_id!r} must match {WORKER_ID_RE.pattern}")
        if self.model_alias is not None and not 1 <= len(self.model_alias) <= 256:
            raise bad("model alias must hold 1..256 characters")
        if not self.heartbeat_interval_s > 0 or self.heartbeat_interval_s > 3600:
            raise bad(f"heartbeat interval must be in (0, 3600] seconds, got {self.heartbeat_interval_s!r}")
        if not isinstance(self.heartbeat_liveness, int) or not 1 <= self.heartbeat_liveness <= 1000:
            raise bad(f"heartbeat liveness must be in 1..1000, got {self.heartbeat_liveness!r}")
        if not self.stall_timeout_s >= 0:
            raise bad(f"stall timeout must be >= 0 seconds (0 = off), got {self.stall_timeout_s!r}")
        if not isinstance(self.max_queued, int) or not 0 <= self.max_queued <= 100_000:
            raise bad(f"queue size must be in 0..100000, got {self.max_queued!r}")
        if not isinstance(self.prefill_chunk, int) or not 1 <= self.prefill_chunk <= 65536:
            raise bad(f"prefill chunk (batch size) must be in 1..65536, got {self.prefill_chunk!r}")

    @property
    def backend_name(self) -> str:
        return self.device.split(":")[0]


def _valid_device(device: str) -> bool:
    import re
    return re.fullmatch(r"cpu|(?:cuda|hip):[0-9]{1,3}", device) is not None


def default_worker_id(architecture: str, device: str, hostname: str | None = None) -> str:
    """``<arch>-<device>@<host>`` reduced to the characters a worker id allows (64 at most)."""
    import re
    host = hostname if hostname is not None else socket.gethostname()
    raw = f"{architecture}-{device.replace(':', '')}@{host}"
    clean = re.sub(r"[^A-Za-z0-9._:@/+-]", "-", raw)
    if not clean[:1].isalnum():
        clean = "w" + clean
    return clean[:64]


def model_fingerprint(path: str, block: int = 64 << 10, n_blocks: int = 64) -> str:
    """A fingerprint of a weights file: SHA-256 of its size, its first 16 MiB (header, metadata,
    tensor index) and ``n_blocks`` evenly spaced blocks plus the last one.  Reading a 15 GB file
    whole would cost tens of seconds per start; this costs a few milliseconds and still changes with
    any re-quantisation, conversion or truncation.  Files up to 64 MiB are hashed whole."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= 64 << 20:
            while chunk := f.read(1 << 20):
                h.update(chunk)
            return "sha256:" + h.hexdigest()
        h.update(f.read(16 << 20))
        for i in range(n_blocks + 1):
            f.seek(max(0, (size - block) * i // n_blocks))
            h.update(f.read(block))
    return "sha256-sampled:" + h.hexdigest()


# ---- model runtimes --------------------------------------------------------------------------------

class ModelRuntime(abc.ABC):
    """One architecture's model behind the core: loading, parking, states and the generation call.

    The core needs from a model only the generic API (``new_state``, ``prefill``, ``forward``,
    ``state.n_past``, host snapshots); what differs per architecture (how to empty a state in
    place, how big a snapshot is) is implemented by a subclass.
    """

    architecture: str = ""

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.path = config.model_path
        self.model: Any = None
        self.tokenizer: Any = None
        self.backend: Any = None
        self.model_hash = ""
        self.weight_bytes = 0
        self.context_length = 0  # the model's trained context (0 = not stated)

    # -- loading -----------------------------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return self.model is not None

    def load(self) -> None:
        """Load the weights (and, the first time, the tokenizer and backend).  Raises
        WorkerStartupError(adapter_unavailable) when the file cannot be used."""
        from daemons.gguf_reader import GGUFError
        from daemons.tokenizer import Tokenizer, TokenizerError
        from kernels.backend import BackendError

        try:
            fingerprint = model_fingerprint(self.path)
        except OSError as e:
            raise WorkerStartupError(ErrorCode.ADAPTER_UNAVAILABLE, f"{self.path}: {e.strerror or e}") from None
        if self.model_hash and fingerprint != self.model_hash:
            # Snapshots and the current state belong to the weights that made them.
            raise WorkerStartupError(ErrorCode.ADAPTER_UNAVAILABLE,
                                     f"{self.path} changed on disk while parked; restart the worker to serve it")
        try:
            if self.backend is None:
                from kernels import get_backend
                self.backend = get_backend(self.config.device)
            model = self._load_model(self.path, self.backend)
            if self.tokenizer is None:
                self.tokenizer = Tokenizer.from_metadata(model.metadata, source=self.path)
        except (GGUFError, TokenizerError, BackendError, OSError, ValueError) as e:
            raise WorkerStartupError(ErrorCode.ADAPTER_UNAVAILABLE, str(e)) from None
        except MemoryError:
            raise WorkerStartupError(ErrorCode.OUT_OF_MEMORY, f"{self.path}: out of memory loading the weights") from None
        self._after_load(model)
        self.model = model
        self.model_hash = fingerprint

    def unload(self) -> None:
        """Drop every reference this runtime holds to the weights.  The caller collects garbage
        and measures."""
        model, self.model = self.model, None
        if model is not None:
            self._close_model(model)
        del model

    @abc.abstractmethod
    def _load_model(self, path: str, backend: Any) -> Any:
        """The loaded model object (``new_state``/``prefill``/``forward``)."""

    def _after_load(self, model: Any) -> None:
        """Record what the runtime keeps while parked (hyperparameters, sizes)."""

    def _close_model(self, model: Any) -> None:
        """Release what the model holds beyond Python references (e.g. close its file map)."""

    # -- states ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def new_state(self, n_ctx: int) -> Any:
        """An empty state for up to ``n_ctx`` tokens; must work while parked."""

    @abc.abstractmethod
    def reset_state(self, state: Any) -> None:
        """Empty ``state`` in place (n_past = 0) without reallocating its buffers."""

    @abc.abstractmethod
    def state_nbytes(self, n_ctx: int) -> int:
        """Device bytes of a state for ``n_ctx`` tokens."""

    @abc.abstractmethod
    def snapshot_nbytes(self, n_tokens: int) -> int:
        """Host bytes ``state_to_host`` produces for a state holding ``n_tokens``."""

    def state_to_host(self, state: Any) -> dict[str, np.ndarray]:
        return state.to_host()

    def state_from_host(self, state: Any, snapshot: dict[str, np.ndarray]) -> None:
        state.from_host(snapshot)

    @property
    def n_vocab(self) -> int:
        return int(self.model.n_vocab)

    # -- running -----------------------------------------------------------------------------------
    def prefill(self, ids: np.ndarray, state: Any) -> None:
        """Advance ``state`` by ``ids`` (one model call; nobody reads the logits)."""
        self.model.prefill(ids, state, chunk=max(len(ids), 1), logits="none")

    def decode(self, request: GenerationRequest, state: Any, *, n_cached: int, sampler: Sampler,
               should_stop: Callable[[], bool]) -> Iterator[GenerationEvent]:
        """THE generation call of the worker: every decode goes through here, so speculative
        decoding (a draft model) replaces this one method.  ``state`` holds ``n_cached`` prompt
        tokens; the rest of the prompt (at least its last token) is prefilled inside."""
        return generate(self.model, self.tokenizer, request, state, n_cached=n_cached,
                        should_stop=should_stop, sampler=sampler)


class Qwen35Runtime(ModelRuntime):
    """The qwen35 worker: ``daemons.qwen35.Qwen35Model`` (weights memory-mapped from the GGUF)."""

    architecture = "qwen35"

    def __init__(self, config: WorkerConfig):
        super().__init__(config)
        self.hparams: Any = None

    def _load_model(self, path: str, backend: Any) -> Any:
        from daemons.qwen35 import Qwen35Model
        return Qwen35Model.load(path, backend)

    def _after_load(self, model: Any) -> None:
        if self.hparams is not None and model.hparams != self.hparams:
            raise WorkerStartupError(ErrorCode.ADAPTER_UNAVAILABLE,
                                     f"{self.path}: reloaded weights have other hyperparameters")
        self.hparams = model.hparams
        self.weight_bytes = int(model.weight_nbytes())
        self.context_length = int(model.hparams.context_length)

    def _close_model(self, model: Any) -> None:
        # Tensor views into the map keep it alive until the model object is garbage; closing first
        # releases it right away when nothing else holds a view.
        model.layers = []
        model.token_embd = model.output = None
        model.gguf.tensors = {}
        model.gguf.close()

    def new_state(self, n_ctx: int) -> Any:
        from daemons.qwen35 import Qwen35State
        return Qwen35State(self.hparams, self.backend, n_ctx)

    def reset_state(self, state: Any) -> None:
        # KV rows at or past n_past are never read (attention reads rows [0, n_past + T) and this
        # sequence writes them first); the recurrent states are read whole, so they are zeroed.
        for arr in state.conv.values():
            arr[...] = 0
        for arr in state.ssm.values():
            arr[...] = 0
        state.n_past = 0

    @property
    def n_vocab(self) -> int:
        return int(self.hparams.n_vocab)

    def _per_token_kv_bytes(self) -> int:
        hp = self.hparams
        return 2 * len(hp.attention_layers) * hp.n_head_kv * hp.head_dim * 4

    def _recurrent_bytes(self) -> int:
        hp = self.hparams
        per_layer = (hp.conv_kernel - 1) * hp.conv_channels * 4 + hp.ssm_n_v_heads * hp.d_k * hp.d_v * 4
        return len(hp.deltanet_layers) * per_layer

    def state_nbytes(self, n_ctx: int) -> int:
        return self._per_token_kv_bytes() * n_ctx + self._recurrent_bytes()

    def snapshot_nbytes(self, n_tokens: int) -> int:
        return self._per_token_kv_bytes() * n_tokens + self._recurrent_bytes() + 8  # + n_past


RUNTIMES: dict[str, type[ModelRuntime]] = {"qwen35": Qwen35Runtime}


def create_runtime(config: WorkerConfig) -> ModelRuntime:
    """The runtime for the model file's architecture (WorkerStartupError if none serves it)."""
    from daemons.architectures import lookup
    from daemons.gguf_reader import GGUFError, GGUFFile

    try:
        with GGUFFile(config.model_path) as g:
            arch = lookup(g).name
    except GGUFError as e:
        raise WorkerStartupError(ErrorCode.ADAPTER_UNAVAILABLE, str(e)) from None
    cls = RUNTIMES.get(arch)
    if cls is None:
        raise WorkerStartupError(ErrorCode.ADAPTER_UNAVAILABLE,
                                 f"{config.model_path}: no worker serves architecture '{arch}' yet "
                                 f"(served: {', '.join(sorted(RUNTIMES))})")
    return cls(config)


# ---- the core --------------------------------------------------------------------------------------

@dataclass
class SnapshotSlot:
    """A saved state: it covers ``tokens`` (int32), holds ``state`` (host arrays) and the sampler's
    RNG position (``sampler_state``) for the sampling settings that produced it."""

    tokens: np.ndarray
    state: dict[str, np.ndarray]
    sampler_state: dict[str, Any] | None
    sampling: SamplingParams | None
    nbytes: int


@dataclass
class CancelReport:
    """How fast a cancellation took effect: tokens the request had committed when CANCEL arrived,
    tokens it ended with, and model steps it began after the CANCEL (the bound is 'within one
    step': the step running when it arrived finishes, no new one starts)."""

    request_id: str
    tokens_at_cancel: int
    tokens_final: int
    steps_after_cancel: int


@dataclass
class _Active:
    request_id: str
    cancelled: bool = False
    tokens: int = 0  # completion tokens committed so far
    steps: int = 0  # model calls begun (prefill chunks + decode steps)
    tokens_at_cancel: int = 0
    steps_at_cancel: int = 0


@dataclass
class _Counters:
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


_CONTROL = (Snapshot, Restore, FreeSnapshot, ListSlots, Park, Unpark)
_QUEUED = (Generate,) + _CONTROL


class WorkerCore:
    """The architecture- and transport-independent worker (see the module docstring).

    Thread model: the transport's I/O thread calls ``submit`` (and ``heartbeat``/``stats``); one
    compute thread calls ``run``.  ``sink`` is called from both and must be thread-safe.
    """

    def __init__(self, config: WorkerConfig, runtime: ModelRuntime, sink: Callable[[Message], None]):
        self.config = config
        self.runtime = runtime
        self.sink = sink
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[Message] = deque()
        self._queued_generates = 0
        self._active: _Active | None = None
        self._accepting = True
        self._stopping = False  # shutdown requested: run() returns once the queue is empty
        self._counters = _Counters()
        self._slots: dict[int, SnapshotSlot] = {}
        self._state: Any = None  # the working (device) state; also the "current state"
        self._current_tokens: np.ndarray | None = None  # tokens the current state covers; None = none
        self._current_sampler: dict[str, Any] | None = None
        self._current_sampling: SamplingParams | None = None
        self.n_ctx = 0
        self.worker_id = config.worker_id or ""
        self.last_cancel: CancelReport | None = None
        # Progress of the compute loop, read by the stall watchdog (monotonic seconds; None = idle).
        self.busy_since: float | None = None
        self._hb_seq = 0

    # -- start ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Load the model and allocate the working state (WorkerStartupError on failure)."""
        rt = self.runtime
        rt.load()
        n_ctx = self.config.n_ctx or rt.context_length or DEFAULT_CTX_SIZE
        self.n_ctx = min(int(n_ctx), MAX_CONTEXT)
        if not self.worker_id:
            self.worker_id = default_worker_id(rt.architecture, self.config.device)
        try:
            self._state = rt.new_state(self.n_ctx)
        except MemoryError:
            raise WorkerStartupError(ErrorCode.OUT_OF_MEMORY,
                                     f"no memory for a {self.n_ctx}-token state "
                                     f"({rt.state_nbytes(self.n_ctx)} bytes); lower --ctx-size") from None
        log.info("loaded %s (%s, %.1f MiB of weights) on %s; context %d, %d snapshot slots, budget %d bytes",
                 rt.path, rt.architecture, rt.weight_bytes / 2**20, self.config.device, self.n_ctx,
                 self.config.n_snapshot_slots, self.config.snapshot_budget_bytes)

    @property
    def model_id(self) -> str:
        if self.config.model_alias:
            return self.config.model_alias
        name = os.path.basename(self.runtime.path)
        return (name[:-5] if name.lower().endswith(".gguf") else name)[:256] or "model"

    def hello(self) -> Hello:
        rt = self.runtime
        return Hello(
            worker_id=self.worker_id, protocol_version=PROTOCOL_VERSION, architecture=rt.architecture,
            model_id=self.model_id, model_hash=rt.model_hash, backend=self.config.backend_name,
            device=self.config.device,
            capacity=Capacity(n_ctx=self.n_ctx, n_slots=self.config.n_snapshot_slots,
                              snapshot_bytes=self.config.snapshot_budget_bytes,
                              memory_bytes=rt.weight_bytes + rt.state_nbytes(self.n_ctx)),
            pid=os.getpid(), hostname=socket.gethostname()[:255] or None)

    # -- I/O-thread entry points ------------------------------------------------------------------
    def submit(self, msg: Message) -> None:
        """Take one decoded router message.  CANCEL, STATS and SHUTDOWN act now; GENERATE and the
        slot/park commands join the FIFO (a full queue answers GENERATE with ERROR busy)."""
        if isinstance(msg, Cancel):
            self.cancel(msg.request_id)
        elif isinstance(msg, Stats):
            self.sink(self.stats(msg.request_id))
        elif isinstance(msg, Shutdown):
            self.shutdown(drain=msg.drain)
        elif isinstance(msg, _QUEUED):
            self._enqueue(msg)
        else:  # HEARTBEAT / ERROR from the router are the transport's business
            log.debug("core ignores %s", msg.TYPE)

    def _enqueue(self, msg: Message) -> None:
        rid = getattr(msg, "request_id", None)
        reply: Message | None = None
        with self._lock:
            if not self._accepting:
                reply = ErrorMessage.make(ErrorCode.BUSY, "worker is shutting down", rid)
            elif isinstance(msg, Generate):
                if self._known_request(msg.request_id):
                    # Answering with this id would end the request already running under it.
                    reply = ErrorMessage.make(ErrorCode.BAD_MESSAGE,
                                              f"request_id {msg.request_id!r} is already active or queued")
                elif self._queued_generates >= self.config.max_queued:
                    reply = ErrorMessage.make(ErrorCode.BUSY,
                                              f"queue full ({self.config.max_queued} requests waiting)", rid)
                else:
                    self._queued_generates += 1
            if reply is None:
                self._queue.append(msg)
                self._wake.notify()
        if reply is not None:
            self.sink(reply)

    def _known_request(self, rid: str) -> bool:
        if self._active is not None and self._active.request_id == rid:
            return True
        return any(isinstance(m, Generate) and m.request_id == rid for m in self._queue)

    def cancel(self, request_id: str) -> bool:
        """Cancel a queued (dropped now, DONE cancelled) or running (stops before its next model
        step) request.  Unknown ids are ignored.  Returns whether the id was found."""
        dropped: Generate | None = None
        with self._lock:
            active = self._active
            if active is not None and active.request_id == request_id:
                if not active.cancelled:
                    active.cancelled = True
                    active.tokens_at_cancel = active.tokens
                    active.steps_at_cancel = active.steps
                return True
            for m in self._queue:
                if isinstance(m, Generate) and m.request_id == request_id:
                    dropped = m
                    break
            if dropped is not None:
                self._queue.remove(dropped)
                self._queued_generates -= 1
                self._counters.completed += 1
        if dropped is None:
            return False
        n_prompt = int(dropped.prompt_ids.shape[0]) if dropped.prompt_ids is not None else 0
        self.sink(_done(request_id, FinishReason.CANCELLED, n_prompt, 0, 0))
        return True

    def active_request(self) -> str | None:
        with self._lock:
            return self._active.request_id if self._active is not None else None

    def cancel_all(self) -> int:
        """Cancel the running and every queued GENERATE (e.g. the router went silent)."""
        with self._lock:
            ids = [m.request_id for m in self._queue if isinstance(m, Generate)]
            if self._active is not None:
                ids.append(self._active.request_id)
        return sum(self.cancel(r) for r in ids)

    def shutdown(self, drain: bool = True) -> None:
        """Stop accepting work; without ``drain`` cancel everything.  ``run`` returns when idle."""
        aborted: list[Message] = []
        with self._lock:
            self._accepting = False
            self._stopping = True
            if not drain:
                aborted = [m for m in self._queue if not isinstance(m, Generate)]
                for m in aborted:
                    self._queue.remove(m)
            self._wake.notify_all()
        if not drain:
            self.cancel_all()
            for m in aborted:
                self.sink(ErrorMessage.make(ErrorCode.CANCELLED, "worker shut down before this command ran",
                                            getattr(m, "request_id", None)))

    def load(self) -> Load:
        with self._lock:
            return Load(active=int(self._active is not None), queued=len(self._queue))

    def heartbeat(self) -> Heartbeat:
        self._hb_seq += 1
        return Heartbeat(worker_id=self.worker_id, seq=self._hb_seq, time=time.time(), load=self.load())

    def parked_targets(self) -> tuple[ParkTarget, ...]:
        return () if self.runtime.loaded else (ParkTarget.TARGET,)

    def stats(self, request_id: str | None = None) -> StatsReply:
        with self._lock:
            c = replace(self._counters)
            active = int(self._active is not None)
            queued = len(self._queue)
        return StatsReply(
            worker_id=self.worker_id, uptime_s=time.monotonic() - self.started,
            requests_completed=c.completed, requests_failed=c.failed, active=active, queued=queued,
            prompt_tokens_total=c.prompt_tokens, completion_tokens_total=c.completion_tokens,
            parked=self.parked_targets(), rss_bytes=memory.rss_bytes(),
            snapshot_bytes_used=self.snapshot_bytes_used(), request_id=request_id)

    def snapshot_bytes_used(self) -> int:
        return sum(s.nbytes for s in list(self._slots.values()))

    # -- the compute loop ---------------------------------------------------------------------------
    def run(self) -> None:
        """Serve the queue until ``shutdown`` and the queue is empty."""
        while self.run_one(timeout=None):
            pass

    def run_one(self, timeout: float | None = 0.0) -> bool:
        """Run the next queued message (waiting up to ``timeout`` seconds, None = forever).
        Returns False once shut down and idle."""
        with self._lock:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._queue:
                if self._stopping:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return True
                self._wake.wait(left)
            msg = self._queue.popleft()
            if isinstance(msg, Generate):
                self._queued_generates -= 1
                self._active = _Active(msg.request_id)
        self.busy_since = time.monotonic()
        try:
            if isinstance(msg, Generate):
                self._run_generate(msg)
            else:
                self._run_control(msg)
        finally:
            self.busy_since = None
            with self._lock:
                self._active = None
        return True

    def _progress(self) -> None:
        self.busy_since = time.monotonic()

    # -- GENERATE -------------------------------------------------------------------------------
    def _fail(self, rid: str, code: ErrorCode, message: str) -> None:
        with self._lock:
            self._counters.failed += 1
        self._drop_current()
        self.sink(ErrorMessage.make(code, message, rid))

    def _drop_current(self) -> None:
        self._current_tokens = None
        self._current_sampler = None
        self._current_sampling = None

    def _run_generate(self, msg: Generate) -> None:
        rid = msg.request_id
        try:
            self._generate(msg)
        except RequestFailed as e:
            self._fail(rid, e.code, e.message)
        except MemoryError:
            self._fail(rid, ErrorCode.OUT_OF_MEMORY, "out of memory while generating")
        except Exception as e:  # a bug or a backend failure: this request fails, the worker serves on
            log.exception("request %s failed", rid)
            self._fail(rid, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")

    def _prompt_ids(self, msg: Generate) -> np.ndarray:
        if msg.prompt_ids is not None:
            ids = np.array(msg.prompt_ids, dtype=np.int32)  # own copy: the wire view pins the frame
        else:
            ids = np.asarray(self.runtime.tokenizer.encode(msg.prompt_text, add_special=True, parse_special=True),
                             dtype=np.int32)
        if ids.size == 0:
            raise RequestFailed(ErrorCode.EMPTY_PROMPT, "the prompt has no tokens")
        n_vocab = self.runtime.n_vocab
        if int(ids.max()) >= n_vocab:
            raise RequestFailed(ErrorCode.BAD_MESSAGE,
                                f"prompt token id {int(ids.max())} is outside the vocabulary (0..{n_vocab - 1})")
        return ids

    def _slot_number(self, slot: int) -> int:
        if not 0 <= slot < self.config.n_snapshot_slots:
            raise RequestFailed(ErrorCode.INVALID_SNAPSHOT_SLOT,
                                f"slot {slot} is outside 0..{self.config.n_snapshot_slots - 1} offered by this worker")
        return slot

    def _check_budget(self, slot: int, nbytes: int) -> None:
        others = sum(s.nbytes for k, s in self._slots.items() if k != slot)
        if others + nbytes > self.config.snapshot_budget_bytes:
            raise RequestFailed(ErrorCode.OUT_OF_MEMORY,
                                f"a {nbytes}-byte snapshot exceeds the budget: {others} of "
                                f"{self.config.snapshot_budget_bytes} bytes are held by other slots")

    def _generate(self, msg: Generate) -> None:
        rid = msg.request_id
        t_start = time.perf_counter()
        rt = self.runtime
        if not rt.loaded:
            raise RequestFailed(ErrorCode.MODEL_PARKED, "the model weights are parked; UNPARK first")
        prompt = self._prompt_ids(msg)
        n = int(prompt.shape[0])
        if n + msg.max_tokens > self.n_ctx:
            raise RequestFailed(ErrorCode.CONTEXT_OVERFLOW,
                                f"prompt ({n}) + max_tokens ({msg.max_tokens}) exceeds the context ({self.n_ctx})")
        snap = msg.snapshot
        restore: SnapshotSlot | None = None
        if snap is not None and snap.restore_slot is not None:
            restore = self._slots.get(self._slot_number(snap.restore_slot))
            if restore is None:
                raise RequestFailed(ErrorCode.EMPTY_SLOT, f"slot {snap.restore_slot} is empty")
        # Prefill runs to `end`; the last prompt token goes through decode() unless nothing is decoded.
        end = n - 1 if msg.max_tokens > 0 else n
        save_slot = save_at = None
        if snap is not None and snap.save_slot is not None:
            save_slot = self._slot_number(snap.save_slot)
            save_at = min(snap.save_at if snap.save_at is not None else n, end)
            self._check_budget(save_slot, rt.snapshot_nbytes(save_at) + 4 * save_at)

        cached = 0
        if restore is not None:
            L = int(restore.tokens.shape[0])
            if L < n and np.array_equal(restore.tokens, prompt[:L]) and (save_at is None or save_at >= L):
                cached = L
        state = self._state
        if cached:
            rt.state_from_host(state, restore.state)
        else:
            rt.reset_state(state)
        # From here on the current state is being rewritten.
        self._drop_current()
        sampler = Sampler(msg.sampling)
        if (cached and restore.sampler_state is not None and restore.sampling == msg.sampling
                and msg.sampling.seed is not None):
            sampler.set_state(restore.sampler_state)  # continue the saved RNG position
        with self._lock:
            self._counters.prompt_tokens += n

        saved: SlotInfo | None = None

        def save_now() -> None:
            nonlocal saved
            saved = self._save_slot(save_slot, state, prompt[:state.n_past], sampler, msg.sampling)

        active = self._active
        t0 = time.perf_counter()
        try:
            if save_slot is not None and save_at == cached:
                save_now()
            pos = cached
            chunk = self.config.prefill_chunk
            while pos < end:
                nxt = min(end, (pos // chunk + 1) * chunk)
                if save_slot is not None and pos < save_at < nxt:
                    nxt = save_at
                self._step_or_cancel(active)
                rt.prefill(prompt[pos:nxt], state)
                pos = nxt
                if save_slot is not None and pos == save_at:
                    save_now()
        except _Cancelled:
            self._set_current(state, prompt[:state.n_past], sampler, msg.sampling)
            self._finish(active, FinishReason.CANCELLED, n, 0, cached, time.perf_counter() - t0, 0.0,
                         time.perf_counter() - t_start, saved)
            return
        prefill_s = time.perf_counter() - t0

        if msg.max_tokens == 0:
            self._set_current(state, prompt, sampler, msg.sampling)
            self._finish(active, FinishReason.LENGTH, n, 0, cached, prefill_s, 0.0, 0.0, saved)
            return
        self._decode(msg, prompt, state, sampler, active, cached, prefill_s, t_start, saved)

    def _step_or_cancel(self, active: _Active) -> None:
        """Called before every prefill chunk: a model step may begin unless cancelled."""
        self._progress()
        if active.cancelled:
            raise _Cancelled()
        active.steps += 1

    def _decode(self, msg: Generate, prompt: np.ndarray, state: Any, sampler: Sampler, active: _Active,
                cached: int, prefill_s: float, t_start: float, saved: SlotInfo | None) -> None:
        rt = self.runtime
        n = int(prompt.shape[0])
        stop_ids = frozenset(msg.stop_ids) | frozenset(rt.tokenizer.stop_ids)
        request = GenerationRequest(prompt_ids=prompt.tolist(), max_tokens=msg.max_tokens, sampling=msg.sampling,
                                    stop_ids=stop_ids, stop_strings=msg.stop, max_ctx=self.n_ctx)

        def should_stop() -> bool:  # polled before the last prompt token and before every decode step
            self._progress()
            if active.cancelled:
                return True
            active.steps += 1
            return False

        generated: list[int] = []
        final: GenerationEvent | None = None
        for ev in rt.decode(request, state, n_cached=n - 1, sampler=sampler, should_stop=should_stop):
            if ev.is_final:
                final = ev
                break
            if ev.token_ids or ev.text:
                self.sink(Tokens(request_id=msg.request_id, offset=len(generated),
                                 ids=np.asarray(ev.token_ids, dtype=np.int32), text=ev.text))
                generated.extend(ev.token_ids)
                active.tokens = len(generated)
        if final is None:
            raise RequestFailed(ErrorCode.INCOMPLETE, "the decode loop ended without a final event")
        tail_ids = [final.stop_token] if final.stop_token is not None else []
        if tail_ids or final.text:
            self.sink(Tokens(request_id=msg.request_id, offset=len(generated),
                             ids=np.asarray(tail_ids, dtype=np.int32), text=final.text))
        n_completion = len(generated) + len(tail_ids)
        active.tokens = n_completion
        in_state = max(0, final.n_state_tokens - n)
        self._set_current(state, np.concatenate([prompt, np.asarray(generated[:in_state], dtype=np.int32)]),
                          sampler, msg.sampling)
        st = final.stats
        self._finish(active, FinishReason(final.finish_reason), n, n_completion, cached,
                     prefill_s + st.prefill_s, st.decode_s, prefill_s + st.ttft_s, saved,
                     predicted_per_second=st.decode_tok_s)

    def _finish(self, active: _Active, reason: FinishReason, n_prompt: int, n_completion: int, cached: int,
                prompt_s: float, decode_s: float, ttft_s: float, saved: SlotInfo | None,
                predicted_per_second: float | None = None) -> None:
        with self._lock:
            self._counters.completed += 1
            self._counters.completion_tokens += n_completion
        if active.cancelled:
            self.last_cancel = CancelReport(active.request_id, active.tokens_at_cancel, n_completion,
                                            active.steps - active.steps_at_cancel)
            log.info("request %s cancelled: %d tokens at CANCEL, %d at the end, %d model steps begun after it",
                     active.request_id, active.tokens_at_cancel, n_completion, self.last_cancel.steps_after_cancel)
        prefilled = n_prompt - cached
        if predicted_per_second is None:
            predicted_per_second = (n_completion - 1) / decode_s if n_completion > 1 and decode_s > 0 else 0.0
        timings = Timings(prompt_ms=prompt_s * 1e3, prompt_per_second=prefilled / prompt_s if prompt_s > 0 else 0.0,
                          predicted_ms=decode_s * 1e3, predicted_per_second=predicted_per_second,
                          ttft_ms=ttft_s * 1e3)
        self.sink(Done(request_id=active.request_id, finish_reason=reason,
                       usage=Usage(prompt_tokens=n_prompt, completion_tokens=n_completion, cached_tokens=cached),
                       timings=timings, saved=saved))

    def _set_current(self, state: Any, tokens: np.ndarray, sampler: Sampler, sampling: SamplingParams) -> None:
        if int(state.n_past) != int(tokens.shape[0]):  # a bookkeeping bug would corrupt every restore
            raise RuntimeError(f"state holds {state.n_past} tokens, bookkeeping says {tokens.shape[0]}")
        self._current_tokens = np.array(tokens, dtype=np.int32)
        self._current_sampler = sampler.get_state()
        self._current_sampling = sampling

    def _save_slot(self, slot: int, state: Any, tokens: np.ndarray, sampler: Sampler | None,
                   sampling: SamplingParams | None) -> SlotInfo:
        host = self.runtime.state_to_host(state)
        nbytes = memory.host_nbytes(host) + int(tokens.nbytes)
        self._check_budget(slot, nbytes)
        self._slots[slot] = SnapshotSlot(tokens=np.array(tokens, dtype=np.int32), state=host,
                                         sampler_state=sampler.get_state() if sampler is not None else None,
                                         sampling=sampling, nbytes=nbytes)
        return SlotInfo(slot=slot, n_tokens=int(tokens.shape[0]), bytes=nbytes)

    # -- control commands -----------------------------------------------------------------------
    def _run_control(self, msg: Message) -> None:
        rid = getattr(msg, "request_id", None)
        try:
            reply = self._control(msg)
        except RequestFailed as e:
            reply = ErrorMessage.make(e.code, e.message, rid)
        except MemoryError:
            reply = ErrorMessage.make(ErrorCode.OUT_OF_MEMORY, f"out of memory running {msg.TYPE}", rid)
        except Exception as e:
            log.exception("%s failed", msg.TYPE)
            reply = ErrorMessage.make(ErrorCode.INTERNAL, f"{msg.TYPE}: {type(e).__name__}: {e}", rid)
        self.sink(reply)

    def _slots_reply(self, rid: str | None) -> Slots:
        infos = tuple(SlotInfo(slot=k, n_tokens=int(s.tokens.shape[0]), bytes=s.nbytes)
                      for k, s in sorted(self._slots.items()))
        cur = self._current_tokens
        return Slots(slots=infos, used_bytes=sum(i.bytes for i in infos),
                     budget_bytes=self.config.snapshot_budget_bytes,
                     current_tokens=0 if cur is None else int(cur.shape[0]), request_id=rid)

    def _control(self, msg: Message) -> Message:
        rid = getattr(msg, "request_id", None)
        if isinstance(msg, Snapshot):
            slot = self._slot_number(msg.slot)
            if self._current_tokens is None:
                raise RequestFailed(ErrorCode.EMPTY_SLOT, "there is no current state to snapshot")
            sampling = self._current_sampling
            self._check_budget(slot, self.runtime.snapshot_nbytes(int(self._current_tokens.shape[0])))
            host = self.runtime.state_to_host(self._state)
            nbytes = memory.host_nbytes(host) + int(self._current_tokens.nbytes)
            self._check_budget(slot, nbytes)
            self._slots[slot] = SnapshotSlot(tokens=self._current_tokens.copy(), state=host,
                                             sampler_state=self._current_sampler, sampling=sampling, nbytes=nbytes)
            return self._slots_reply(rid)
        if isinstance(msg, Restore):
            slot = self._slot_number(msg.slot)
            saved = self._slots.get(slot)
            if saved is None:
                raise RequestFailed(ErrorCode.EMPTY_SLOT, f"slot {slot} is empty")
            self._drop_current()
            self.runtime.state_from_host(self._state, saved.state)
            self._current_tokens = saved.tokens.copy()
            self._current_sampler = saved.sampler_state
            self._current_sampling = saved.sampling
            return self._slots_reply(rid)
        if isinstance(msg, FreeSnapshot):
            self._slots.pop(self._slot_number(msg.slot), None)
            memory.release_freed_memory()
            return self._slots_reply(rid)
        if isinstance(msg, ListSlots):
            return self._slots_reply(rid)
        if isinstance(msg, Park):
            released = self.park(msg.target)
            return Parked(target=msg.target, released_bytes=released, request_id=rid)
        if isinstance(msg, Unpark):
            loaded, ms = self.unpark(msg.target)
            return Unparked(target=msg.target, loaded_bytes=loaded, load_ms=ms, request_id=rid)
        raise RequestFailed(ErrorCode.UNKNOWN_MESSAGE_TYPE, f"{msg.TYPE} is not a worker command")

    # -- park / unpark --------------------------------------------------------------------------
    def park(self, target: ParkTarget = ParkTarget.ALL) -> int:
        """Free the weights (target / all; this worker has no draft).  Returns the resident bytes
        released, measured.  Parking what is parked releases 0."""
        if target == ParkTarget.DRAFT or not self.runtime.loaded:
            return 0
        memory.release_freed_memory()
        before = memory.rss_bytes()
        self.runtime.unload()
        memory.release_freed_memory()
        after = memory.rss_bytes()
        still_mapped = memory.mapped_file_bytes(self.runtime.path)
        if still_mapped:  # something still references the weights: say so rather than pretend
            log.warning("parked, but %d bytes of %s are still mapped", still_mapped, self.runtime.path)
        released = max(0, before - after)
        log.info("parked %s: RSS %d -> %d bytes (released %d; weights %d)", self.runtime.path, before, after,
                 released, self.runtime.weight_bytes)
        return released

    def unpark(self, target: ParkTarget = ParkTarget.ALL) -> tuple[int, float]:
        """Reload parked weights; (bytes of weights mapped, milliseconds).  Already loaded: (0, 0)."""
        if target == ParkTarget.DRAFT or self.runtime.loaded:
            return 0, 0.0
        t0 = time.perf_counter()
        try:
            self.runtime.load()
        except WorkerStartupError as e:
            raise RequestFailed(ErrorCode.ADAPTER_UNAVAILABLE if e.code != ErrorCode.OUT_OF_MEMORY else e.code,
                                str(e)) from None
        ms = (time.perf_counter() - t0) * 1e3
        log.info("unparked %s in %.1f ms", self.runtime.path, ms)
        return self.runtime.weight_bytes, ms


def _done(rid: str, reason: FinishReason, n_prompt: int, n_completion: int, cached: int) -> Done:
    return Done(request_id=rid, finish_reason=reason,
                usage=Usage(prompt_tokens=n_prompt, completion_tokens=n_completion, cached_tokens=cached),
                timings=Timings(prompt_ms=0.0, prompt_per_second=0.0, predicted_ms=0.0,
                                predicted_per_second=0.0, ttft_ms=0.0))
