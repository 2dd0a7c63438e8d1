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
- Speculative decoding (``--draft``): a DFlash draft loaded next to the target (see "Draft" below).

Prefill schedule (why snapshots restore exactly).  The prompt is prefilled in pieces cut at absolute
multiples of ``prefill_chunk`` and, when a snapshot is saved, at the save position; the last prompt
token always goes through the decode loop (``ModelRuntime.decode``).  A run restored from a slot at
position P therefore executes exactly the model calls the saving run executed after P, and yields
bit-identical tokens; a slot saved at a chunk boundary also reproduces a run that saved nothing.

Draft (speculative decoding).  With ``WorkerConfig.draft_path`` the runtime loads a DFlash draft
(``daemons.dflash``: z-lab directory, ``dflash`` GGUF or ``qwen35-dflash-draft`` GGUF) after the
target and checks it against the target (``create_runtime`` already checks its metadata before the
target loads, so a bad draft costs no load).  Every GENERATE then decodes through
``daemons.speculative.SpeculativeDecoder`` with the worker's defaults (``draft_max`` /
``draft_min`` / ``draft_margin``) overridden field by field by the request's ``speculative``
options; ``draft_max = 0`` decodes autoregressively (DONE then has no ``spec``).  Speculative output
is token-identical to autoregressive output (the verify is exact), so a draft only changes speed.

- The draft reads target features at its layer ids.  The worker's own prefill captures them chunk
  by chunk into the drafter's ``FeatureRing`` (its last ``draft_ctx`` positions), so the draft sees
  the whole prompt; the decode loop adds the features of every committed token.
- Snapshots (slots, SNAPSHOT, RESTORE) hold, next to the target state, the draft's features of the
  positions the state covers (``draft.positions`` / ``draft.features``: at most ``draft_ctx`` rows
  of ``n_features x n_embd`` float32).  A restore writes them back and empties the draft KV ring,
  which the next proposal rebuilds from those features in one pass, exactly as the uninterrupted
  run builds it at its first proposal (its ring, too, is filled lazily from the feature ring).  A
  snapshot saved during prefill therefore gives the restored run the same proposals, hence the same
  SpecStats, as the run that never stopped.  (A snapshot of a state left by a finished generation
  rebuilds rows the original computed a few at a time; BLAS may round those differently, which can
  change a proposal but never an output token.)  Features are not stored for positions the draft
  never saw (prompt prefilled while the draft was parked): they are simply absent from its window.
