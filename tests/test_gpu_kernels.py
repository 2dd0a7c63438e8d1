"""The CUDA/HIP backend (kernels/cuda_backend.py, kernels/*.cu) against the CPU backend.

GPU tests are marked `gpu` and skipped at collection when CuPy or a device is absent (the
dev/CI machines); importing this module needs neither. What they guard:
- a wrong reading of ggml's block layouts (Q8_0's 2-byte-aligned 34-byte blocks, Q4_K's packed
  6-bit scales/mins and nibble order): dequantisation must equal the CPU's bit for bit;
- indexing bugs at edges: row counts that are not a multiple of the rows per block, widths that
  are not a multiple of one iteration's columns, T in {1, 2, 3, 8} and T past one launch;
- a matvec that is not batch-invariant (speculative verify needs a row's result to be the same
  alone or inside a batch);
- the delta rule's order (decay, read, write, output), the k-head of a v-head (h % H_k), the
  1/sqrt(d_k) scale, widths that do not fill a block, and per-token checkpoints;
- in-place state update, and the backend's typed errors;
- the other block types (Q4_0/Q4_1/Q5_0/Q5_1/Q5_K/Q6_K/IQ4_XS: a misread high bit, 6-bit scale,
  int8 sub-scale or IQ4_NL table entry), through the generic matvec and dequantiser;
- RoPE's pair layout and partial rotation, the conv's tap order and state hand-over, attention's
  GQA head mapping, causal limit, explicit mask, fully masked rows, spans of keys (kv_len > 256)
  and batch invariance (a row computed alone equals the same row inside a verify batch), the
  chunked DeltaNet entry, norms on the strided views the model passes, argmax's NaN/tie rules.
Tolerances: relative error (norm-wise) <= 1e-3 against the CPU backend as the issue asks, plus a
max-abs bound, plus a tighter bound against a float64 reference to show the actual precision.
"""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from daemons.gguf_reader import GGUFTensor
from kernels import ggml_quants
from kernels.backend import BackendError
from kernels.cpu_backend import CPUBackend
from kernels.cuda_backend import MATVEC_CONFIGS, MATVEC_MAX_T, WIDE_MIN_T, CudaBackend
from kernels.matmul import QuantizedWeight, matmul as cpu_matmul
from tests.gpu_helpers import GPU_MARKS


gpu_test = GPU_MARKS


def apply_marks(fn):
    for mark in gpu_test:
        fn = mark(fn)
    return fn


@pytest.fixture(scope="module")
def gpu():
    return CudaBackend()


def rel_err(a, ref) -> float:
    a = np.asarray(a, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_close(a, ref, rel=1e-3, what=""):
    """Norm-wise relative error <= rel and max |a - ref| <= rel * max |ref|; no NaN anywhere."""
    a = np.asarray(a)
    assert a.shape == ref.shape, f"{what}: shape {a.shape} != {ref.shape}"
    assert np.isfinite(a).all(), f"{what}: non-finite values (unwritten output?)"
    err = rel_err(a, ref)
    assert err <= rel, f"{what}: relative error {err:.3g} > {rel}"
    max_abs = float(np.max(np.abs(a.astype(np.float64) - ref))) if a.size else 0.0
    bound = rel * float(np.max(np.abs(ref))) if ref.size else 0.0
    assert max_abs <= bound, f"{what}: max abs error {max_abs:.3g} > {bound:.3g}"


def make_tensor(qtype, n_out, n_in, rng, name="w"):
    raw = ggml_quants.random_raw(qtype, n_out, n_in, rng)
    return GGUFTensor(name, int(qtype), (n_in, n_out), 0, raw.nbytes, raw)


# (qtype, n_out, n_in): rows not a multiple of the rows per block (2 or 4); widths not a multiple
# of one iteration (Q8_0: 16 blocks = 512 columns; Q4_K: 4 super-blocks = 1024; F16: 512).
MATMUL_CASES = [
    (QT.Q8_0, 1, 32), (QT.Q8_0, 7, 96), (QT.Q8_0, 131, 544), (QT.Q8_0, 257, 4128), (QT.Q8_0, 64, 1056),
    (QT.Q4_K, 1, 256), (QT.Q4_K, 5, 768), (QT.Q4_K, 67, 1280), (QT.Q4_K, 130, 4352), (QT.Q4_K, 301, 2304),
    (QT.F16, 33, 516), (QT.F16, 5, 514), (QT.BF16, 9, 520), (QT.F32, 17, 100), (QT.F32, 5, 102),
    # Generic block kernel: 8 rows per block (4 groups x R=2), 32 units (of 32 weights) per lane pass.
    (QT.Q4_0, 11, 96), (QT.Q4_1, 3, 64), (QT.Q5_0, 7, 1056), (QT.Q5_1, 9, 160),
    (QT.Q5_K, 1, 256), (QT.Q5_K, 13, 1280), (QT.Q5_K, 41, 4352),
    (QT.Q6_K, 1, 256), (QT.Q6_K, 19, 2304), (QT.Q6_K, 70, 5376),
    (QT.IQ4_XS, 5, 256), (QT.IQ4_XS, 21, 1792),
]
GENERIC_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q6_K, QT.IQ4_XS)


