"""qwen35 CPU decode and prefill throughput: ours (daemons/qwen35.py) against llama.cpp.

Run:  .venv/bin/python tests/bench/bench_qwen35_cpu.py [--threads 2] [--types Q8_0 Q4_K_M]
          [--prompt 32] [--decode 64] [--model PATH.gguf ...] [--dir DIR] [--profile]

Without --model it builds a synthetic qwen35 (`daemons.synthetic`, random weights in the real
layout; shape `BENCH_SHAPE`: hidden 1024, 12 layers of which 3 full attention, ff 3072, ~160M
parameters, the small byte vocabulary) big enough that decode is bound by reading weights, not by
per-token overheads: F16 is written by our writer, Q8_0 and Q4_K_M are made from it by llama.cpp's
own quantiser (`llama_model_quantize`, default parameters), so both sides read the very same bytes.
Files are cached in --dir (default: a temporary directory removed at exit).

For each file, both engines run the same greedy decode: a `--prompt`-token prompt is prefilled in
one batch, then `--decode` tokens are generated one at a time (each fed back). Ours runs through
`daemons.generate.generate_all` (greedy, no stop tokens); llama.cpp through llama-cpp-python's
low-level loop (`Llama.eval` + `llama_sampler_init_greedy`), both with `--threads` threads.
Reported: prefill tok/s, decode tok/s (tokens after the first / time from the first sampled token to
the last, llama-server's convention), and the decode ratio ours / llama.cpp. Each measurement is
the best of --repeats runs (the machine may be shared). Greedy paths of the two engines are
compared and the first divergence is printed (random weights have near-ties; the tests in
tests/test_qwen35_llama.py are where agreement is asserted).

--profile adds a per-op breakdown of our decode step (matmul by weight type, DeltaNet, attention,
norms/elementwise, and the Python remainder) by timing each backend call.

Not collected by pytest (no `test_` prefix).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from gguf import GGMLQuantizationType as QT  # noqa: E402

from daemons.synthetic import Qwen35Shape, write_synthetic_qwen35  # noqa: E402

# hidden 1024 (every matrix row a multiple of 256, so Q4_K_M really is Q4_K/Q6_K), 12 layers with
# layers 3, 7, 11 full attention, Qwen3.5's head geometry scaled down.
BENCH_SHAPE = Qwen35Shape(n_embd=1024, n_layer=12, n_ff=3072, n_head=8, n_head_kv=2, head_dim=128,
                          n_k_heads=4, n_v_heads=8, ssm_head_dim=128, n_rot=64)


def build_models(directory: Path, types: list[str]) -> dict[str, Path]:
    from tests.llama_helpers import quantize_with_llama

    f16 = directory / "bench-qwen35-f16.gguf"
    if not f16.exists():
        tmp = f16.with_suffix(".part")
        write_synthetic_qwen35(tmp, BENCH_SHAPE, qtype=QT.F16, seed=0)
        os.replace(tmp, f16)
    out = {}
    for t in types:
        if t == "F16":
            out[t] = f16
            continue
        path = directory / f"bench-qwen35-{t.lower()}.gguf"
        if not path.exists():
            quantize_with_llama(f16, path, t, n_threads=os.cpu_count() or 2)
        out[t] = path
    return out


def prompt_tokens(n_vocab_real: int, n: int) -> list[int]:
    rng = np.random.default_rng(1)
    return [int(t) for t in rng.integers(0, n_vocab_real, size=n)]


# ------------------------------------------------------------------------------------------------
# ours
# ------------------------------------------------------------------------------------------------

def run_ours(path: Path, prompt: list[int], n_decode: int, threads: int, repeats: int) -> dict:
    from daemons.generate import GenerationRequest, generate_all
    from daemons.qwen35 import Qwen35Model
    from daemons.tokenizer import Tokenizer
    from kernels.cpu_backend import CPUBackend

    model = Qwen35Model.load(path, CPUBackend(n_threads=threads))
    tok = Tokenizer.from_metadata(model.metadata)
    req = GenerationRequest(prompt_ids=prompt, max_tokens=n_decode)
    generate_all(model, tok, GenerationRequest(prompt_ids=prompt, max_tokens=4))   # compile, warm
    best = None
    for _ in range(repeats):
        res = generate_all(model, tok, req)
        s = res.stats
        if best is None or s.decode_tok_s > best["decode_tok_s"]:
            best = {"decode_tok_s": s.decode_tok_s, "tokens": list(res.token_ids)}
        best["prefill_tok_s"] = max(best.get("prefill_tok_s", 0.0), s.prefill_tok_s)
    best["weight_mb"] = model.weight_nbytes() / 1e6
    return best


# ------------------------------------------------------------------------------------------------
# llama.cpp
# ------------------------------------------------------------------------------------------------

def run_llama(path: Path, prompt: list[int], n_decode: int, threads: int, repeats: int) -> dict:
    import llama_cpp

    from tests.llama_helpers import open_llama

    # logits only for the last token of each batch, as llama-cli/llama-server compute them; F16 KV
    # cache, llama.cpp's default.
    llm = open_llama(path, n_ctx=len(prompt) + n_decode + 8, n_threads=threads, logits_all=False,
                     f32_kv=False, extra_bufts=True)      # llama.cpp at its fastest (repacked weights)
    sampler = llama_cpp.llama_sampler_init_greedy()
    ctx = llm.ctx

    def once(n: int) -> tuple[float, float, list[int]]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t_prefill = time.perf_counter() - t0
        tokens = [int(llama_cpp.llama_sampler_sample(sampler, ctx, -1))]
        t_first = time.perf_counter()
        while len(tokens) < n:
            llm.eval([tokens[-1]])
            tokens.append(int(llama_cpp.llama_sampler_sample(sampler, ctx, -1)))
        t_decode = time.perf_counter() - t_first
        return t_prefill, t_decode, tokens

    try:
        once(4)                                                         # warm
        best = None
        for _ in range(repeats):
            t_prefill, t_decode, tokens = once(n_decode)
            rate = (n_decode - 1) / t_decode
            if best is None or rate > best["decode_tok_s"]:
                best = {"decode_tok_s": rate, "tokens": tokens}
            best["prefill_tok_s"] = max(best.get("prefill_tok_s", 0.0), len(prompt) / t_prefill)
    finally:
        llama_cpp.llama_sampler_free(sampler)
        llm.close()
    return best


# ------------------------------------------------------------------------------------------------
# profile of our decode step
# ------------------------------------------------------------------------------------------------

class _TimedBackend:
    """Wraps a backend: every call is timed under a category (matmul split by weight type)."""

    _CATEGORY = {
        "matmul": None, "embed": "embedding",
        "deltanet_recurrent": "deltanet (recurrence)", "deltanet_chunked": "deltanet (chunked)",
        "causal_conv1d_silu": "deltanet (conv)", "l2_norm": "deltanet (l2 norm)",
        "gated_rms_norm": "deltanet (gated norm)",
        "attention": "attention (softmax·V)", "rope_neox": "attention (rope)",
        "rms_norm": "rms_norm", "silu_mul": "elementwise", "sigmoid_mul": "elementwise",
    }

    def __init__(self, inner):
        self._inner = inner
        self.times: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in self._CATEGORY or not callable(attr):
            return attr
        from daemons.gguf_reader import type_name

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = attr(*args, **kwargs)
            dt = time.perf_counter() - t0
            cat = self._CATEGORY[name]
            if cat is None:
                w = args[1]
                cat = f"matmul {type_name(int(w.qtype))} ({w.n_out}x{w.n_in})" if w.n_out > 8 else \
                      f"matmul {type_name(int(w.qtype))} (tiny: ssm alpha/beta)"
            self.times[cat] += dt
            self.calls[cat] += 1
            return out
        return timed


def profile_ours(path: Path, prompt: list[int], n_decode: int, threads: int) -> None:
    from daemons.qwen35 import Qwen35Model
    from kernels.cpu_backend import CPUBackend

    inner = CPUBackend(n_threads=threads)
    timed = _TimedBackend(inner)
    model = Qwen35Model.load(path, timed)
    state = model.new_state(len(prompt) + n_decode + 8)
    logits = model.prefill(prompt, state)
    for _ in range(4):                                                  # warm
        logits = model.forward([int(np.argmax(logits[0]))], state)
    timed.times.clear()
    timed.calls.clear()
    t0 = time.perf_counter()
    for _ in range(n_decode):
        logits = model.forward([int(np.argmax(logits[0]))], state)
    total = time.perf_counter() - t0
    per_tok = total / n_decode
    print(f"\nprofile of our decode step ({path.name}, {threads} threads): {per_tok * 1e3:.2f} ms/token")
    print(f"  {'op':44s} {'ms/tok':>8s} {'share':>6s} {'calls/tok':>9s}")
    accounted = 0.0
    for cat, t in sorted(timed.times.items(), key=lambda kv: -kv[1]):
        accounted += t
        print(f"  {cat:44s} {t / n_decode * 1e3:8.3f} {t / total:6.1%} {timed.calls[cat] / n_decode:9.1f}")
    rest = total - accounted
    print(f"  {'python + numpy glue (the rest)':44s} {rest / n_decode * 1e3:8.3f} {rest / total:6.1%}")
    wbytes = model.weight_nbytes()
    print(f"  weights {wbytes / 1e6:.1f} MB -> {wbytes / per_tok / 1e9:.2f} GB/s effective "
          f"(whole file per token; the embedding reads one row)")


# ------------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", type=Path, help="qwen35 GGUF file(s) instead of the synthetic ones")
    ap.add_argument("--types", nargs="+", default=["Q8_0", "Q4_K_M"],
                    help="synthetic model types to build (F16, Q8_0, Q4_K_M, Q4_0, Q6_K)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--decode", type=int, default=64, help="tokens to generate")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, help="where to build/cache the synthetic files")
    ap.add_argument("--profile", action="store_true", help="per-op breakdown of our decode step")
    args = ap.parse_args()
    if args.threads < 1 or args.prompt < 1 or args.decode < 2 or args.repeats < 1:
        ap.error("--threads, --prompt, --repeats must be >= 1 and --decode >= 2")

    from tests.llama_helpers import quiet_llama
    quiet_llama()

    with contextlib.ExitStack() as stack:
        if args.model:
            missing = [str(p) for p in args.model if not p.is_file()]
            if missing:
                ap.error(f"no such file: {missing[0]}")
            models = {p.name: p for p in args.model}
        else:
            directory = args.dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-qwen35-")))
            directory.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            models = build_models(directory, args.types)
            print(f"synthetic qwen35 {BENCH_SHAPE} built in {time.perf_counter() - t0:.1f}s")

        from daemons.gguf_reader import GGUFFile
        rows = []
        for label, path in models.items():
            f = GGUFFile(path)
            n_real = 256                                  # byte tokens: real text, never special
            if "tokenizer.ggml.tokens" in f:
                types = f.get("tokenizer.ggml.token_type") or []
                n_real = sum(1 for t in types if t == 1) or len(f.get("tokenizer.ggml.tokens"))
            f.close()
            prompt = prompt_tokens(n_real, args.prompt)
            ours = run_ours(path, prompt, args.decode, args.threads, args.repeats)
            ref = run_llama(path, prompt, args.decode, args.threads, args.repeats)
            same = next((i for i, (a, b) in enumerate(zip(ours["tokens"], ref["tokens"])) if a != b), None)
            rows.append((label, ours, ref, same))
            if args.profile:
                profile_ours(path, prompt, args.decode, args.threads)

    print(f"\nqwen35 CPU, {args.threads} threads, prompt {args.prompt} tokens, greedy decode {args.decode} tokens "
          f"(best of {args.repeats})")
    print(f"{'model':28s} {'MB':>7s} {'prefill ours':>13s} {'prefill llama':>14s} {'decode ours':>12s} "
          f"{'decode llama':>13s} {'ratio':>6s}  greedy paths")
    for label, ours, ref, same in rows:
        agree = f"identical for {args.decode}" if same is None else f"diverge at token {same}"
        print(f"{label:28s} {ours['weight_mb']:7.1f} {ours['prefill_tok_s']:13.1f} {ref['prefill_tok_s']:14.1f} "
              f"{ours['decode_tok_s']:12.2f} {ref['decode_tok_s']:13.2f} {ours['decode_tok_s'] / ref['decode_tok_s']:6.2f}  {agree}")
    print("(tok/s; ratio = decode ours / llama.cpp)")


if __name__ == "__main__":
    main()