- PARK: the draft borrows the target's token embedding and output head, so parking the target (or
  ``all``) unloads the draft first; ``park draft`` unloads the draft alone and generation continues
  autoregressively.  UNPARK ``target`` reloads the draft too unless it was parked explicitly
  (``park draft`` / ``park all``); UNPARK ``draft`` / ``all`` bring it back (UNPARK ``draft`` while
  the target is parked marks it to come back with the target and loads 0 bytes now).
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
    MAX_DRAFT_TOKENS,
    MAX_SLOTS,
    PROTOCOL_VERSION,
    WORKER_ID_RE,
    Cancel,
    Capacity,
    Done,
    DraftInfo,
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
    SpecStats,
    SpeculativeOptions,
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
DEFAULT_DRAFT_CTX = 4096  # positions of target features the draft attends over (its ring capacity)
# Snapshot keys of the draft's part of a state (next to the target state's own keys).
_DRAFT_PREFIX = "draft."
_DRAFT_POSITIONS = "draft.positions"
_DRAFT_FEATURES = "draft.features"


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
    draft_path: str | None = None  # DFlash draft (GGUF file or z-lab directory); None = no speculation
    # Speculative defaults for requests that do not say (protocol SpeculativeOptions):
    draft_max: int | None = None  # most draft tokens per step; None = block size - 1; 0 = autoregressive
    draft_min: int = 0  # drafts shorter than this (after the margin cut) are not verified
    draft_margin: float = 0.0  # cut the draft where its top-1 - top-2 probability < this (0 = off)
    draft_ctx: int = DEFAULT_DRAFT_CTX  # the draft's context window (capped at the context size)
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
        if self.draft_path is not None and (not isinstance(self.draft_path, str) or not self.draft_path):
            raise bad("the draft path must be a non-empty string")
        if self.draft_max is not None and (not _is_int(self.draft_max) or not 0 <= self.draft_max <= MAX_DRAFT_TOKENS):
            raise bad(f"draft max must be in 0..{MAX_DRAFT_TOKENS} (0 = no speculation), got {self.draft_max!r}")
        if not _is_int(self.draft_min) or not 0 <= self.draft_min <= MAX_DRAFT_TOKENS:
            raise bad(f"draft min must be in 0..{MAX_DRAFT_TOKENS}, got {self.draft_min!r}")
        if self.draft_max is not None and self.draft_min > self.draft_max:
            raise bad(f"draft min {self.draft_min} exceeds draft max {self.draft_max}")
        if isinstance(self.draft_margin, bool) or not isinstance(self.draft_margin, (int, float)) \
                or not 0.0 <= self.draft_margin <= 1.0:
            raise bad(f"draft margin must be a probability margin in [0, 1] (0 = off), got {self.draft_margin!r}")
        if not _is_int(self.draft_ctx) or not 1 <= self.draft_ctx <= MAX_CONTEXT:
            raise bad(f"draft context must be in 1..{MAX_CONTEXT}, got {self.draft_ctx!r}")
        if self.draft_path is None and (self.draft_max is not None or self.draft_min or self.draft_margin):
            raise bad("draft max, draft min and draft margin need a draft model")

    def spec_params(self, options: SpeculativeOptions | None = None) -> Any:
        """The ``daemons.speculative.SpecParams`` of one request: these defaults, each overridden by
        the request's option when it gives one.  RequestFailed(bad_message) when the result is
        invalid (draft_min > draft_max, a margin above 1)."""
        from daemons.speculative import SpecParams, SpeculativeConfigError

        dmax, dmin, margin = self.draft_max, self.draft_min, self.draft_margin
        if options is not None:
            if options.draft_max is not None:
                dmax = options.draft_max
            if options.draft_min is not None:
                dmin = options.draft_min
            if options.draft_margin is not None:
                margin = options.draft_margin
        if dmax is not None and dmin > dmax:
            raise RequestFailed(ErrorCode.BAD_MESSAGE, f"speculative draft_min {dmin} exceeds draft_max {dmax}")
        try:
            return SpecParams(draft_max=dmax, draft_min=dmin, draft_margin=float(margin))
        except SpeculativeConfigError as e:
            raise RequestFailed(ErrorCode.BAD_MESSAGE, f"speculative options: {e}") from None

    @property
    def backend_name(self) -> str:
        return self.device.split(":")[0]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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


def draft_fingerprint(path: str) -> str:
    """``model_fingerprint`` of a draft: of its GGUF file, or for a z-lab directory (or one of its
    ``.safetensors`` files) of its config.json and every ``*.safetensors`` file together."""
    p = os.path.abspath(path)
    if os.path.isfile(p) and not p.endswith(".safetensors"):
        return model_fingerprint(p)
    d = p if os.path.isdir(p) else os.path.dirname(p)
    h = hashlib.sha256()
    for name in sorted(os.listdir(d)):
        if name == "config.json" or name.endswith(".safetensors"):
            h.update(name.encode() + b"\0" + model_fingerprint(os.path.join(d, name)).encode() + b"\0")
    return "sha256-dir:" + h.hexdigest()


def _draft_model_id(path: str) -> str:
    name = os.path.basename(os.path.normpath(path))
    if os.path.isfile(path) and name.endswith(".safetensors"):
        name = os.path.basename(os.path.dirname(os.path.abspath(path)))
    for suffix in (".gguf", ".GGUF"):
        if name.endswith(suffix):
            name = name[:-len(suffix)]
    return name[:256] or "draft"