def _case_id(case):
    qtype, n_out, n_in = case
    return f"{qtype.name}-{n_out}x{n_in}"


# ---------------------------------------------------------------------------------------------
# Runs everywhere (no GPU needed).

def test_backend_without_cupy_raises_backend_error(monkeypatch):
    # Guards: a missing CuPy must be a one-line BackendError, not an ImportError traceback.
    monkeypatch.setitem(sys.modules, "cupy", None)   # makes `import cupy` raise ImportError
    with pytest.raises(BackendError, match="CuPy"):
        CudaBackend()
    with pytest.raises(BackendError, match="CuPy"):
        CudaBackend("cuda:0")
    with pytest.raises(BackendError, match="unknown GPU device"):
        CudaBackend("tpu:0")


# ---------------------------------------------------------------------------------------------
# Dequantisation and matmul.

@apply_marks
@pytest.mark.parametrize("case", MATMUL_CASES, ids=_case_id)
def test_dequantize_equals_cpu_bit_for_bit(gpu, case):
    qtype, n_out, n_in = case
    rng = np.random.default_rng(100 + n_out)
    t = make_tensor(qtype, n_out, n_in, rng)
    w = gpu.load_weight(t)
    assert gpu.weight_nbytes(w) == t.raw.nbytes
    got = gpu.to_host(gpu.dequantize(w))
    ref = ggml_quants.dequantize(t.raw, qtype, n_in)
    assert np.array_equal(got, ref), f"max diff {np.max(np.abs(got - ref))}"


@apply_marks
@pytest.mark.parametrize("n_t", [1, 2, 3, 8, 13, 80])
@pytest.mark.parametrize("case", MATMUL_CASES, ids=_case_id)
def test_matmul_matches_cpu(gpu, case, n_t):
    qtype, n_out, n_in = case
    rng = np.random.default_rng(1000 * n_t + n_out)
    t = make_tensor(qtype, n_out, n_in, rng)
    x = rng.standard_normal((n_t, n_in)).astype(np.float32)
    w = gpu.load_weight(t)
    X = gpu.asarray(x)
    got = gpu.to_host(gpu.matmul(X, w))
    ref_cpu = cpu_matmul(x, QuantizedWeight(t.raw, qtype, n_out, n_in))
    assert_close(got, ref_cpu, 1e-3, f"{qtype.name} {n_out}x{n_in} T={n_t} vs CPU")
    ref64 = x.astype(np.float64) @ ggml_quants.dequantize(t.raw, qtype, n_in).astype(np.float64).T
    assert rel_err(got, ref64) <= 1e-5, f"vs float64: {rel_err(got, ref64):.3g}"
    if n_t <= MATVEC_MAX_T and n_in % 4 == 0:
        # The kernel itself into a NaN-poisoned buffer: every output element must be written.
        y = gpu.xp.full((n_t, n_out), np.nan, dtype=np.float32)
        gpu._matvec(X, w, y)
        assert np.array_equal(gpu.to_host(y), got)


TC_CASES = [(QT.Q4_K, 70, 512), (QT.Q5_K, 33, 768), (QT.Q6_K, 48, 256), (QT.IQ4_XS, 17, 512), (QT.Q8_0, 40, 160),
            (QT.F16, 24, 264)]


