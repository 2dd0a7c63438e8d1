"""`dflashd bench`: measure decode, verify and prefill speed on this machine.

    dflashd bench --synthetic qwen35-27b-q4km --device cuda:0
    dflashd bench --synthetic tiny                       (CPU)
    dflashd bench --model path/to/model.gguf --device cuda:0 --tokens 64

With `--synthetic`, a GGUF of a real architecture's shape is written with random weights first
(`write_synthetic_gguf`), so anyone can measure a machine without downloading weights:

* `qwen35-27b-q4km`: Qwen3.5/3.6-27B's shape and vocabulary size (248320), weights typed the way
  llama.cpp's Q4_K_M mix types them (`q4_k_m_type`, checked against llama.cpp's own quantiser on a
  16-layer qwen35): Q6_K for output.weight and for attn_v / attn_qkv / ffn_down in the layers
  `use_more_bits` picks, Q4_K elsewhere; the tensors llama.cpp keeps in float (norms, conv, ssm_a,
  dt bias) stay F32. About 16 GB.
* `embedded`: the shape of the embedded default model (issue 7's bounds: 8 layers, 8k vocabulary,
  Q8_0; until models/ ships it), a few MB.
* `tiny`: the test fixture's shape, F32, a few KB.

The quantised blocks are random valid blocks (random bits, finite f16 scales sized so that each
matrix maps unit-RMS activations to O(1) outputs, keeping the activations finite through 64
layers), drawn from a per-type pool and streamed to the file; nothing near the file's size is held
in memory.

What is printed (and written as JSON with --json):

* decode tok/s: greedy single-token steps on top of a `--prefill`-token context, as generation runs
  them (on the GPU step: each step queued before the host reads the token of the one before,
  daemons/qwen35_gpu.py GreedyChain; the `host sync` line times steps that each wait for that token);
* verify ms for each width W (default 1, 8, 16, 23, 32): one forward of W tokens on top of that
  context with logits for all W, as speculative verification runs it (recurrent DeltaNet);
* prefill tok/s for `--prefill` tokens (default 512) from an empty state;
* with `--short-prompts 64,96,128` (GPU step): each such prompt timed as steps of at most 32 tokens
  and as one wide forward, i.e. where the model should switch between them (`wide_batch_min`);
* the bandwidth bound: bytes of weights one decode step reads (every matrix except the embedding
  table, of which one row) over the copy bandwidth measured in the same run (device-to-device copy,
  bytes read + written); the fraction = that time / the measured step time;
* a per-operation breakdown of one decode step: each backend operation synchronised, queued behind
  a busy-wait kernel (so the host's issue time is hidden) and timed alone with device events, i.e.
  the device time the operation's kernels take back to back;
* host overhead per step: the decode step's wall time minus the sum of those device times: the time
  the device waits for Python (launches, argument checks, and the CuPy glue between operations,
  whose own device time is counted here too).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import click
import numpy as np

__all__ = ["BENCH_PRESETS", "BenchPreset", "write_synthetic_gguf", "q4_k_m_type", "run_bench", "bench"]


class BenchError(click.UsageError):
    """A bad bench invocation (conflicting options, a preset too large for the device asked for):
    one line and exit status 2, like the CLI's other user errors."""


# ------------------------------------------------------------------------------------------------
# synthetic models
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchPreset:
    shape: Any           # daemons.synthetic.Qwen35Shape
    n_vocab: int         # 0: the byte vocabulary of daemons.synthetic (269 tokens)
    mix: str             # "f32", "f16", "q8_0", "q4_k_m"
    gpu_only: bool = False
    note: str = ""


def _presets() -> dict[str, BenchPreset]:
    from daemons.synthetic import PRESETS, Qwen35Shape
    return {
        "qwen35-27b-q4km": BenchPreset(PRESETS["qwen35-27b"], 248320, "q4_k_m", gpu_only=True,
                                       note="Qwen3.5/3.6-27B shape, llama.cpp Q4_K_M-like types, ~16.3 GB"),
        "embedded": BenchPreset(Qwen35Shape(n_embd=256, n_layer=8, n_ff=768, n_head=4, n_head_kv=2, head_dim=64,
                                            n_k_heads=2, n_v_heads=4, ssm_head_dim=64, n_rot=16, tied_output=True,
                                            rope_theta=1e7),
                                8192, "q8_0", note="embedded default model's shape (issue 7 bounds), Q8_0"),
        "tiny": BenchPreset(PRESETS["tiny"], 0, "f32", note="test fixture shape, F32"),
    }


BENCH_PRESETS = ("qwen35-27b-q4km", "embedded", "tiny")


def _use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in *_M mixes:
    the first and last eighth, and every third layer in between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


# K-quant -> fallback when a row is not a whole number of 256-weight super-blocks (llama.cpp's table).
_K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def q4_k_m_type(name: str, n_in: int, n_layer: int) -> str:
    """The type llama.cpp's Q4_K_M mix gives matrix `name` (ggml row length n_in), as a type name."""
    if name == "output.weight":
        t = "Q6_K"
    elif name.endswith(("attn_v.weight", "attn_qkv.weight", "ffn_down.weight")):
        # llama.cpp counts attn_v and the fused attn_qkv together; a qwen35 layer has exactly one
        # of the two, so the counter is the layer index.
        il = int(name.split(".")[1])
        t = "Q6_K" if _use_more_bits(il, n_layer) else "Q4_K"
    else:
        t = "Q4_K"
    return _K_FALLBACK[t] if n_in % 256 else t