def _draft_own_bytes(draft: Any) -> int:
    """Bytes of the draft's own weights; the target's embedding and head it borrows are not counted."""
    def nbytes(w: Any) -> int:
        return int(getattr(w, "nbytes", 0) or 0)

    total = sum(nbytes(w) for w in (draft.fc, draft.hidden_norm, draft.output_norm))
    for layer in draft.layers:
        total += sum(nbytes(getattr(layer, f)) for f in layer.__dataclass_fields__)
    for name in ("token_embd", "output"):
        if getattr(draft, name) is not getattr(draft.target, name, None):
            total += nbytes(getattr(draft, name))
    return total


class _ContinuingDrafter:
    """The worker's ``DFlashDrafter`` as ``SpeculativeDecoder`` sees it.  The decoder calls
    ``start`` at the beginning of each decode, which would empty the rings; but the worker has
    already fed the prompt's features during its own prefill (or restored them from a snapshot) and
    emptied the rings itself when the sequence began, so ``start`` keeps everything."""

    def __init__(self, drafter: Any):
        self._drafter = drafter
        self.capture_layers = drafter.capture_layers
        self.max_draft = drafter.max_draft

    def start(self, n_cached: int) -> None:
        pass

    def observe(self, start: int, token_ids: Any, features: Any) -> None:
        self._drafter.observe(start, token_ids, features)

    def propose(self, n: int, anchor: int, max_tokens: int) -> Any:
        return self._drafter.propose(n, anchor, max_tokens)


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
        # the draft (config.draft_path): kept across parking are its identity and sizes
        self.draft_path = config.draft_path
        self.draft: Any = None  # daemons.dflash.DFlashDraft while loaded
        self.drafter: Any = None  # daemons.dflash.DFlashDrafter (its rings) while loaded
        self.draft_info: DraftInfo | None = None
        self.draft_weight_bytes = 0  # the draft's own weights (the borrowed embedding/head excluded)
        self.draft_ring_bytes = 0  # its feature ring and KV ring
        self.draft_window = 0

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
        """Drop every reference this runtime holds to the weights (the draft's too: it borrows the
        target's embedding and output head).  The caller collects garbage and measures."""
        self.unload_draft()
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

    def read_hparams(self, gguf: Any) -> Any:
        """The target's hyperparameters from its GGUF metadata alone (n_embd, n_layer, n_vocab), for
        checking a draft before the weights load; None when the architecture cannot say."""
        return None

    # -- the draft ---------------------------------------------------------------------------------
    @property
    def has_draft(self) -> bool:
        return self.draft_path is not None

    @property
    def draft_loaded(self) -> bool:
        return self.drafter is not None

    def _draft_error(self, e: object) -> WorkerStartupError:
        return WorkerStartupError(ErrorCode.ADAPTER_UNAVAILABLE,
                                  f"draft not supported for target {self.path}: {e}")

    def check_draft(self) -> None:
        """Check the draft's metadata and tensor layout against the target's metadata without loading
        either (WorkerStartupError naming the problem)."""
        from daemons.dflash import DraftModelError, read_config
        from daemons.gguf_reader import GGUFError, GGUFFile

        if self.draft_path is None:
            return
        try:
            with GGUFFile(self.path) as g:
                hparams = self.read_hparams(g)
            config, _, f = read_config(self.draft_path)
            if f is not None:
                f.close()
            if hparams is not None:
                config.bind(hparams)
        except (DraftModelError, GGUFError, OSError, ValueError) as e:
            raise self._draft_error(e) from None

    def load_draft(self, window: int) -> None:
        """Load the draft for the loaded target, with a ``window``-position context ring (its
        features and KV).  WorkerStartupError when it cannot be used."""
        from daemons.dflash import DFlashDraft, DFlashDrafter, DraftModelError
        from daemons.gguf_reader import GGUFError
        from kernels.backend import BackendError

        if self.draft_path is None or self.drafter is not None:
            return
        if self.model is None:
            raise WorkerStartupError(ErrorCode.ADAPTER_UNAVAILABLE, "the draft needs the target loaded")
        try:
            fingerprint = draft_fingerprint(self.draft_path)
        except OSError as e:
            raise self._draft_error(f"{self.draft_path}: {e.strerror or e}") from None
        if self.draft_info is not None and fingerprint != self.draft_info.model_hash:
            raise WorkerStartupError(ErrorCode.ADAPTER_UNAVAILABLE,
                                     f"{self.draft_path} changed on disk while parked; restart the worker to serve it")
        try:
            draft = DFlashDraft.load(self.draft_path, self.model, self.backend)
            try:
                drafter = DFlashDrafter(draft, context_window=window)
            except BaseException:
                draft.close()
                raise
        except (DraftModelError, GGUFError, BackendError, OSError, ValueError) as e:
            raise self._draft_error(e) from None
        except MemoryError:
            raise WorkerStartupError(ErrorCode.OUT_OF_MEMORY,
                                     f"{self.draft_path}: out of memory loading the draft") from None
        self.draft, self.drafter, self.draft_window = draft, drafter, int(window)
        self.draft_weight_bytes = _draft_own_bytes(draft)
        self.draft_ring_bytes = int(drafter.features.rows.nbytes) + sum(
            int(a.nbytes) for a in (*drafter.ring.k, *drafter.ring.v))
        if self.draft_info is None:
            self.draft_info = DraftInfo(model_id=_draft_model_id(self.draft_path), model_hash=fingerprint,
                                        architecture="dflash",
                                        block_size=min(max(int(draft.block_size), 1), MAX_DRAFT_TOKENS))

    def unload_draft(self) -> None:
        """Drop the draft and its rings (the target stays)."""
        draft, self.draft, self.drafter = self.draft, None, None
        if draft is not None:
            draft.close()
        del draft

    def reset_draft_context(self) -> None:
        """A new sequence starts from an empty state: the draft forgets every position."""
        if self.drafter is not None:
            self.drafter.start(0)

    def _draft_snapshot_nbytes(self, n_tokens: int) -> int:
        if self.drafter is None:
            return 0
        rows = min(int(n_tokens), self.draft_window)
        return rows * (self.drafter.features.width * 4 + 8)

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
        """The target state, plus the draft's features of the positions it covers (module docstring)."""
        host = state.to_host()
        host.update(self.draft_to_host(int(state.n_past)))
        return host

    def state_from_host(self, state: Any, snapshot: dict[str, np.ndarray]) -> None:
        """Restore a ``state_to_host`` snapshot: the target state, and the draft's features (its KV
        ring is emptied and rebuilt from them at the next proposal)."""
        state.from_host({k: v for k, v in snapshot.items() if not k.startswith(_DRAFT_PREFIX)})
        self.draft_from_host(snapshot, int(state.n_past))

    def draft_to_host(self, n_past: int) -> dict[str, np.ndarray]:
        """The draft's part of a state holding ``n_past`` tokens: the features it has of positions
        < n_past within its window (empty without a loaded draft)."""
        if self.drafter is None:
            return {}
        start = max(0, n_past - self.drafter.features.capacity)
        rows, present = self.drafter.features.read(start, n_past)
        return {_DRAFT_POSITIONS: np.arange(start, n_past, dtype=np.int64)[present],
                _DRAFT_FEATURES: np.ascontiguousarray(rows[present], dtype=np.float32)}

    def draft_from_host(self, snapshot: dict[str, np.ndarray], n_past: int) -> None:
        """Make the draft's context that of ``snapshot`` (a state of ``n_past`` tokens): features
        written back, KV ring emptied (rebuilt from the features at the next proposal)."""
        if self.drafter is None:
            return
        self.drafter.start(0)
        positions, features = snapshot.get(_DRAFT_POSITIONS), snapshot.get(_DRAFT_FEATURES)
        ring = self.drafter.features
        if positions is None or features is None or features.ndim != 2 or features.shape[1] != ring.width:
            return  # saved while the draft was parked: the draft starts without that context
        keep = positions < n_past
        positions, features = positions[keep], features[keep]
        skip = max(0, len(positions) - ring.capacity)  # a smaller ring keeps the last positions
        slots = positions[skip:] % ring.capacity
        ring.rows[slots] = features[skip:]
        ring.slot_pos[slots] = positions[skip:]

    @property
    def n_vocab(self) -> int:
        return int(self.model.n_vocab)

    # -- running -----------------------------------------------------------------------------------
    def prefill(self, ids: np.ndarray, state: Any) -> None:
        """Advance ``state`` by ``ids`` (one model call; nobody reads the logits).  With a draft
        loaded, the call also captures the draft's target layers and hands their rows to the
        drafter (capturing copies layer outputs; it does not change the state's bits)."""
        if self.drafter is None:
            self.model.prefill(ids, state, chunk=max(len(ids), 1), logits="none")
            return
        layers = tuple(self.drafter.capture_layers)
        start = int(state.n_past)
        _, captured = self.model.prefill(ids, state, chunk=max(len(ids), 1), logits="none", capture_layers=layers)
        self.drafter.observe(start, ids, np.concatenate([captured[il][:len(ids)] for il in layers], axis=1))

    def decode(self, request: GenerationRequest, state: Any, *, n_cached: int, sampler: Sampler,
               should_stop: Callable[[], bool], speculative: Any = None) -> Iterator[GenerationEvent]:
        """THE generation call of the worker: every decode goes through here.  ``state`` holds
        ``n_cached`` prompt tokens; the rest of the prompt (at least its last token) is prefilled
        inside.  ``speculative``: the request's ``SpecParams``; with a loaded draft and draft_max
        != 0 the decode is speculative (the final event's stats then carry ``spec``), otherwise
        autoregressive."""
        decoder = None
        if self.drafter is not None and speculative is not None and speculative.draft_max != 0:
            from daemons.speculative import SpeculativeDecoder
            decoder = SpeculativeDecoder(self.model, _ContinuingDrafter(self.drafter), speculative)
        return generate(self.model, self.tokenizer, request, state, n_cached=n_cached,
                        should_stop=should_stop, sampler=sampler, speculative=decoder)