@apply_marks
@pytest.mark.parametrize("n_t", [9, WIDE_MIN_T - 1, WIDE_MIN_T, 200])   # both sides of the switch
@pytest.mark.parametrize("case", TC_CASES, ids=_case_id)
def test_tensor_core_weight_matmul_matches_cpu(gpu, case, n_t, monkeypatch):
    """Tensor-core weights (load_matmul_weight): below WIDE_MIN_T rows the step's kernel, from it
    on f16-dequantised slices times cuBLAS (here two tiles per slice, so the slices' offsets into
    y are exercised). Both round x and the weights to f16 once: within 2e-3 of float64."""
    from kernels import cuda_backend
    from kernels.fused_gpu import TcWeight
    qtype, n_out, n_in = case
    monkeypatch.setattr(cuda_backend, "WIDE_SCRATCH_BYTES", 2 * 16 * 2 * 256 * -(-n_in // 256))
    rng = np.random.default_rng(7 * n_t + n_out)
    t = make_tensor(qtype, n_out, n_in, rng)
    w = gpu.load_matmul_weight(t)
    assert isinstance(w, TcWeight)
    x = rng.standard_normal((n_t, n_in)).astype(np.float32)
    got = gpu.to_host(gpu.matmul(gpu.asarray(x), w))
    ref64 = x.astype(np.float64) @ ggml_quants.dequantize(t.raw, qtype, n_in).astype(np.float64).T
    assert got.shape == (n_t, n_out) and np.isfinite(got).all()
    assert rel_err(got, ref64) <= 2e-3, f"{qtype.name} T={n_t}: {rel_err(got, ref64):.3g}"
    if n_t >= cuda_backend.WIDE_MIN_T:
        # a BLAS without gemmEx (the fallback an f32 GEMM of the same f16 weights and rows): same result
        def no_gemm_ex(*a, **k):
            raise RuntimeError("no gemmEx here")
        monkeypatch.setattr(cuda_backend, "_cublas_gemm_ex", no_gemm_ex)
        fresh = CudaBackend()
        w2 = fresh.load_matmul_weight(t)
        got2 = fresh.to_host(fresh.matmul(fresh.asarray(x), w2))
        assert not fresh._gemm_ex and "no gemmEx" in fresh.gemm_ex_error
        assert rel_err(got2, got) <= 1e-5


@apply_marks
@pytest.mark.parametrize("case", MATMUL_CASES, ids=_case_id)
def test_matvec_is_batch_invariant(gpu, case):
    # A row's result must not depend on the other rows in the launch (T = 1 vs inside T = 8 or a
    # looped T = 13), or a speculative verify would disagree with plain decode.
    qtype, n_out, n_in = case
    if qtype in (QT.F16, QT.F32) and n_in % 4:
        pytest.skip("float widths that are not a multiple of 4 go through dequantise + GEMM")
    rng = np.random.default_rng(7 + n_out)
    w = gpu.load_weight(make_tensor(qtype, n_out, n_in, rng))
    x = gpu.asarray(rng.standard_normal((13, n_in)).astype(np.float32))
    batched = gpu.to_host(gpu.matmul(x, w))
    for n_t in (1, 3, 8):
        part = gpu.to_host(gpu.matmul(x[:n_t], w))
        assert np.array_equal(part, batched[:n_t]), f"T={n_t} differs from the same rows inside T=13"


@apply_marks
@pytest.mark.parametrize("config", MATVEC_CONFIGS, ids=lambda c: f"R{c[0]}-U{c[1]}")
@pytest.mark.parametrize("case", [(QT.Q8_0, 131, 4128), (QT.Q4_K, 67, 4352), (QT.F16, 13, 1028)], ids=_case_id)
def test_matvec_every_config(gpu, case, config):
    # `matvec_config` is a tuning table: every (rows per block, passes per iteration) it may pick
    # must be correct, including a last iteration that is only partly inside the row.
    qtype, n_out, n_in = case
    rng = np.random.default_rng(config[0] * 10 + config[1] + n_out)
    t = make_tensor(qtype, n_out, n_in, rng)
    w = gpu.load_weight(t)
    for n_t in (1, 3, 8):
        x = rng.standard_normal((n_t, n_in)).astype(np.float32)
        y = gpu.xp.full((n_t, n_out), np.nan, dtype=np.float32)
        gpu._matvec(gpu.asarray(x), w, y, config=config)
        ref = cpu_matmul(x, QuantizedWeight(t.raw, qtype, n_out, n_in))
        assert_close(gpu.to_host(y), ref, 1e-3, f"{qtype.name} T={n_t} R,U={config}")


@apply_marks
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("qtype", GENERIC_TYPES, ids=lambda q: q.name)
def test_generic_matvec_every_rows_per_group(gpu, qtype, rows):
    # The generic kernel's rows per 32-thread group is a tuning choice: each must be correct,
    # including a last block whose groups run past n_out (37 rows = 4 full blocks of 8 + 5).
    rng = np.random.default_rng(rows * 31 + int(qtype))
    n_out, n_in = 37, 1536
    t = make_tensor(qtype, n_out, n_in, rng)
    w = gpu.load_weight(t)
    for n_t in (1, 5, 8):
        x = rng.standard_normal((n_t, n_in)).astype(np.float32)
        y = gpu.xp.full((n_t, n_out), np.nan, dtype=np.float32)
        gpu._matvec(gpu.asarray(x), w, y, config=(rows, 1))
        ref = cpu_matmul(x, QuantizedWeight(t.raw, qtype, n_out, n_in))
        assert_close(gpu.to_host(y), ref, 1e-3, f"{qtype.name} T={n_t} R={rows}")


@apply_marks
def test_matmul_accepts_a_vector_and_rejects_wrong_width(gpu):
    rng = np.random.default_rng(3)
    t = make_tensor(QT.Q8_0, 9, 64, rng)
    w = gpu.load_weight(t)
    x = rng.standard_normal(64).astype(np.float32)
    y = gpu.to_host(gpu.matmul(gpu.asarray(x), w))
    assert y.shape == (9,)
    assert_close(y, cpu_matmul(x[None], QuantizedWeight(t.raw, QT.Q8_0, 9, 64))[0], 1e-3, "vector")
    with pytest.raises(BackendError, match="does not match"):
        gpu.matmul(gpu.asarray(np.zeros((2, 96), np.float32)), w)


@apply_marks
def test_load_weight_rejects_unsupported_types(gpu):
    rng = np.random.default_rng(4)
    q2_k = rng.integers(0, 256, size=(2, 84), dtype=np.uint8)          # Q2_K: 84 bytes per 256 weights
    with pytest.raises(BackendError, match="not implemented on the CUDA backend"):
        gpu.load_weight(GGUFTensor("w", int(QT.Q2_K), (256, 2), 0, q2_k.nbytes, q2_k))
    t = make_tensor(QT.Q8_0, 2, 64, rng)
    with pytest.raises(BackendError, match="must be a matrix"):
        gpu.load_weight(GGUFTensor("v", int(QT.Q8_0), (64, 2, 1), 0, t.raw.nbytes, t.raw))


@apply_marks
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K, QT.F16, QT.F32, QT.Q6_K, QT.IQ4_XS, QT.Q5_0, QT.Q5_K])
def test_embed_matches_cpu(gpu, qtype):
    rng = np.random.default_rng(5)
    t = make_tensor(qtype, 50, 512, rng)
    ids = [49, 0, 7, 7, 23]
    got = gpu.to_host(gpu.embed(gpu.load_weight(t), ids))
    ref = CPUBackend().embed(CPUBackend().load_weight(t), ids)
    assert np.array_equal(got, ref)
    with pytest.raises(BackendError, match="outside"):
        gpu.embed(gpu.load_weight(t), [50])


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet recurrent step.

