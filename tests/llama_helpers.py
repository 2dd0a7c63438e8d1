"""llama.cpp (through llama-cpp-python) as an oracle for tests and benchmarks.

    quantize_with_llama(f16_gguf, out_gguf, "Q4_K_M")     # llama.cpp's own quantiser
    llm = open_llama(path, n_ctx=128)                      # logits of every position kept
    logits = llama_prompt_logits(llm, prompt)              # float32 [T, V]
    run = llama_greedy(llm, prompt, 32)                    # llama.cpp's greedy sampler, with logits

Conventions, so that a comparison measures the model and nothing else:
- The KV cache is float32 (`type_k = type_v = GGML_TYPE_F32`) by default: llama.cpp's default F16
  cache rounds K and V to half precision, ~1e-3 relative, while ours keeps float32. `f32_kv=False`
  gives llama.cpp's defaults (the tests report that figure too).
- Greedy tokens come from llama.cpp's own greedy sampler (`llama_sampler_init_greedy`: the first
  maximum, i.e. the lowest index on ties, like `np.argmax` and our `argmax_lowest`); the logits it
  sampled from are returned alongside so a test can also check the argmax and the top-1 margin.
- Weights stay in llama.cpp's plain CPU buffers (`use_extra_bufts` off) unless `extra_bufts=True`:
  on CPUs with AMX (Sapphire Rapids and later) the extra buffer types route Q8_0 matrices through
  the AMX kernels, which crash (SIGSEGV in `llama_decode`) on the tiny fixture models' shapes. The
  oracle's arithmetic is the same ggml dot products either way; the CPU benchmark keeps them on to
  measure llama.cpp at its fastest.
- llama.cpp's log output is silenced (the `llama-cpp-python` logger at ERROR), since the quantiser
  prints one line per tensor.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

import llama_cpp

GGML_TYPE_F32 = 0

# llama.cpp file types its quantiser can produce (the ones tests and benchmarks use).
LLAMA_FTYPES = {
    "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
}


class LlamaQuantizeError(RuntimeError):
    """llama.cpp's quantiser refused a file (its log, silenced here, says why)."""


def quiet_llama() -> None:
    """Silence llama.cpp's INFO/WARN log lines (errors still print)."""
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)


def quantize_with_llama(src: str | os.PathLike, dst: str | os.PathLike, ftype: str = "Q4_K_M",
                        n_threads: int = 2) -> Path:
    """Quantise `src` (an F32/F16 GGUF) into `dst` with llama.cpp's quantiser and its default
    parameters (`llama_model_quantize_default_params()`), i.e. what `llama-quantize src dst FTYPE`
    writes, including its per-tensor type mix and its fall-backs for rows that are not a multiple
    of the K-quant block (256). Written to a temporary name first, so `dst` is always complete."""
    if ftype not in LLAMA_FTYPES:
        raise ValueError(f"ftype must be one of {sorted(LLAMA_FTYPES)}, got {ftype!r}")
    quiet_llama()
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".part")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[ftype]
    params.nthread = int(n_threads)
    rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(tmp), params)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise LlamaQuantizeError(f"llama_model_quantize({src} -> {ftype}) failed with code {rc}")
    os.replace(tmp, dst)
    return dst


def tensor_types(path: str | os.PathLike) -> dict[str, str]:
    """{tensor name: GGML type name} as written in the file (read with our GGUF reader)."""
    from daemons.gguf_reader import GGUFFile, type_name

    f = GGUFFile(path)
    try:
        return {name: type_name(t.qtype) for name, t in f.tensors.items()}
    finally:
        f.close()


def matrix_type_counts(path: str | os.PathLike) -> dict[str, int]:
    """How many 2-D weight matrices the file stores in each GGML type, e.g. {'Q4_K': 40, 'Q6_K': 9}.
    (1-D tensors and the DeltaNet conv kernel are always F32 and left out.)"""
    from daemons.gguf_reader import GGUFFile, type_name

    f = GGUFFile(path)
    try:
        counts = Counter(type_name(t.qtype) for name, t in f.tensors.items()
                         if len(t.ne) == 2 and "ssm_conv1d" not in name)
    finally:
        f.close()
    return dict(sorted(counts.items()))


def open_llama(path: str | os.PathLike, n_ctx: int, n_threads: int = 2, *, logits_all: bool = True,
               f32_kv: bool = True, n_batch: int = 512, extra_bufts: bool = False) -> "llama_cpp.Llama":
    """A llama.cpp context on `path` (CPU only); see the module docstring for `f32_kv` and `extra_bufts`."""
    quiet_llama()
    kv = dict(type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32) if f32_kv else {}
    # Llama() takes its model parameters from llama_model_default_params() and has no argument for
    # use_extra_bufts: the default is replaced while it loads.
    bindings = llama_cpp.llama_cpp
    defaults = bindings.llama_model_default_params

    def model_params():
        params = defaults()
        params.use_extra_bufts = extra_bufts
        return params

    bindings.llama_model_default_params = model_params
    try:
        return llama_cpp.Llama(model_path=os.fspath(path), n_ctx=n_ctx, n_batch=min(n_batch, n_ctx),
                               n_threads=n_threads, n_threads_batch=n_threads, n_gpu_layers=0,
                               logits_all=logits_all, verbose=False, **kv)
    finally:
        bindings.llama_model_default_params = defaults