class Qwen35Runtime(ModelRuntime):
    """The qwen35 worker: ``daemons.qwen35.Qwen35Model`` (weights memory-mapped from the GGUF)."""

    architecture = "qwen35"

    def __init__(self, config: WorkerConfig):
        super().__init__(config)
        self.hparams: Any = None

    def _load_model(self, path: str, backend: Any) -> Any:
        from daemons.qwen35 import Qwen35Model
        return Qwen35Model.load(path, backend)

    def read_hparams(self, gguf: Any) -> Any:
        from daemons.qwen35 import Qwen35HParams
        return Qwen35HParams.from_gguf(gguf)

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
        return (self._per_token_kv_bytes() * n_tokens + self._recurrent_bytes() + 8  # + n_past
                + self._draft_snapshot_nbytes(n_tokens))


RUNTIMES: dict[str, type[ModelRuntime]] = {"qwen35": Qwen35Runtime}


def create_runtime(config: WorkerConfig) -> ModelRuntime:
    """The runtime for the model file's architecture (WorkerStartupError if none serves it, or if
    the configured draft does not fit the target)."""
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
    runtime = cls(config)
    runtime.check_draft()  # a draft that cannot serve this target fails before the target loads
    return runtime


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
    # speculative decoding totals over the requests that ran it (protocol SpecStats)
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_steps: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()

    def add_spec(self, spec: SpecStats) -> None:
        self.spec_drafted += spec.drafted
        self.spec_accepted += spec.accepted
        self.spec_steps += spec.steps
        per = list(self.spec_accepted_per_position)
        per.extend([0] * (len(spec.accepted_per_position) - len(per)))
        for i, n in enumerate(spec.accepted_per_position):
            per[i] += n
        self.spec_accepted_per_position = tuple(per)

    def spec_totals(self) -> SpecStats:
        steps = self.spec_steps
        return SpecStats(drafted=self.spec_drafted, accepted=self.spec_accepted,
                         accepted_per_position=self.spec_accepted_per_position, steps=steps,
                         acceptance_length=(self.spec_accepted + steps) / steps if steps else 0.0)


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
        # False after `park draft` / `park all`: the draft stays parked when the target comes back
        self._draft_wanted = True
        # The current state's draft features while the draft is parked (PARK keeps the current state).
        self._parked_draft_context: dict[str, np.ndarray] | None = None

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
        if rt.has_draft:
            rt.load_draft(min(self.config.draft_ctx, self.n_ctx))
        log.info("loaded %s (%s, %.1f MiB of weights) on %s; context %d, %d snapshot slots, budget %d bytes",
                 rt.path, rt.architecture, rt.weight_bytes / 2**20, self.config.device, self.n_ctx,
                 self.config.n_snapshot_slots, self.config.snapshot_budget_bytes)
        if rt.draft_loaded:
            c = self.config
            log.info("draft %s: block size %d, context window %d; defaults draft_max=%s draft_min=%d "
                     "draft_margin=%g", rt.draft_path, rt.draft.block_size, rt.draft_window,
                     "block-1" if c.draft_max is None else c.draft_max, c.draft_min, c.draft_margin)

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
                              memory_bytes=rt.weight_bytes + rt.state_nbytes(self.n_ctx)
                              + rt.draft_weight_bytes + rt.draft_ring_bytes),
            draft=rt.draft_info, pid=os.getpid(), hostname=socket.gethostname()[:255] or None)

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
        rt = self.runtime
        out = () if rt.loaded else (ParkTarget.TARGET,)
        if rt.has_draft and not rt.draft_loaded:
            out += (ParkTarget.DRAFT,)
        return out

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
            snapshot_bytes_used=self.snapshot_bytes_used(),
            spec=c.spec_totals() if self.runtime.has_draft or c.spec_steps else None, request_id=request_id)

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
        self._parked_draft_context = None

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
        t_start = time.perf_counter()
        rt = self.runtime
        if not rt.loaded:
            raise RequestFailed(ErrorCode.MODEL_PARKED, "the model weights are parked; UNPARK first")
        prompt = self._prompt_ids(msg)
        n = int(prompt.shape[0])
        if n + msg.max_tokens > self.n_ctx:
            raise RequestFailed(ErrorCode.CONTEXT_OVERFLOW,
                                f"prompt ({n}) + max_tokens ({msg.max_tokens}) exceeds the context ({self.n_ctx})")
        # A worker without a (loaded) draft ignores the request's speculative options.
        spec_params = self.config.spec_params(msg.speculative) if rt.draft_loaded else None
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
            rt.reset_draft_context()
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
        self._decode(msg, prompt, state, sampler, active, cached, prefill_s, t_start, saved, spec_params)

    def _step_or_cancel(self, active: _Active) -> None:
        """Called before every prefill chunk: a model step may begin unless cancelled."""
        self._progress()
        if active.cancelled:
            raise _Cancelled()
        active.steps += 1

    def _decode(self, msg: Generate, prompt: np.ndarray, state: Any, sampler: Sampler, active: _Active,
                cached: int, prefill_s: float, t_start: float, saved: SlotInfo | None, spec_params: Any) -> None:
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
        for ev in rt.decode(request, state, n_cached=n - 1, sampler=sampler, should_stop=should_stop,
                            speculative=spec_params):
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
        spec = None
        if st.spec is not None:
            s = st.spec
            spec = SpecStats(drafted=s["drafted"], accepted=s["accepted"],
                             accepted_per_position=tuple(s["accepted_per_position"]), steps=s["steps"],
                             acceptance_length=float(s["acceptance_length"]))
        self._finish(active, FinishReason(final.finish_reason), n, n_completion, cached,
                     prefill_s + st.prefill_s, st.decode_s, prefill_s + st.ttft_s, saved,
                     predicted_per_second=st.decode_tok_s, spec=spec)

    def _finish(self, active: _Active, reason: FinishReason, n_prompt: int, n_completion: int, cached: int,
                prompt_s: float, decode_s: float, ttft_s: float, saved: SlotInfo | None,
                predicted_per_second: float | None = None, spec: SpecStats | None = None) -> None:
        with self._lock:
            self._counters.completed += 1
            self._counters.completion_tokens += n_completion
            if spec is not None:
                self._counters.add_spec(spec)
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
                       timings=timings, spec=spec, saved=saved))

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
            if self._parked_draft_context is not None and not self.runtime.draft_loaded:
                host.update(self._parked_draft_context)  # the parked draft's part of the current state
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
            if not self.runtime.draft_loaded:  # kept for the draft's return (unpark)
                self._parked_draft_context = {k: v for k, v in saved.state.items()
                                              if k.startswith(_DRAFT_PREFIX)} or None
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
        """Free weights; returns the resident bytes released, measured.  ``draft``: the draft alone
        (generation goes on autoregressively); ``target`` / ``all``: the target, and the draft with
        it since it borrows the target's embedding and output head.  ``draft`` and ``all`` also keep
        the draft parked when the target comes back (see ``unpark``).  Parking what is parked (or a
        draft this worker does not have) releases 0."""
        rt = self.runtime
        target = ParkTarget(target)
        if target in (ParkTarget.DRAFT, ParkTarget.ALL) and rt.has_draft:
            self._draft_wanted = False
        if target == ParkTarget.DRAFT:
            if not rt.draft_loaded:
                return 0
            self._keep_draft_context()
            return self._measure_release(rt.unload_draft, rt.draft_path, rt.draft_weight_bytes)
        if not rt.loaded:
            return 0
        self._keep_draft_context()
        return self._measure_release(rt.unload, rt.path, rt.weight_bytes + rt.draft_weight_bytes)

    def _keep_draft_context(self) -> None:
        cur = self._current_tokens
        if self.runtime.draft_loaded and cur is not None:
            self._parked_draft_context = self.runtime.draft_to_host(int(cur.shape[0]))

    def _measure_release(self, unload: Callable[[], None], path: str, weights: int) -> int:
        memory.release_freed_memory()
        before = memory.rss_bytes()
        unload()
        memory.release_freed_memory()
        after = memory.rss_bytes()
        still_mapped = memory.mapped_file_bytes(path) if os.path.isfile(path) else 0
        if still_mapped:  # something still references the weights: say so rather than pretend
            log.warning("parked, but %d bytes of %s are still mapped", still_mapped, path)
        released = max(0, before - after)
        log.info("parked %s: RSS %d -> %d bytes (released %d; weights %d)", path, before, after, released, weights)
        return released

    def unpark(self, target: ParkTarget = ParkTarget.ALL) -> tuple[int, float]:
        """Reload parked weights; (bytes of weights loaded, milliseconds).  ``target`` brings the
        draft back too unless it was parked explicitly; ``draft`` / ``all`` always want it back
        (``draft`` while the target is parked only marks it: it loads with the target).  Nothing
        to load: (0, 0)."""
        rt = self.runtime
        target = ParkTarget(target)
        if target in (ParkTarget.DRAFT, ParkTarget.ALL) and rt.has_draft:
            self._draft_wanted = True
        t0 = time.perf_counter()
        loaded = 0
        try:
            if target != ParkTarget.DRAFT and not rt.loaded:
                rt.load()
                loaded += rt.weight_bytes
                log.info("unparked %s in %.1f ms", rt.path, (time.perf_counter() - t0) * 1e3)
            if rt.has_draft and self._draft_wanted and rt.loaded and not rt.draft_loaded:
                rt.load_draft(min(self.config.draft_ctx, self.n_ctx))
                loaded += rt.draft_weight_bytes
                kept, self._parked_draft_context = self._parked_draft_context, None
                if kept is not None and self._current_tokens is not None:
                    rt.draft_from_host(kept, int(self._current_tokens.shape[0]))
                log.info("unparked draft %s", rt.draft_path)
        except WorkerStartupError as e:
            raise RequestFailed(ErrorCode.ADAPTER_UNAVAILABLE if e.code != ErrorCode.OUT_OF_MEMORY else e.code,
                                str(e)) from None
        if not loaded:
            return 0, 0.0
        return loaded, (time.perf_counter() - t0) * 1e3


def _done(rid: str, reason: FinishReason, n_prompt: int, n_completion: int, cached: int) -> Done:
    return Done(request_id=rid, finish_reason=reason,
                usage=Usage(prompt_tokens=n_prompt, completion_tokens=n_completion, cached_tokens=cached),
                timings=Timings(prompt_ms=0.0, prompt_per_second=0.0, predicted_ms=0.0,
                                predicted_per_second=0.0, ttft_ms=0.0))