def deltanet_f64(q, k, v, g, beta, S0):
    """Math §3.6 in float64: S <- e^g S; d = b (v - S^T k); S <- S + k d^T; o = S^T q / sqrt(d_k),
    v-head h using k-head h % H_k. S0 and the states are stored as the backends store them (S^T per
    head, [H_v, d_v, d_k]). Returns (o, state after each token)."""
    T, H_k, d_k = q.shape
    H_v = v.shape[1]
    S = S0.transpose(0, 2, 1).astype(np.float64)
    o = np.zeros(v.shape)
    states = np.zeros((T,) + S0.shape)
    for t in range(T):
        for h in range(H_v):
            kk = k[t, h % H_k].astype(np.float64)
            qq = q[t, h % H_k].astype(np.float64)
            S[h] *= math.exp(g[t, h])
            delta = beta[t, h] * (v[t, h] - S[h].T @ kk)
            S[h] += np.outer(kk, delta)
            o[t, h] = S[h].T @ qq / math.sqrt(d_k)
        states[t] = S.transpose(0, 2, 1)
    return o, states


def deltanet_inputs(rng, T, H_k, H_v, d_k, d_v):
    def unit(shape):
        a = rng.standard_normal(shape)
        return (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(np.float32)
    q = unit((T, H_k, d_k))
    k = unit((T, H_k, d_k))
    v = rng.standard_normal((T, H_v, d_v)).astype(np.float32)
    g = -rng.uniform(0.0, 2.0, (T, H_v)).astype(np.float32)
    beta = rng.uniform(0.05, 1.0, (T, H_v)).astype(np.float32)
    S0 = (0.5 * rng.standard_normal((H_v, d_v, d_k))).astype(np.float32)     # S^T per head
    return q, k, v, g, beta, S0


# (T, H_k, H_v, d_k, d_v): the 27B layer's shape; a d_v that does not fill a 32-column block; d_k
# that does not fill 4 x rows-per-thread; the largest d_k (256); several v-heads per k-head.
DELTANET_CASES = [(1, 16, 48, 128, 128), (4, 16, 48, 128, 128), (3, 2, 4, 128, 128), (8, 1, 3, 64, 96),
                  (5, 2, 2, 40, 33), (2, 1, 2, 256, 8), (16, 4, 8, 128, 64)]


@apply_marks
@pytest.mark.parametrize("case", DELTANET_CASES, ids=lambda c: "T{}-Hk{}-Hv{}-dk{}-dv{}".format(*c))
def test_deltanet_recurrent_matches_cpu(gpu, case):
    T, H_k, H_v, d_k, d_v = case
    rng = np.random.default_rng(sum(case))
    q, k, v, g, beta, S0 = deltanet_inputs(rng, T, H_k, H_v, d_k, d_v)

    cpu_state = S0.copy()
    cpu_ckpt = np.empty((T, H_v, d_v, d_k), np.float32)
    cpu_o = CPUBackend().deltanet_recurrent(q, k, v, g, beta, cpu_state, cpu_ckpt)

    xp = gpu.xp
    state = gpu.asarray(S0)
    state_ptr = state.data.ptr
    ckpt = xp.full((T, H_v, d_v, d_k), np.nan, dtype=np.float32)
    o = gpu.deltanet_recurrent(*(gpu.asarray(a) for a in (q, k, v, g, beta)), state, ckpt)
    assert state.data.ptr == state_ptr
    got_o, got_state, got_ckpt = gpu.to_host(o), gpu.to_host(state), gpu.to_host(ckpt)

    assert_close(got_o, cpu_o, 1e-3, "output vs CPU")
    assert_close(got_state, cpu_state, 1e-3, "state vs CPU")
    assert_close(got_ckpt, cpu_ckpt, 1e-3, "checkpoints vs CPU")
    ref_o, ref_states = deltanet_f64(q, k, v, g, beta, S0)
    assert rel_err(got_o, ref_o) <= 1e-5 and rel_err(got_ckpt, ref_states) <= 1e-5

    # Without checkpoints: the same output and final state, and nothing else is touched.
    state2 = gpu.asarray(S0)
    o2 = gpu.deltanet_recurrent(*(gpu.asarray(a) for a in (q, k, v, g, beta)), state2)
    assert np.array_equal(gpu.to_host(o2), got_o)
    assert np.array_equal(gpu.to_host(state2), got_state)


@apply_marks
def test_deltanet_recurrent_in_two_calls_equals_one(gpu):
    # The state carried between calls (decode step after decode step) is the whole state.
    rng = np.random.default_rng(11)
    q, k, v, g, beta, S0 = deltanet_inputs(rng, 6, 2, 4, 128, 128)
    args = [gpu.asarray(a) for a in (q, k, v, g, beta)]
    s_once = gpu.asarray(S0)
    o_once = gpu.to_host(gpu.deltanet_recurrent(*args, s_once))
    s_two = gpu.asarray(S0)
    o_a = gpu.deltanet_recurrent(*(a[:2] for a in args), s_two)
    o_b = gpu.deltanet_recurrent(*(a[2:] for a in args), s_two)
    assert np.array_equal(np.concatenate([gpu.to_host(o_a), gpu.to_host(o_b)]), o_once)
    assert np.array_equal(gpu.to_host(s_two), gpu.to_host(s_once))


@apply_marks
def test_deltanet_rejects_bad_state(gpu):
    rng = np.random.default_rng(12)
    q, k, v, g, beta, S0 = deltanet_inputs(rng, 2, 1, 2, 16, 8)
    args = [gpu.asarray(a) for a in (q, k, v, g, beta)]
    with pytest.raises(BackendError, match="state"):
        gpu.deltanet_recurrent(*args, S0)                       # a host array cannot be updated in place
    with pytest.raises(BackendError, match="state"):
        gpu.deltanet_recurrent(*args, gpu.asarray(S0[:, :, :8].copy()))   # wrong d_k (S^T: the last axis)
    with pytest.raises(BackendError, match="checkpoints"):
        gpu.deltanet_recurrent(*args, gpu.asarray(S0), gpu.xp.zeros((1, 2, 8, 16), np.float32))


# ---------------------------------------------------------------------------------------------
# The simple elementwise operations.

@apply_marks
def test_elementwise_ops_match_cpu(gpu):
    rng = np.random.default_rng(13)
    cpu = CPUBackend()
    x = rng.standard_normal((3, 5, 128)).astype(np.float32)
    z = rng.standard_normal((3, 5, 128)).astype(np.float32)
    w = rng.standard_normal(128).astype(np.float32)
    X, Z, W = gpu.asarray(x), gpu.asarray(z), gpu.asarray(w)
    assert_close(gpu.to_host(gpu.rms_norm(X, W, 1e-6)), cpu.rms_norm(x, w, 1e-6), 1e-5, "rms_norm")
    assert_close(gpu.to_host(gpu.rms_norm(X, None, 1e-6)), cpu.rms_norm(x, None, 1e-6), 1e-5, "rms_norm no w")
    assert_close(gpu.to_host(gpu.l2_norm(X, 1e-6)), cpu.l2_norm(x, 1e-6), 1e-5, "l2_norm")
    assert_close(gpu.to_host(gpu.silu_mul(X, Z)), cpu.silu_mul(x, z), 1e-5, "silu_mul")
    assert_close(gpu.to_host(gpu.sigmoid_mul(X, Z)), cpu.sigmoid_mul(x, z), 1e-5, "sigmoid_mul")
    assert_close(gpu.to_host(gpu.gated_rms_norm(X, W, Z, 1e-6)), cpu.gated_rms_norm(x, w, z, 1e-6), 1e-5,
                 "gated_rms_norm")
    logits = rng.standard_normal((4, 1000)).astype(np.float32)
    logits[2, [10, 500]] = 9.0                                   # a tie: the lowest index wins
    assert np.array_equal(gpu.argmax(gpu.asarray(logits)), cpu.argmax(logits))
    assert gpu.argmax(gpu.asarray(logits))[2] == 10




@apply_marks
def test_argmax_follows_numpy_for_nan_and_ties(gpu):
    # np.argmax: the first NaN wins over any number; otherwise the lowest index of the maximum.
    rows = np.array([[1.0, np.nan, 3.0, np.nan], [-np.inf, -np.inf, -np.inf, -np.inf],
                     [2.0, 5.0, 5.0, 1.0], [0.0, -1.0, 7.0, 7.0]], dtype=np.float32)
    got = gpu.argmax(gpu.asarray(rows))
    assert got.tolist() == np.argmax(rows, axis=-1).tolist() == [1, 0, 1, 2]
    wide = np.full((2, 70001), -3.0, np.float32)
    wide[0, [69999, 5]] = 2.5
    wide[1, 70000] = 1.0
    assert gpu.argmax(gpu.asarray(wide)).tolist() == [5, 70000]
    assert gpu.argmax(gpu.asarray(wide[0])).tolist() == [5]


@apply_marks
def test_norms_on_strided_views_match_cpu(gpu):
    # The model normalises q = qg[:, :, :D] (every other D-run of a packed projection) and the q/k
    # heads sliced out of the conv output (rows of d_k, row stride C); both are views, not copies.
    rng = np.random.default_rng(21)
    cpu = CPUBackend()
    T, H, D = 5, 3, 48
    qg = rng.standard_normal((T, H, 2 * D)).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float32)
    QG = gpu.asarray(qg)
    assert_close(gpu.to_host(gpu.rms_norm(QG[:, :, :D], gpu.asarray(w), 1e-6)),
                 cpu.rms_norm(qg[:, :, :D], w, 1e-6), 1e-5, "rms_norm of a strided view")
    conv = rng.standard_normal((T, 200)).astype(np.float32)
    CONV = gpu.asarray(conv)
    view = CONV[:, 64:128].reshape(T, 2, 32)
    assert_close(gpu.to_host(gpu.l2_norm(view, 1e-6)), cpu.l2_norm(conv[:, 64:128].reshape(T, 2, 32), 1e-6),
                 1e-5, "l2_norm of a strided view")
    x4 = rng.standard_normal((2, 3, 4, 40)).astype(np.float32)
    assert_close(gpu.to_host(gpu.rms_norm(gpu.asarray(x4), None, 1e-5)), cpu.rms_norm(x4, None, 1e-5), 1e-5, "4-d")
    big = rng.standard_normal((2, 5120)).astype(np.float32)
    wb = rng.standard_normal(5120).astype(np.float32)
    assert_close(gpu.to_host(gpu.rms_norm(gpu.asarray(big), gpu.asarray(wb), 1e-6)), cpu.rms_norm(big, wb, 1e-6),
                 1e-5, "rms_norm 5120")


