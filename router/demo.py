"""The whole serving path in one command: router + worker, one chat request over HTTP, then stats.

`run_demo(target, draft=None, prompt=...)` starts `dflashd serve --model TARGET --port 0` as a child
process, waits until its worker is ready, sends one streaming chat completion over HTTP (printing
reasoning and content as they arrive), prints the response's timings and the router's /metrics
summary, and stops the server (which takes its worker down).  Meant for `dflashd demo`
(daemons/cli.py) once the embedded default model exists.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

__all__ = ["run_demo", "DemoError"]

REPO_ROOT = Path(__file__).resolve().parent.parent


class DemoError(RuntimeError):
    """The demo server did not come up or the request failed (one-line message)."""


def run_demo(target: str | os.PathLike, draft: str | os.PathLike | None = None, *,
             prompt: str = "Write a Python function that returns the n-th Fibonacci number.",
             max_tokens: int = 96, echo: Callable[[str], None] | None = None, timeout_s: float = 600.0) -> dict:
    """Run the demo; returns the final response's timings.  `echo(text)` prints (default: stdout)."""
    import httpx

    out = echo or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    args = [sys.executable, "-m", "daemons.cli", "serve", "--model", str(target), "--alias", "demo", "--port", "0"]
    if draft is not None:
        args += ["--draft", str(draft)]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)
    lines: list[str] = []
    state = {"url": None, "ready": False}
    ready = threading.Event()

    def read() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append(line.rstrip())
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                state["url"] = m.group(1)
            if "dflashd: ready: " in line:
                state["ready"] = "ready: demo" in line
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not ready.wait(timeout_s) or not state["ready"] or state["url"] is None:
            tail = "; ".join(lines[-3:])
            raise DemoError(f"the demo server did not get a ready worker: {tail}")
        url = state["url"]
        out(f"[demo] router at {url}; asking: {prompt}\n\n")
        timings = {}
        t0 = time.perf_counter()
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=timeout_s,
                          json={"model": "demo", "max_tokens": max_tokens, "stream": True,
                                "stream_options": {"include_usage": True},
                                "messages": [{"role": "user", "content": prompt}]}) as r:
            if r.status_code != 200:
                raise DemoError(f"the request failed with HTTP {r.status_code}: {r.read().decode()[:300]}")
            in_reasoning = False
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise DemoError(f"the stream failed: {chunk['error'].get('message')}")
                for c in chunk.get("choices", []):
                    delta = c.get("delta", {})
                    if delta.get("reasoning_content"):
                        if not in_reasoning:
                            out("[thinking] ")
                            in_reasoning = True
                        out(delta["reasoning_content"])
                    if delta.get("content"):
                        if in_reasoning:
                            out("\n[answer] ")
                            in_reasoning = False
                        out(delta["content"])
                    for tc in delta.get("tool_calls", []):
                        out(f"\n[tool call] {tc['function']['name']}({tc['function']['arguments']})")
                if chunk.get("timings"):
                    timings = chunk["timings"]
        wall = time.perf_counter() - t0
        out("\n\n")
        if timings:
            out(f"[demo] prompt {timings['prompt_n']} tokens at {timings['prompt_per_second']:.1f} tok/s; "
                f"generated {timings['predicted_n']} tokens at {timings['predicted_per_second']:.1f} tok/s; "
                f"first token after {timings['ttft_ms']:.0f} ms; {wall:.2f} s over HTTP\n")
            if "draft_n" in timings:
                rate = timings["draft_n_accepted"] / timings["draft_n"] if timings["draft_n"] else 0.0
                out(f"[demo] speculative: {timings['draft_n_accepted']}/{timings['draft_n']} draft tokens "
                    f"accepted ({rate:.0%})\n")
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        shown = [ln for ln in metrics.splitlines()
                 if ln.startswith(("dflashd:requests_total", "dflashd:tokens_predicted_total",
                                   "dflashd:time_to_first_token_seconds_sum", "dflashd:worker_healthy"))]
        out("[demo] router metrics:\n" + "".join(f"  {ln}\n" for ln in shown))
        return timings
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        reader.join(5)