def _matrix_type(mix: str, name: str, n_in: int, n_layer: int) -> str:
    if mix == "q4_k_m":
        return q4_k_m_type(name, n_in, n_layer)
    if mix == "q8_0":
        return "Q8_0" if n_in % 32 == 0 else "F16"
    if mix in ("f32", "f16"):
        return mix.upper()
    raise BenchError(f"unknown weight mix '{mix}' (q4_k_m, q8_0, f16, f32)")


_POOL_BLOCKS = 1 << 17      # random valid blocks per type, reused (read cyclically) across tensors
_CHUNK_BYTES = 32 << 20     # bytes generated and written at a time


class _BlockPool:
    """Random valid blocks of one type, their scales set so that a row of n_in weights has a dot
    product with a unit-RMS vector of O(1): weight std about 1/sqrt(n_in_ref)."""

    def __init__(self, qtype, n_in_ref: int, rng: np.random.Generator):
        from kernels import ggml_quants
        spec = ggml_quants.quant_spec(qtype)
        probe = ggml_quants.random_raw(qtype, 64, spec.block_size, rng, scale_range=(1.0, 1.0))
        std = float(np.std(ggml_quants.dequantize(probe, qtype, spec.block_size)))
        target = 1.0 / math.sqrt(n_in_ref)
        f = target / max(std, 1e-30)
        self.blocks = ggml_quants.random_raw(qtype, _POOL_BLOCKS, spec.block_size, rng, scale_range=(0.5 * f, 2.0 * f))
        self.block_bytes = spec.block_bytes
        self.block_size = spec.block_size

    def write(self, fout, n_blocks: int, rng: np.random.Generator) -> int:
        """Write n_blocks blocks: the pool read cyclically from a random start (a tensor's data is
        just its rows' blocks in order). Returns the bytes written."""
        flat = self.blocks.reshape(-1)
        pos = int(rng.integers(0, _POOL_BLOCKS))
        left = n_blocks
        while left:
            n = min(left, _POOL_BLOCKS - pos)
            fout.write(memoryview(flat[pos * self.block_bytes:(pos + n) * self.block_bytes]))
            left -= n
            pos = 0
        return n_blocks * self.block_bytes


def _float_values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """The small tensors llama.cpp keeps in float, drawn like daemons.synthetic draws them."""
    if name.endswith("ssm_a"):
        return -np.exp(rng.uniform(-1.0, 1.0, shape))
    if len(shape) == 1 and "norm" in name:
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if len(shape) == 1:
        return 0.5 * rng.standard_normal(shape)
    return rng.standard_normal(shape) / np.sqrt(shape[-1])


def _vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    from daemons.synthetic import byte_vocab
    tokens, types, merges = byte_vocab()
    if n_vocab and n_vocab < len(tokens):
        raise BenchError(f"a vocabulary of {n_vocab} is smaller than the {len(tokens)} byte-level tokens")
    n_pad = max(0, n_vocab - len(tokens))
    n_special = sum(1 for t in types if t == 3)
    head, tail = tokens[:-n_special], tokens[-n_special:]
    pad = [f"[PAD{i}]" for i in range(n_pad)]
    return head + pad + tail, types[:-n_special] + [1] * n_pad + types[-n_special:], merges