@apply_marks
@pytest.mark.parametrize("n_rot, D, theta", [(8, 16, 1e4), (64, 256, 1e7), (16, 16, 5e5)])
def test_rope_matches_cpu(gpu, n_rot, D, theta):
    # Positions up to 1e5 (the float64 angle reduction matters there) and a partial rotation:
    # dims >= n_rot must come back unchanged.
    rng = np.random.default_rng(n_rot + D)
    T, H = 6, 3
    x = rng.standard_normal((T, H, D)).astype(np.float32)
    pos = np.array([0, 1, 7, 1000, 65535, 100003], dtype=np.int64)
    got = gpu.to_host(gpu.rope_neox(gpu.asarray(x), pos, n_rot, theta))
    ref = CPUBackend().rope_neox(x, pos, n_rot, theta)
    assert_close(got, ref, 1e-5, "rope")
    assert np.array_equal(got[..., n_rot:], x[..., n_rot:])
    got_dev_pos = gpu.to_host(gpu.rope_neox(gpu.asarray(x), gpu.asarray(pos), n_rot, theta))
    assert np.array_equal(got_dev_pos, got)
    with pytest.raises(BackendError, match="positions"):
        gpu.rope_neox(gpu.asarray(x), pos[:3], n_rot, theta)


@apply_marks
@pytest.mark.parametrize("T", [1, 2, 3, 9, 40])
def test_causal_conv_matches_cpu(gpu, T):
    # T < K-1 keeps part of the old state in the new one; T >= K-1 replaces it with inputs; 40
    # tokens span three blocks of the kernel's token split.
    rng = np.random.default_rng(T)
    C, K = 130, 4
    x = rng.standard_normal((T, C)).astype(np.float32)
    st = rng.standard_normal((K - 1, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    y, new_st = gpu.causal_conv1d_silu(gpu.asarray(x), gpu.asarray(st), gpu.asarray(w))
    ry, rst = CPUBackend().causal_conv1d_silu(x, st, w)
    assert_close(gpu.to_host(y), ry, 1e-5, "conv y")
    assert np.array_equal(gpu.to_host(new_st), rst)
    # Two calls carrying the state equal one call over both inputs.
    y1, s1 = gpu.causal_conv1d_silu(gpu.asarray(x[:1]), gpu.asarray(st), gpu.asarray(w))
    y2, _ = gpu.causal_conv1d_silu(gpu.asarray(x[1:]), s1, gpu.asarray(w)) if T > 1 else (y1[:0], None)
    assert np.array_equal(np.concatenate([gpu.to_host(y1), gpu.to_host(y2)]), gpu.to_host(y))
    with pytest.raises(BackendError, match="do not match"):
        gpu.causal_conv1d_silu(gpu.asarray(x), gpu.asarray(st[:2]), gpu.asarray(w))


def attention_inputs(rng, T, H_q, H_kv, D, ctx):
    q = rng.standard_normal((T, H_q, D)).astype(np.float32)
    k = rng.standard_normal((H_kv, ctx, D)).astype(np.float32)
    v = rng.standard_normal((H_kv, ctx, D)).astype(np.float32)
    return q, k, v


# (T, H_q, H_kv, D, kv_len, ctx): decode; the 27B head shape (GQA 6); a verify batch on top of a
# context; prefill from 0; kv_len past one 256-key span (combine path); D < 32 lanes.
ATTENTION_CASES = [(1, 4, 2, 64, 37, 64), (1, 24, 4, 256, 300, 512), (7, 4, 1, 128, 40, 64),
                   (12, 2, 2, 16, 12, 16), (5, 6, 3, 32, 600, 700), (3, 2, 1, 8, 9, 10)]


@apply_marks
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "T{}-Hq{}-Hkv{}-D{}-L{}".format(*c[:5]))
def test_attention_matches_cpu(gpu, case):
    T, H_q, H_kv, D, kv_len, ctx = case
    rng = np.random.default_rng(sum(case))
    q, k, v = attention_inputs(rng, T, H_q, H_kv, D, ctx)
    pos = np.arange(kv_len - T, kv_len)
    scale = 1.0 / math.sqrt(D)
    cpu = CPUBackend()
    got = gpu.to_host(gpu.attention(gpu.asarray(q), gpu.asarray(k), gpu.asarray(v), pos, kv_len, scale))
    assert_close(got, cpu.attention(q, k, v, pos, kv_len, scale), 1e-4, "causal")
    # An explicit mask (a verify tree): random visibility, one row fully masked (-> zeros).
    mask = rng.random((T, kv_len)) < 0.6
    mask[0] = False
    got_m = gpu.to_host(gpu.attention(gpu.asarray(q), gpu.asarray(k), gpu.asarray(v), pos, kv_len, scale,
                                      mask=mask))
    ref_m = cpu.attention(q, k, v, pos, kv_len, scale, mask=mask)
    assert_close(got_m, ref_m, 1e-4, "masked")
    assert np.array_equal(got_m[0], np.zeros_like(got_m[0]))


@apply_marks
def test_attention_row_alone_equals_row_in_batch(gpu):
    # Speculative verify computes positions p..p+T-1 in one call with kv_len = p+T; decode computes
    # each alone with kv_len = position+1. The results must be identical, across a span boundary too.
    rng = np.random.default_rng(5)
    H_q, H_kv, D, ctx = 6, 2, 64, 600
    q, k, v = attention_inputs(rng, 9, H_q, H_kv, D, ctx)
    K, V = gpu.asarray(k), gpu.asarray(v)
    p0 = 250
    pos = np.arange(p0, p0 + 9)
    batch = gpu.to_host(gpu.attention(gpu.asarray(q), K, V, pos, p0 + 9, 0.125))
    for i in range(9):
        alone = gpu.to_host(gpu.attention(gpu.asarray(q[i:i + 1]), K, V, pos[i:i + 1], int(pos[i]) + 1, 0.125))
        assert np.array_equal(alone[0], batch[i]), f"row {i} (position {pos[i]})"


@apply_marks
def test_attention_rejects_bad_arguments(gpu):
    q = gpu.xp.zeros((1, 3, 8), dtype=np.float32)
    kc = gpu.xp.zeros((2, 4, 8), dtype=np.float32)
    with pytest.raises(BackendError, match="multiple"):
        gpu.attention(q, kc, kc, [0], 1, 1.0)
    with pytest.raises(BackendError, match="kv_len"):
        gpu.attention(q[:, :2], kc, kc, [0], 5, 1.0)
    with pytest.raises(BackendError, match="mask"):
        gpu.attention(q[:, :2], kc, kc, [0], 2, 1.0, mask=np.ones((1, 3), bool))


@apply_marks
@pytest.mark.parametrize("case", [(5, 2, 4, 32, 16), (70, 2, 6, 128, 128)], ids=lambda c: "T{}-Hk{}-Hv{}-dk{}-dv{}".format(*c))
def test_deltanet_chunked_matches_cpu_chunked(gpu, case):
    T, H_k, H_v, d_k, d_v = case
    rng = np.random.default_rng(T)
    q, k, v, g, beta, S0 = deltanet_inputs(rng, T, H_k, H_v, d_k, d_v)
    cpu_state = S0.copy()
    ref = CPUBackend().deltanet_chunked(q, k, v, g, beta, cpu_state, 64)
    state = gpu.asarray(S0)
    got = gpu.deltanet_chunked(*(gpu.asarray(a) for a in (q, k, v, g, beta)), state, 64)
    assert_close(gpu.to_host(got), ref, 1e-4, "chunked output")
    assert_close(gpu.to_host(state), cpu_state, 1e-4, "chunked state")
