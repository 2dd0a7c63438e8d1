"""Shared pieces of the worker tests: synthetic models, an in-process core harness, a worker
subprocess, a ROUTER-side peer, and greedy references computed with ``daemons.generate`` directly.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import psutil
import zmq

import kernels  # noqa: F401 - sets numba's OpenMP wait policy before any kernel module loads
from protocol import framing
from protocol.messages import (
    ROUTER_ACCEPTS,
    Done,
    ErrorMessage,
    Generate,
    Heartbeat,
    Hello,
    Message,
    Parked,
    Slots,
    StatsReply,
    Tokens,
    Unparked,
)

REPO = Path(__file__).resolve().parent.parent
FINAL_TYPES = (Done, ErrorMessage, Slots, Parked, Unparked, StatsReply)


# ---- models ---------------------------------------------------------------------------------------

def tiny_model(root: Path) -> Path:
    """The 'tiny' synthetic qwen35 (~240 KB, 4 layers: 3 DeltaNet + 1 attention)."""
    from daemons.synthetic import write_synthetic_qwen35
    path = root / "tiny-qwen35.gguf"
    if not path.exists():
        write_synthetic_qwen35(path, "tiny", seed=0)
    return path


def park_model(root: Path) -> Path:
    """A synthetic qwen35 of ~40 MB of F32 weights with tied output, so one decode step reads every
    weight page (token_embd doubles as the LM head): big enough for RSS changes to be measured."""
    from daemons.synthetic import write_synthetic_qwen35
    path = root / "park-qwen35.gguf"
    if not path.exists():
        write_synthetic_qwen35(path, "tiny", seed=1, n_embd=512, n_ff=1536, n_layer=4, tied_output=True)
    return path


def weight_bytes(path: Path) -> int:
    from daemons.gguf_reader import GGUFFile
    with GGUFFile(path) as g:
        return sum(t.nbytes for t in g.tensors.values())


@dataclass
class Reference:
    """Greedy (or seeded) generation straight through ``daemons.generate`` (no worker code)."""

    model: Any
    tokenizer: Any

    @classmethod
    def load(cls, path: Path) -> "Reference":
        from daemons.architectures import load_model
        from daemons.tokenizer import Tokenizer
        model = load_model(str(path), "cpu")
        return cls(model, Tokenizer.from_metadata(model.metadata))

    def run(self, prompt: Iterable[int], max_tokens: int, sampling=None) -> tuple[list[int], str]:
        """Completion ids as the worker reports them (a final stop token included) and finish reason."""
        from daemons.generate import GenerationRequest, generate_all
        from daemons.sampling import SamplingParams
        req = GenerationRequest(prompt_ids=tuple(int(t) for t in prompt), max_tokens=max_tokens,
                                sampling=sampling or SamplingParams(), stop_ids=self.tokenizer.stop_ids)
        r = generate_all(self.model, self.tokenizer, req)
        ids = list(r.token_ids) + ([r.stop_token] if r.stop_token is not None else [])
        return ids, r.finish_reason

    def long_prompt(self, n_prompt: int, max_tokens: int, tries: int = 20) -> np.ndarray:
        """A prompt whose greedy run reaches ``max_tokens`` without an end-of-generation token."""
        for seed in range(tries):
            prompt = np.random.default_rng(100 + seed).integers(0, 256, n_prompt).astype(np.int32)
            if self.run(prompt, max_tokens)[1] == "length":
                return prompt
        raise AssertionError("no prompt runs to max_tokens on this model")


# ---- an in-process core ---------------------------------------------------------------------------

class CollectingSink:
    """Thread-safe sink that records every message the core emits, with arrival times."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.times: list[float] = []
        self.cond = threading.Condition()
        self.hooks: list = []

    def __call__(self, msg: Message) -> None:
        for hook in list(self.hooks):
            hook(msg)
        with self.cond:
            self.messages.append(msg)
            self.times.append(time.monotonic())
            self.cond.notify_all()

    def wait_final(self, request_id: str | None, timeout: float = 60.0) -> Message:
        """The first final reply (DONE, ERROR, SLOTS, ...) carrying ``request_id``."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for m in self.messages:
                    if isinstance(m, FINAL_TYPES) and getattr(m, "request_id", None) == request_id:
                        return m
                left = deadline - time.monotonic()
                assert left > 0, f"no final reply for {request_id!r}"
                self.cond.wait(left)

    def tokens(self, request_id: str) -> list[int]:
        with self.cond:
            out: list[int] = []
            for m in self.messages:
                if isinstance(m, Tokens) and m.request_id == request_id:
                    assert m.offset == len(out), "TOKENS chunks must be contiguous"
                    out.extend(int(t) for t in m.ids)
            return out

    def of(self, request_id: str) -> list[Message]:
        with self.cond:
            return [m for m in self.messages if getattr(m, "request_id", None) == request_id]


class CoreHarness:
    """A WorkerCore with its compute loop on a thread and a CollectingSink."""

    def __init__(self, config) -> None:
        from daemons.worker import WorkerCore, create_runtime
        self.sink = CollectingSink()
        self.core = WorkerCore(config, create_runtime(config), self.sink)
        self.core.start()
        self.thread = threading.Thread(target=self.core.run, daemon=True)
        self.thread.start()

    def call(self, msg: Message, timeout: float = 60.0) -> Message:
        self.core.submit(msg)
        return self.sink.wait_final(getattr(msg, "request_id", None), timeout)

    def generate(self, request_id: str, prompt, max_tokens: int, **kw) -> tuple[list[int], Message]:
        final = self.call(Generate(request_id=request_id, prompt_ids=np.asarray(prompt, dtype=np.int32),
                                   max_tokens=max_tokens, **kw))
        return self.sink.tokens(request_id), final

    def close(self) -> None:
        self.core.shutdown(drain=False)
        self.thread.join(timeout=30)


# ---- worker subprocesses --------------------------------------------------------------------------

def worker_command(model: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "daemons.cli", "worker", "--model", str(model), *args]


class WorkerProcess:
    """``dflashd worker`` in a subprocess; stderr goes to a file (the fuzz test reads its log lines)."""

    def __init__(self, model: Path, args: list[str], log_path: Path, **popen: Any) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(worker_command(model, *args), cwd=REPO, stderr=self._log, **popen)
        self.ps = psutil.Process(self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss(self) -> int:
        return int(self.ps.memory_info().rss)

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._log.close()
        return self.proc.returncode


class RouterPeer:
    """The ROUTER end of the protocol, as a test drives it: bind, wait for HELLO, send, receive."""

    def __init__(self, ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.sock = framing.router_socket(self.ctx, "tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.identity: bytes | None = None
        self.hello: Hello | None = None
        self.backlog: list[Message] = []  # received but not yet asked for
        self.heartbeats = 0

    def close(self) -> None:
        self.sock.close(linger=0)

    def recv(self, timeout: float = 30.0) -> Message | None:
        """The next message (heartbeats counted and skipped); None on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(max(1, int(left * 1000))):
                return None
            identity, msg = framing.recv(self.sock, accept=ROUTER_ACCEPTS)
            if self.identity is None:
                self.identity = identity
            if isinstance(msg, Heartbeat):
                self.heartbeats += 1
                continue
            return msg

    def wait_hello(self, timeout: float = 60.0) -> Hello:
        msg = self.recv(timeout)
        assert isinstance(msg, Hello), f"expected HELLO, got {msg!r}"
        self.hello = msg
        return msg

    def send(self, msg: Message) -> None:
        framing.send(self.sock, msg, identity=self.identity)

    def send_raw(self, frames: list[bytes]) -> None:
        self.sock.send_multipart([self.identity, *frames])

    def call(self, msg: Message, timeout: float = 60.0) -> Message:
        """Send ``msg`` and return its final reply (replies to other ids are kept in backlog)."""
        self.send(msg)
        rid = getattr(msg, "request_id", None)
        while True:
            reply = self.recv(timeout)
            assert reply is not None, f"no reply to {msg.TYPE} {rid!r}"
            if isinstance(reply, FINAL_TYPES) and getattr(reply, "request_id", None) == rid:
                return reply
            self.backlog.append(reply)

    def generate(self, msg: Generate, timeout: float = 60.0) -> tuple[list[int], Message]:
        """Send a GENERATE; (completion ids from its TOKENS, its DONE/ERROR)."""
        self.send(msg)
        ids: list[int] = []
        while True:
            reply = self.recv(timeout)
            assert reply is not None, f"no reply to GENERATE {msg.request_id}"
            if getattr(reply, "request_id", None) != msg.request_id:
                self.backlog.append(reply)
                continue
            if isinstance(reply, Tokens):
                assert reply.offset == len(ids)
                ids.extend(int(t) for t in reply.ids)
                continue
            return ids, reply