def llama_prompt_logits(llm: "llama_cpp.Llama", prompt: Sequence[int]) -> np.ndarray:
    """float32 [T, V]: llama.cpp's logits at every prompt position, from an empty context."""
    llm.reset()
    llm.eval(list(prompt))
    return np.array(llm.scores[:len(prompt)], dtype=np.float32, copy=True)


@dataclass
class GreedyRun:
    tokens: list[int]          # the n_steps tokens llama.cpp's greedy sampler chose
    logits: np.ndarray         # float32 [n_steps, V]: the logits each token was sampled from


def llama_greedy(llm: "llama_cpp.Llama", prompt: Sequence[int], n_steps: int) -> GreedyRun:
    """Greedy decode with llama.cpp's greedy sampler: prefill `prompt`, sample, feed the token back,
    `n_steps` tokens in all (the last one is sampled but not fed back). Needs `logits_all=True`."""
    sampler = llama_cpp.llama_sampler_init_greedy()
    try:
        llm.reset()
        llm.eval(list(prompt))
        tokens, logits = [], []
        for step in range(n_steps):
            logits.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32, copy=True))
            tokens.append(int(llama_cpp.llama_sampler_sample(sampler, llm.ctx, -1)))
            if step + 1 < n_steps:
                llm.eval([tokens[-1]])
    finally:
        llama_cpp.llama_sampler_free(sampler)
    return GreedyRun(tokens=tokens, logits=np.stack(logits))


def top1_margin(logits: np.ndarray) -> np.ndarray:
    """Per row: the largest logit minus the second largest (how close a greedy choice was to a tie)."""
    part = np.partition(np.atleast_2d(logits), -2, axis=-1)
    return part[:, -1] - part[:, -2]


# ------------------------------------------------------------------------------------------------
# llama.cpp's activation rounding, for telling its arithmetic apart from a model bug
# ------------------------------------------------------------------------------------------------
# ggml's CPU matmul converts the activations to the weight type's `vec_dot_type` before the dot
# products: F16 weights -> F16 activations, BF16 -> BF16, Q8_0/Q4_0/Q5_0 -> Q8_0 (blocks of 32,
# fp16 scale amax/127), Q4_1/Q5_1 -> Q8_1 (the same values), K-quants -> Q8_K (blocks of 256,
# float32 scale). Our matmul keeps float32 activations. Rounding our activations the same way
# before each matmul should leave only float summation-order differences against llama.cpp; a
# real model bug would not shrink.

def _round_q8(x: np.ndarray, block: int, fp16_scale: bool) -> np.ndarray:
    rows = x.reshape(-1, block).astype(np.float32)
    amax = np.abs(rows).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.clip(np.rint(rows * inv), -127, 127)            # ggml rounds to nearest (even) in SIMD
    d = (amax / np.float32(127.0)).astype(np.float32)
    if fp16_scale:
        d = d.astype(np.float16).astype(np.float32)
    return (q * d).astype(np.float32).reshape(x.shape)


_Q8_0_DOT = {"Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1", "IQ4_NL"}
_Q8_K_DOT = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}


def round_activations_like_ggml(x: np.ndarray, weight_type: str) -> np.ndarray:
    """`x` [T, n_in] as ggml's CPU matmul sees it for a weight of GGML type `weight_type`."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if weight_type == "F32":
        return x
    if weight_type == "F16":
        return x.astype(np.float16).astype(np.float32)
    if weight_type == "BF16":
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return rounded.astype(np.uint32).view(np.float32)
    if weight_type in _Q8_0_DOT:
        return _round_q8(x, 32, fp16_scale=True)
    if weight_type in _Q8_K_DOT:
        return _round_q8(x, 256, fp16_scale=False)
    raise ValueError(f"no ggml activation rounding known for weight type {weight_type}")


def ggml_rounding_backend(base_backend=None):
    """A CPU backend whose matmul first rounds the activations like ggml's CPU matmul (see above).
    For diagnosis in tests only: our production path keeps float32 activations."""
    from daemons.gguf_reader import type_name
    from kernels.cpu_backend import CPUBackend

    class GGMLRoundingCPUBackend(CPUBackend):
        name = "cpu-ggml-rounding"

        def matmul(self, x, weight):
            return super().matmul(round_activations_like_ggml(x, type_name(int(weight.qtype))), weight)

    return GGMLRoundingCPUBackend()
