"""Fixtures for the router tests: a scripted tiny qwen35 model and `dflashd serve` processes.

`write_scripted_qwen35(path)` writes a real qwen35 GGUF (the worker loads and runs it like any
other) whose weights make greedy decoding a fixed bigram machine: every layer's output projection
is zero, so the residual stream at a position is the embedding of the token there, and
`output.weight` maps each scripted token's (one-hot) embedding to the next token of a script:

* after "\\n" (a chat prompt ends with "<|im_start|>assistant\\n"): a Qwen-style answer with a think
  block and a tool call, then <|im_end|>:
  `<think>` REASONING `</think>` "\\n\\n" `<tool_call>` CALL_JSON `</tool_call>` <|im_end|>
* after a letter a..p (a plain completion prompt): the alphabet a..p, round and round, forever.

So the tests get deterministic reasoning, tool calls and arbitrarily long streams from a real
worker process, with no trained weights.  `<think>`, `</think>`, `<tool_call>`, `</tool_call>`,
the reasoning and the call are user-defined tokens, as Qwen's own think/tool tokens are in its GGUFs.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from daemons.gguf_writer import TensorData, write_gguf
from daemons.synthetic import PRESETS, byte_vocab, qwen35_metadata, qwen35_tensor_shapes

ROOT = Path(__file__).resolve().parent.parent

REASONING = "\nThe user wants the weather in Paris, so I call get_weather.\n"
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
CALL_JSON = "\n" + json.dumps(CALL) + "\n"
CYCLE = "abcdefghijklmnop"

# A Qwen-format chat template with tools (written for these tests).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "# Tools\n\nYou may call functions. Signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "</tools>\nReturn each call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>{{ '\\n' }}"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant{{ '\\n' }}"
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>{{ '\\n\\n' }}{% endif %}"
    "{{ message.content }}"
    "{% for tc in message.tool_calls or [] %}{{ '\\n' }}<tool_call>\n"
    "{\"name\": {{ tc.function.name | tojson }}, \"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>{{ '\\n' }}"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>{{ '\\n' }}"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)

CHAT_ANSWER_TOKENS = ["<think>", REASONING, "</think>", "\n\n", "<tool_call>", CALL_JSON, "</tool_call>"]
CHAT_ANSWER_TEXT = "".join(CHAT_ANSWER_TOKENS)


def write_scripted_qwen35(path: str | os.PathLike) -> None:
    tokens, types, merges = byte_vocab()
    user_defined = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    for i, t in enumerate(tokens):
        if t in user_defined:
            types[i] = 4  # USER_DEFINED, as in Qwen's GGUFs: matched in text, kept in output
    for extra in (REASONING, "\n\n", CALL_JSON):
        tokens.append(extra)
        types.append(4)
    tid = {t: i for i, t in enumerate(tokens)}
    byte_id = {chr(b): b for b in range(256)}  # byte_vocab(): token id b is the byte b

    def ident(text: str) -> int:
        return tid[text] if text in tid else byte_id[text]

    script: list[tuple[int, int]] = []
    chain = ["\n"] + CHAT_ANSWER_TOKENS + ["<|im_end|>"]
    for a, b in zip(chain, chain[1:]):
        script.append((ident(a), ident(b)))
    for i, ch in enumerate(CYCLE):
        script.append((byte_id[ch], byte_id[CYCLE[(i + 1) % len(CYCLE)]]))
    shape = replace(PRESETS["tiny"], n_embd=32)
    assert len(script) <= shape.n_embd
    md = qwen35_metadata(shape, tokens, types, merges, name="scripted-qwen35", chat_template=TOOL_TEMPLATE)
    rng = np.random.default_rng(7)
    n_vocab = len(tokens)
    emb = 0.05 * rng.standard_normal((n_vocab, shape.n_embd))
    out = np.zeros((n_vocab, shape.n_embd))
    for k, (src, dst) in enumerate(script):
        emb[src] = 0.0
        emb[src, k] = 1.0
        out[dst, k] = 1.0
    tensors = []
    for name, shp in qwen35_tensor_shapes(shape, n_vocab).items():
        if name == "token_embd.weight":
            x = emb
        elif name == "output.weight":
            x = out
        elif name.endswith(("attn_output.weight", "ssm_out.weight", "ffn_down.weight")):
            x = np.zeros(shp)  # no layer writes to the residual stream
        elif name.endswith("ssm_a"):
            x = -np.exp(rng.uniform(-1.0, 1.0, shp))
        elif len(shp) == 1 and "norm" in name:
            x = np.ones(shp)
        elif len(shp) == 1:
            x = 0.5 * rng.standard_normal(shp)
        else:
            x = rng.standard_normal(shp) / np.sqrt(shp[-1])
        tensors.append(TensorData(name, np.asarray(x, dtype=np.float32), QT.F32))
    write_gguf(path, "qwen35", md, tensors)


# ---- processes --------------------------------------------------------------------------------------

# Tiny models on a 2-core box: one compute thread per worker.  numba's parallel loops spin-wait, and
# with several workers (and the test process) on two cores that costs 100x in throughput.
SMALL_MODEL_ENV = {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                   "MKL_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`dflashd serve ...` (or `dflashd router ...`) as a subprocess, its stderr collected."""

    LISTEN_RE = re.compile(r"listening on (http://\S+) \(workers join at (\S+)\)")

    def __init__(self, args: list[str], *, env: dict | None = None):
        full_env = dict(os.environ, PYTHONPATH=str(ROOT), **SMALL_MODEL_ENV)
        full_env.update(env or {})
        self.proc = subprocess.Popen([sys.executable, "-m", "daemons.cli", *args], cwd=ROOT, env=full_env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.lines: list[str] = []
        self.url: str | None = None
        self.zmq_endpoint: str | None = None
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                m = self.LISTEN_RE.search(line)
                if m:
                    self.url, self.zmq_endpoint = m.group(1), m.group(2)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for_line(self, pattern: str, timeout: float, start: int = 0) -> re.Match:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[start:]:
                    m = rx.search(line)
                    if m:
                        return m
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(f"process exited ({self.proc.returncode}) before {pattern!r}:\n{self.log()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{self.log()}")
                self._cond.wait(min(left, 0.5))

    def wait_ready(self, timeout: float = 120.0) -> str:
        self.wait_for_line(r"listening on http://", timeout)
        self.wait_for_line(r"dflashd: ready: ", timeout)
        assert self.url is not None
        return self.url

    def log(self) -> str:
        with self._cond:
            return "\n".join(self.lines[-200:])

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        return self.proc.returncode


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(pred, timeout: float, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