def write_synthetic_gguf(path: str | os.PathLike, shape: Any, *, mix: str = "q4_k_m", n_vocab: int = 0,
                         seed: int = 0, name: str = "synthetic-qwen35",
                         progress: Callable[[str], None] | None = None,
                         tensor_types: dict[str, str] | None = None) -> int:
    """Write a qwen35 GGUF of `shape` (daemons.synthetic.Qwen35Shape) with random weights typed by
    `mix` ("q4_k_m", "q8_0", "f16", "f32"), streaming the data (bounded memory). `tensor_types` overrides
    the type of the matrices whose name ends with a key ("ssm_alpha.weight": "F32"; F32, F16, BF16
    or a quantised type). `n_vocab` pads the byte vocabulary with unused tokens up to that size (0:
    the byte vocabulary). Returns the file size."""
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFWriter

    from daemons.synthetic import qwen35_metadata, qwen35_tensor_shapes
    from daemons.gguf_writer import Typed
    from kernels import ggml_quants

    rng = np.random.default_rng(seed)
    tokens, types, merges = _vocab(n_vocab)
    md = qwen35_metadata(shape, tokens, types, merges, name=name)
    shapes = qwen35_tensor_shapes(shape, len(tokens))
    plan: list[tuple[str, tuple[int, ...], str]] = []
    for tname, shp in shapes.items():
        if len(shp) == 1 or "ssm_conv1d" in tname:
            plan.append((tname, shp, "F32"))
        else:
            over = [t for suffix, t in (tensor_types or {}).items() if tname.endswith(suffix)]
            plan.append((tname, shp, over[0] if over else _matrix_type(mix, tname, shp[-1], shape.n_layer)))

    path = os.fspath(path)
    tmp = path + ".partial"
    w = GGUFWriter(tmp, "qwen35")
    from daemons.gguf_writer import _infer
    from gguf import GGUFValueType
    for key, value in md.items():
        if isinstance(value, Typed):
            vtype, item_type, value = value.vtype, value.item_type, value.value
        else:
            vtype, item_type = _infer(value)
        if vtype == GGUFValueType.ARRAY:
            w.add_key_value(key, list(value), vtype, sub_type=item_type or _infer(list(value))[1])
        else:
            w.add_key_value(key, value, vtype)
    for tname, shp, tn in plan:
        qt = QT[tn]
        if tn == "F32":
            w.add_tensor_info(tname, shp, np.dtype(np.float32), int(np.prod(shp)) * 4)
        elif tn == "F16":
            w.add_tensor_info(tname, shp, np.dtype(np.float16), int(np.prod(shp)) * 2)
        else:
            rb = ggml_quants.row_bytes(qt, shp[-1])
            n_rows = int(np.prod(shp[:-1]))
            w.add_tensor_info(tname, (n_rows, rb), np.dtype(np.uint8), n_rows * rb, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    align = w.data_alignment
    pools: dict[str, _BlockPool] = {}
    t0 = time.perf_counter()
    for i, (tname, shp, tn) in enumerate(plan):
        pad = (-fout.tell()) % align
        if pad:
            fout.write(b"\0" * pad)
        n_rows, n_in = int(np.prod(shp[:-1])), shp[-1]
        written = 0
        if tn == "BF16":
            rows_per_chunk = max(1, _CHUNK_BYTES // (4 * n_in))
            for r0 in range(0, n_rows, rows_per_chunk):
                n = min(rows_per_chunk, n_rows - r0)
                u = (rng.standard_normal((n, n_in), dtype=np.float32) / np.float32(math.sqrt(n_in))).view(np.uint32)
                data = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)  # nearest even
                data.tofile(fout)
                written += data.nbytes
        elif tn in ("F32", "F16"):
            dt = np.float32 if tn == "F32" else np.float16
            if len(shp) == 1 or "ssm_conv1d" in tname:
                data = _float_values(tname, shp, rng).astype(dt)
                data.tofile(fout)
                written = data.nbytes
            else:
                rows_per_chunk = max(1, _CHUNK_BYTES // (4 * n_in))
                for r0 in range(0, n_rows, rows_per_chunk):
                    n = min(rows_per_chunk, n_rows - r0)
                    data = (rng.standard_normal((n, n_in), dtype=np.float32) / np.float32(math.sqrt(n_in))).astype(dt)
                    data.tofile(fout)
                    written += data.nbytes
        else:
            pool = pools.get(tn)
            if pool is None:
                pool = pools[tn] = _BlockPool(QT[tn], shape.n_embd, rng)
            written = pool.write(fout, n_rows * (n_in // pool.block_size), rng)
        pad = (-written) % align
        if pad:
            fout.write(b"\0" * pad)
        if progress and (i % 64 == 0 or i == len(plan) - 1):
            progress(f"  wrote {i + 1}/{len(plan)} tensors, {fout.tell() / 1e9:.2f} GB, "
                     f"{time.perf_counter() - t0:.1f} s")
    w.close()
    os.replace(tmp, path)
    return os.path.getsize(path)


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------

_OPS = ("embed", "matmul", "rms_norm", "l2_norm", "rope_neox", "silu_mul", "sigmoid_mul", "gated_rms_norm",
        "causal_conv1d_silu", "deltanet_recurrent", "deltanet_chunked", "attention", "argmax")


def _sync(backend) -> None:
    fn = getattr(backend, "synchronize", None)
    if fn is not None:
        fn()


class _Timer:
    """Device time of a region: CUDA events on a GPU backend, the host clock on the CPU.

    On a GPU a busy-wait kernel (`busy_wait`) is queued first, longer than the host takes to issue
    the region, so the region's kernels run back to back behind it and the events measure the
    device's time alone, not the gaps while Python issues the next launch."""

    def __init__(self, backend, cover_s: float = 2e-3):
        self.backend = backend
        self.cover_s = cover_s
        xp = getattr(backend, "xp", None)
        self.cp = xp if hasattr(xp, "cuda") else None          # CuPy: device events; numpy: the host clock

    def __call__(self, fn: Callable[[], Any], cover_s: float | None = None) -> tuple[float, float, Any]:
        """(device seconds, host seconds to issue, result) of fn(), synchronised before and after."""
        _sync(self.backend)
        if self.cp is None:
            t0 = time.perf_counter()
            res = fn()
            t1 = time.perf_counter()
            return t1 - t0, t1 - t0, res
        start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
        busy_wait = getattr(self.backend, "busy_wait", None)
        if busy_wait is not None:
            busy_wait(self.cover_s if cover_s is None else cover_s)
        h0 = time.perf_counter()
        start.record()
        res = fn()
        end.record()
        h1 = time.perf_counter()
        end.synchronize()
        return self.cp.cuda.get_elapsed_time(start, end) / 1e3, h1 - h0, res


class _ProfilingBackend:
    """Wraps a backend; each interface operation is synchronised and timed alone (device time) and
    recorded under a label (matmuls by weight name and type)."""

    def __init__(self, backend, labels: dict[int, str]):
        self._b = backend
        self._timer = _Timer(backend)
        self._labels = labels
        self.records: list[tuple[str, float, float]] = []

    def __getattr__(self, name):
        attr = getattr(self._b, name)
        if name not in _OPS:
            return attr

        def timed(*args, **kwargs):
            label = name
            if name == "matmul" and len(args) > 1:
                label = "matmul " + self._labels.get(id(args[1]), "?")
            dev, host, res = self._timer(lambda: attr(*args, **kwargs))
            self.records.append((label, dev, host))
            return res
        return timed


def _weight_labels(model) -> tuple[dict[int, str], int, int]:
    """id(weight) -> 'kind TYPE' for every matrix of the model; bytes read per decode step (all
    matrices but the embedding table, plus one embedding row); bytes of all matrices."""
    b = model.backend
    labels: dict[int, str] = {}
    total = 0

    def type_name(w) -> str:
        tn = getattr(w, "type_name", None)
        if tn is None:
            q = getattr(w, "qtype", None)
            tn = getattr(q, "name", str(q))
        return tn

    for kind, w in _named_weights(model):
        if id(w) not in labels:
            labels[id(w)] = f"{kind} {type_name(w)}"
            total += b.weight_nbytes(w)
    emb_row = b.weight_nbytes(model.token_embd) // max(model.token_embd.n_out, 1)
    per_step = emb_row + sum(b.weight_nbytes(w) for kind, w in _named_weights(model) if kind != "token_embd")
    return labels, per_step, total


def _named_weights(model) -> Iterator[tuple[str, Any]]:
    """(kind, matrix) for every matrix a forward reads: token_embd, each layer's, then output."""
    yield "token_embd", model.token_embd
    for layer in model.layers:
        for field in ("ffn_gate", "ffn_up", "ffn_down"):
            yield field, getattr(layer, field)
        for field, w in vars(layer.mixer).items():
            if hasattr(w, "n_out"):
                yield field, w
    yield ("output" if model.output is not model.token_embd else "output(tied)"), model.output


def copy_bandwidth(backend, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + written), best of several."""
    xp = backend.xp
    n = max(1, nbytes // 4)
    a = xp.ones(n, dtype=xp.float32)
    b = xp.empty_like(a)
    timer = _Timer(backend)
    best = math.inf
    for _ in range(6):
        dev, _, _ = timer(lambda: xp.copyto(b, a))
        best = min(best, dev)
    del a, b
    return 2.0 * n * 4 / best


def _attention_kernels(step, n_keys: int) -> str | None:
    """Which attention kernels the GPU step runs, and with how many key splits at n_keys keys."""
    if not getattr(step, "attn_layers", None):
        return None
    from kernels.fused_gpu import ATT_SPLIT_CAP_FMA, ATT_SPLIT_CAP_TC, ATT_TC_MTILES, att_launch_splits
    tc = step.att_tc
    kind = (f"tensor cores (attn_partial_tc, {ATT_TC_MTILES} m-tiles a block; decode rows attn_partial_tcd)" if tc
            else "FMA (attn_partial_g<R>)")
    return (f"{kind}, {att_launch_splits(n_keys, tc)} key splits at {n_keys} keys "
            f"(at most {ATT_SPLIT_CAP_TC if tc else ATT_SPLIT_CAP_FMA})")


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} B"


@dataclass
class BenchResult:
    data: dict

    def lines(self) -> list[str]:
        d = self.data
        out = [f"model        {d['model']}  ({_fmt_bytes(d['weights_gb'] * 1e9)} of matrices, device {d['device']})",
               f"copy bw      {d['copy_GBps']:.0f} GB/s (device-to-device, read + write)",
               f"prefill      {d['prefill_tokens']} tokens: {d['prefill_ms']:.1f} ms = {d['prefill_tok_s']:.1f} tok/s",
               f"decode       {d['decode_tok_s']:.2f} tok/s ({d['decode_ms']:.2f} ms/step, {d['decode_steps']} steps "
               f"on a {d['context']}-token context)",
               "verify       " + ", ".join(f"W={w}: {ms:.2f} ms" for w, ms in d["verify_ms"].items()),
               f"bandwidth    {_fmt_bytes(d['bytes_per_step'])} of weights per step -> bound "
               f"{d['bound_ms']:.3f} ms; decode at {100 * d['bound_fraction']:.1f}% of the bound",
               (f"host         {d['host_overhead_ms']:.2f} ms/step of host overhead (decode step "
                f"{d['decode_ms']:.2f} ms - {d['device_busy_ms']:.2f} ms of device time in the backend's operations)"
                if d["ops"] and "graph_device_ms" not in d else
                f"host         {d['host_overhead_ms']:.3f} ms/step of host overhead (decode step "
                f"{d['decode_ms']:.3f} ms - {d['graph_device_ms']:.3f} ms device time of its CUDA graph"
                f"{', programmatic dependent launch' if d.get('pdl') else ''})"
                if "graph_device_ms" in d else "host         not measured (--no-profile)")]
        if "sync_step_ms" in d:
            out.append(f"host sync    {d['sync_step_ms']:.3f} ms/step ({1e3 / d['sync_step_ms']:.2f} tok/s) when each step "
                       f"waits for the token before it: {d['sync_step_ms'] - d['graph_device_ms']:.3f} ms of host time a "
                       f"step, which the decode loop above hides (it queues the next step first)")
        if d.get("pdl_error"):
            out.append(f"pdl          not used: {d['pdl_error']}")
        if d.get("attention"):
            out.append(f"attention    {d['attention']}")
        if "commit_ms" in d:
            out.insert(5, "rollback     " + ", ".join(f"W={w}: {ms:.2f} ms" for w, ms in d["commit_ms"].items())
                       + "  (commit of a verified block: replay of the kept prefix)")
            out.insert(6, f"verify/decode W=23: {d['verify_23_over_decode']:.2f}x")
        if d.get("per_op_sum_ms") == d.get("per_op_sum_ms") and "graph_device_ms" in d and d["ops"]:
            out.append(f"graph        {d['graph_device_ms']:.3f} ms on the device; its launches one by one "
                       f"{d['per_op_sum_ms']:.3f} ms (the difference: launch gaps inside the graph)")
        if d.get("verify_graph_ms"):
            out.append("verify graph " + ", ".join(f"W={w}: {ms:.2f} ms" for w, ms in d["verify_graph_ms"].items())
                       + "  (device time of each verify step's CUDA graph)")
        for n, sp in (d.get("short_prompts") or {}).items():
            out.append(f"prompt {n:<6d} steps of <= 32 tokens {sp['steps_ms']:.1f} ms, one wide forward {sp['wide_ms']:.1f} ms"
                       f" (the model runs it as {sp['used']})")
        if d.get("ops"):
            out.append("per-op (one decode step; each op synchronised, queued behind a busy-wait and timed alone "
                       "with device events):" if "graph_device_ms" not in d else
                       "per-launch (one decode step's launches run back to back behind a busy-wait, each between "
                       "two events; grouped by kind over the layers):")
            out.append(f"  {'op':40s} {'n':>4s} {'device ms':>10s} {'host ms':>9s} {'GB/s':>8s}")
            for row in d["ops"]:
                gbs = f"{row['GBps']:.0f}" if row.get("GBps") else ""
                out.append(f"  {row['op']:40s} {row['n']:4d} {row['device_ms']:10.3f} {row['host_ms']:9.3f} {gbs:>8s}")
        return out


def _op_kind(label: str) -> str:
    """A launch label of the GPU step without its layer: 'mm ffn_down Q6_K', 'gdn_conv', ..."""
    return label.split(".", 2)[2] if label.startswith("blk.") else label


def _bench_gpu_step(model, *, tokens: int, widths, prefill: int, rng, profile: bool,
                    log: Callable[[str], None], short_prompts=()) -> dict:
    """The GPU step (daemons/qwen35_gpu.py): every step one CUDA graph launch. Decode and verify are
    timed as the serving loop runs them (greedy: only token ids come back); the graph's own device
    time is timed with events behind a busy-wait, and each of its launches alone the same way."""
    b, step, cp = model.backend, model.gpu_step, model.backend.xp
    n_vocab = model.n_vocab
    max_ctx = prefill + tokens + max(widths) + 16
    prompt = rng.integers(0, n_vocab, size=prefill).tolist()
    timer = _Timer(b)

    # warm-up: captures every graph the timed runs use
    st = model.new_state(max_ctx)
    model.prefill(prompt, st, logits="last")
    tok = int(model.forward([1], st.copy(), logits="argmax_last")[0])
    for wdt in widths:
        s2 = st.copy()
        _, _, rec = model.verify(rng.integers(0, n_vocab, size=wdt).tolist(), s2, logits="argmax")
        model.rollback(s2, rec, wdt)
    _sync(b)

    prefill_s = math.inf
    for _ in range(2):
        st = model.new_state(max_ctx)
        _sync(b)
        t0 = time.perf_counter()
        out = model.prefill(prompt, st, logits="last")
        _sync(b)
        prefill_s = min(prefill_s, time.perf_counter() - t0)
    log(f"prefill {prefill} tokens: {prefill_s * 1e3:.1f} ms")
    context = st.copy()
    tok = int(np.argmax(out[-1]))

    # greedy decoding as the serving loop runs it (daemons/generate.py): each step queued before the
    # host reads the token of the step before (GreedyChain), so the host's time hides behind the device
    first, times = tok, []
    with step.greedy_chain(st) as chain:
        for i in range(tokens + 3):
            t0 = time.perf_counter()
            tok = chain.next(tok, ahead=i + 1 < tokens + 3)
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[3:])
    log(f"decode {1.0 / step_s:.2f} tok/s")
    # and one step at a time (launch, wait for the token, launch the next): what the host adds to a step
    s_sync, tok, sync_times = context.copy(), first, []
    for _ in range(tokens + 3):
        t0 = time.perf_counter()
        tok = int(model.forward([tok], s_sync, logits="argmax_last")[0])
        sync_times.append(time.perf_counter() - t0)
    sync_step_s = statistics.median(sync_times[3:])

    # verify as a speculative loop runs it: on the sequence's own state, which the step has bound
    # (a fresh copy each time would time binding ~450 device pointers anew, ~0.5 ms of host work a
    # serving loop does not do), restored in place to the same context before each block
    verify_ms, commit_ms = {}, {}
    s2 = context.copy()
    for wdt in widths:
        ids = rng.integers(0, n_vocab, size=wdt).tolist()
        reps, creps = [], []
        for _ in range(5):
            s2.copy_from(context)
            _sync(b)
            t0 = time.perf_counter()
            _, _, rec = model.verify(ids, s2, logits="argmax")
            t1 = time.perf_counter()
            model.rollback(s2, rec, max(1, wdt // 2))
            _sync(b)
            t2 = time.perf_counter()
            reps.append(t1 - t0)
            creps.append(t2 - t1)
        verify_ms[wdt] = statistics.median(reps) * 1e3
        commit_ms[wdt] = statistics.median(creps) * 1e3
    log("verify " + ", ".join(f"{w}: {ms:.2f} ms" for w, ms in verify_ms.items()))

    # device time of the decode graph alone (behind a busy-wait, so the host's launch is hidden)
    s3 = context.copy()
    step._bind(s3)
    key = step.plan_key(1, "advance", "last", s3.n_past + 1)
    graph_ms = []
    for _ in range(7):
        dev, _, _ = timer(lambda: step._launch(key, None), cover_s=2e-3)
        graph_ms.append(dev * 1e3)
    graph_dev_ms = statistics.median(graph_ms)

    # device time of each verify graph alone: the host-timed verify above moves by ~0.4 ms between
    # runs (it includes the host's launch and the ids' copy back), too much to see a kernel's change
    verify_graph_ms = {}
    for wdt in widths:
        s2.copy_from(context)
        model.verify(rng.integers(0, n_vocab, size=wdt).tolist(), s2, logits="argmax")   # uploads the params
        vkey = step.plan_key(wdt, "verify", "all", context.n_past + wdt)
        reps = []
        for _ in range(5):
            dev, _, _ = timer(lambda: step._launch(vkey, None), cover_s=2e-3)
            reps.append(dev * 1e3)
        verify_graph_ms[wdt] = statistics.median(reps)

    short = _short_prompts(model, short_prompts, rng, log) if short_prompts else {}

    ops_rows, per_op_sum = [], float("nan")
    if profile:
        ops = step.ops_for(1, "advance", "last", n_keys=context.n_past + 1)
        s4 = context.copy()
        step._bind(s4)
        start_evs = [cp.cuda.Event() for _ in ops]
        end_evs = [cp.cuda.Event() for _ in ops]
        _sync(b)
        b.busy_wait(20e-3)
        for op, e0, e1 in zip(ops, start_evs, end_evs):
            e0.record()
            op()
            e1.record()
        end_evs[-1].synchronize()
        agg: dict[str, list[float]] = {}
        for op, e0, e1 in zip(ops, start_evs, end_evs):
            a = agg.setdefault(_op_kind(op.label), [0, 0.0, 0])
            a[0] += 1
            a[1] += cp.cuda.get_elapsed_time(e0, e1)
            a[2] += getattr(op, "weight_bytes", 0)
        per_op_sum = sum(v[1] for v in agg.values())
        for label, (n, ms, nbytes) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
            row = {"op": label, "n": n, "device_ms": ms, "host_ms": 0.0}
            if nbytes and ms > 0:
                row["GBps"] = nbytes / (ms / 1e3) / 1e9
            ops_rows.append(row)
    return {"prefill_s": prefill_s, "step_s": step_s, "sync_step_s": sync_step_s, "verify_ms": verify_ms,
            "commit_ms": commit_ms,
            "graph_dev_ms": graph_dev_ms, "verify_graph_ms": verify_graph_ms, "per_op_sum_ms": per_op_sum,
            "ops": ops_rows, "short_prompts": short}


def _short_prompts(model, lengths, rng, log: Callable[[str], None]) -> dict:
    """A prompt of each length from an empty state both ways a GPU model can run it: as steps of at
    most 32 tokens (one CUDA graph each) and as one wide forward (the backend operations: every
    tensor-core matrix dequantised to f16 for cuBLAS: 76-135 ms on the H200 whatever the length). The model
    switches at `backend.wide_batch_min` tokens; these figures say where it should."""
    b = model.backend
    in_use = getattr(b, "wide_batch_min", math.inf)
    res = {}
    try:
        for n in lengths:
            prompt = rng.integers(0, model.n_vocab, size=n).tolist()
            ms = {}
            for path, threshold in (("steps", math.inf), ("wide", 1)):
                b.wide_batch_min = threshold
                best = math.inf
                for _ in range(3):                  # the first run captures graphs / sets up cuBLAS
                    st = model.new_state(n + 8)
                    _sync(b)
                    t0 = time.perf_counter()
                    model.forward(prompt, st, logits="last")
                    _sync(b)
                    best = min(best, time.perf_counter() - t0)
                ms[path] = best * 1e3
            res[n] = {"steps_ms": ms["steps"], "wide_ms": ms["wide"], "used": "wide" if n >= in_use else "steps"}
            log(f"prompt {n} tokens: steps {ms['steps']:.1f} ms, wide {ms['wide']:.1f} ms")
    finally:
        b.wide_batch_min = in_use
    return res


def _figures(model, copy_bps: float, bytes_per_step: int, total_bytes: int, prefill: int, prefill_s: float,
             tokens: int, step_s: float, verify_ms: dict) -> dict:
    """The figures both paths report: speeds and the fraction of the bandwidth bound."""
    bound_s = bytes_per_step / copy_bps
    return {
        "model": str(model.path), "device": getattr(model.backend, "device", "cpu"), "weights_gb": total_bytes / 1e9,
        "copy_GBps": copy_bps / 1e9, "prefill_tokens": prefill, "prefill_ms": prefill_s * 1e3,
        "prefill_tok_s": prefill / prefill_s, "decode_steps": tokens, "context": prefill,
        "decode_ms": step_s * 1e3, "decode_tok_s": 1.0 / step_s, "verify_ms": verify_ms,
        "verify_23_over_decode": verify_ms.get(23, float("nan")) / (step_s * 1e3),
        "bytes_per_step": bytes_per_step, "bound_ms": bound_s * 1e3, "bound_fraction": bound_s / step_s,
        "n_layer": model.hparams.n_layer, "n_vocab": model.n_vocab,
    }


def run_bench(model, *, tokens: int = 32, widths=(1, 8, 16, 23, 32), prefill: int = 512, seed: int = 0,
              copy_bytes: int | None = None, profile: bool = True, log: Callable[[str], None] = print,
              short_prompts=()) -> BenchResult:
    """Measure `model` (a loaded Qwen35Model on any backend); see the module docstring."""
    b = model.backend
    rng = np.random.default_rng(seed)
    n_vocab = model.n_vocab
    max_ctx = prefill + max(tokens, 1) + max(widths) + 16
    labels, bytes_per_step, total_bytes = _weight_labels(model)
    is_gpu = getattr(b, "name", "cpu") != "cpu"
    if copy_bytes is None:
        copy_bytes = (1 << 30) if is_gpu else (256 << 20)
    copy_bps = copy_bandwidth(b, copy_bytes)
    log(f"copy bandwidth {copy_bps / 1e9:.0f} GB/s")

    if getattr(model, "gpu_step", None) is not None:
        r = _bench_gpu_step(model, tokens=tokens, widths=widths, prefill=prefill, rng=rng, profile=profile, log=log,
                            short_prompts=short_prompts)
        step_s = r["step_s"]
        data = _figures(model, copy_bps, bytes_per_step, total_bytes, prefill, r["prefill_s"], tokens, step_s,
                        r["verify_ms"])
        data.update({
            "commit_ms": r["commit_ms"], "verify_graph_ms": r["verify_graph_ms"],
            "device_busy_ms": r["graph_dev_ms"], "graph_device_ms": r["graph_dev_ms"],
            "per_op_sum_ms": r["per_op_sum_ms"], "profiled_step_ms": float("nan"),
            "host_overhead_ms": step_s * 1e3 - r["graph_dev_ms"], "ops": r["ops"], "short_prompts": r["short_prompts"],
            "sync_step_ms": r["sync_step_s"] * 1e3,
            "path": "gpu_step (CUDA graph per step)",
            "pdl": bool(getattr(b, "pdl_used", False)), "pdl_error": getattr(b, "pdl_error", None),
            "attention": _attention_kernels(model.gpu_step, prefill + 1),
        })
        return BenchResult(data)

    prompt = rng.integers(0, n_vocab, size=prefill).tolist()
    # Warm-up: compiles every kernel shape the timed runs use (prefill chunk, decode, each width).
    st = model.new_state(max_ctx)
    model.forward(prompt[:min(prefill, 64)], st, logits="last")
    model.forward(prompt[:1], st)
    for wdt in widths:
        model.forward(rng.integers(0, n_vocab, size=wdt).tolist(), st.copy(), logits="all", deltanet_mode="recurrent")
    _sync(b)

    # Prefill from an empty state (best of 2).
    prefill_s = math.inf
    for _ in range(2):
        st = model.new_state(max_ctx)
        _sync(b)
        t0 = time.perf_counter()
        logits = model.prefill(prompt, st, chunk=prefill, logits="last")
        _sync(b)
        prefill_s = min(prefill_s, time.perf_counter() - t0)
    log(f"prefill {prefill} tokens: {prefill_s * 1e3:.1f} ms")
    context_state = st.copy()

    # Greedy decode.
    tok = int(np.argmax(logits[-1]))
    times = []
    for i in range(tokens + 2):
        t0 = time.perf_counter()
        logits = model.forward([tok], st)
        tok = int(np.argmax(logits[-1]))
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[2:]) if len(times) > 2 else times[-1]
    log(f"decode {1.0 / step_s:.2f} tok/s")

    # Verify widths on top of the context.
    verify_ms = {}
    for wdt in widths:
        ids = rng.integers(0, n_vocab, size=wdt).tolist()
        reps = []
        for _ in range(5):
            s2 = context_state.copy()
            _sync(b)
            t0 = time.perf_counter()
            model.forward(ids, s2, logits="all", deltanet_mode="recurrent")
            _sync(b)
            reps.append(time.perf_counter() - t0)
        verify_ms[wdt] = statistics.median(reps) * 1e3
    log("verify " + ", ".join(f"{w}: {ms:.2f} ms" for w, ms in verify_ms.items()))

    # One profiled decode step: device time per operation.
    ops, device_busy, profiled_wall = [], float("nan"), float("nan")
    if profile:
        prof = _ProfilingBackend(b, labels)
        s3 = context_state.copy()
        model.forward([tok], s3)                      # the same step once unprofiled (caches warm)
        s3 = context_state.copy()
        model.backend = prof
        try:
            _sync(b)
            t0 = time.perf_counter()
            model.forward([tok], s3)
            _sync(b)
            profiled_wall = time.perf_counter() - t0
        finally:
            model.backend = b
        device_busy = sum(r[1] for r in prof.records)
        agg: dict[str, list[float]] = {}
        for label, dev, host in prof.records:
            a = agg.setdefault(label, [0, 0.0, 0.0])
            a[0] += 1
            a[1] += dev
            a[2] += host
        size_of = {labels[id(w)]: b.weight_nbytes(w) for _, w in _named_weights(model)}
        for label, (n, dev, host) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
            row = {"op": label, "n": n, "device_ms": dev * 1e3, "host_ms": host * 1e3}
            if label.startswith("matmul ") and dev > 0:
                row["GBps"] = n * size_of.get(label[len("matmul "):], 0) / dev / 1e9
            ops.append(row)
    # Host overhead of a step: its wall time minus the device time of the backend's operations.
    # The CuPy glue between operations (residual adds, softplus, slicing into the KV cache) is
    # counted as overhead: it is launch-bound too, and a captured step would fuse it away.
    host_overhead = step_s - device_busy if profile else float("nan")
    data = _figures(model, copy_bps, bytes_per_step, total_bytes, prefill, prefill_s, tokens, step_s, verify_ms)
    data.update({"device_busy_ms": device_busy * 1e3, "profiled_step_ms": profiled_wall * 1e3,
                 "host_overhead_ms": host_overhead * 1e3, "ops": ops})
    return BenchResult(data)


# ------------------------------------------------------------------------------------------------
# command
# ------------------------------------------------------------------------------------------------

def _parse_widths(text: str, flag: str = "--widths", limit: int = 256) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.split(",") if w.strip())
    except ValueError:
        raise BenchError(f"{flag} must be comma-separated integers, got '{text}'") from None
    if not widths or any(w < 1 or w > limit for w in widths):
        raise BenchError(f"{flag} must be integers in 1..{limit}, got '{text}'")
    return widths


@click.command("bench")
@click.option("--model", "model_path", type=click.Path(dir_okay=False), default=None, help="a qwen35 GGUF to measure")
@click.option("--synthetic", type=click.Choice(BENCH_PRESETS), default=None,
              help="write a random-weight GGUF of this shape first and measure it")
@click.option("--synthetic-path", type=click.Path(dir_okay=False), default=None,
              help="where to write (or reuse) the synthetic GGUF (default: a temporary file, deleted after)")
@click.option("--write-only", is_flag=True, help="only write the synthetic GGUF, measure nothing")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda:N or hip:N")
@click.option("--tokens", type=click.IntRange(1, 100000), default=32, show_default=True, help="decode steps timed")
@click.option("--prefill", type=click.IntRange(1, 1 << 20), default=512, show_default=True,
              help="prompt length for the prefill figure (also the context decode and verify run on)")
@click.option("--widths", default="1,8,16,23,32", show_default=True, help="verify widths")
@click.option("--short-prompts", default="", help="GPU: prompt lengths (e.g. 64,96,128) timed both as steps and as "
              "one wide forward, to see where the model should switch (backend.wide_batch_min)")
@click.option("--no-profile", is_flag=True, help="skip the per-operation breakdown")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="also write the results here")
@click.option("--seed", type=int, default=0, show_default=True)
def bench(model_path, synthetic, synthetic_path, write_only, device, tokens, prefill, widths, short_prompts,
          no_profile, json_path, seed):
    """Measure decode tok/s, verify ms, prefill tok/s, the fraction of the bandwidth bound and the
    host overhead per step, on a GGUF or on a synthetic model of a real shape."""
    if (model_path is None) == (synthetic is None):
        raise BenchError("give exactly one of --model or --synthetic")
    widths_t = _parse_widths(widths)
    short_t = _parse_widths(short_prompts, "--short-prompts", 4096) if short_prompts else ()
    if short_t and device == "cpu":
        raise BenchError("--short-prompts compares the GPU step with the wide forward; give --device cuda:N")
    presets = _presets()
    cleanup = None
    if synthetic is not None:
        preset = presets[synthetic]
        if preset.gpu_only and device == "cpu" and not write_only:
            raise BenchError(f"--synthetic {synthetic} ({preset.note}) is for a GPU; use --device cuda:N "
                             f"(or --synthetic embedded / tiny on the CPU)")
        if synthetic_path is None and write_only:
            raise BenchError("--write-only needs --synthetic-path (where to keep the file)")
        if synthetic_path is None:
            fd, synthetic_path = tempfile.mkstemp(suffix=f"-{synthetic}.gguf")
            os.close(fd)
            os.unlink(synthetic_path)
            cleanup = synthetic_path
        name = f"dflashd-bench-{synthetic}-seed{seed}"
        if not (os.path.exists(synthetic_path) and _file_name(synthetic_path) == name):
            click.echo(f"writing {synthetic} ({preset.note}) to {synthetic_path}", err=True)
            t0 = time.perf_counter()
            size = write_synthetic_gguf(synthetic_path, preset.shape, mix=preset.mix, n_vocab=preset.n_vocab,
                                        seed=seed, name=name, progress=lambda m: click.echo(m, err=True))
            click.echo(f"wrote {size / 1e9:.3f} GB in {time.perf_counter() - t0:.1f} s", err=True)
        else:
            click.echo(f"reusing {synthetic_path}", err=True)
        model_path = synthetic_path
        if write_only:
            return
    elif write_only:
        raise BenchError("--write-only needs --synthetic")
    try:
        from kernels import get_backend
        from daemons.qwen35 import Qwen35Model
        backend = get_backend(device)
        t0 = time.perf_counter()
        model = Qwen35Model.load(model_path, backend)
        _sync(backend)
        click.echo(f"loaded {model_path} on {backend.device} in {time.perf_counter() - t0:.1f} s", err=True)
        result = run_bench(model, tokens=tokens, widths=widths_t, prefill=prefill, seed=seed,
                           profile=not no_profile, log=lambda m: click.echo(m, err=True), short_prompts=short_t)
    finally:
        if cleanup is not None and os.path.exists(cleanup):
            os.unlink(cleanup)
    for line in result.lines():
        click.echo(line)
    if json_path:
        Path(json_path).write_text(json.dumps(result.data, indent=1, default=float))


def _file_name(path: str) -> str | None:
    """general.name of a GGUF, or None if it cannot be read."""
    try:
        from daemons.gguf_reader import GGUFFile
        f = GGUFFile(path)
        try:
            return f.get_str("general.name")
        finally:
            f.close()
    except Exception:
        return None
