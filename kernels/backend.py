"""The backend interface: the hot operations a model is written against.

A model module (e.g. `daemons/qwen35.py`) is written once against `Backend`; `kernels.cpu_backend`
implements it with numpy + numba, `kernels.cuda_backend` with CuPy raw kernels (sources that also
compile for HIP). Arrays are the backend's own (`numpy.ndarray` on CPU, `cupy.ndarray` on GPU);
`backend.xp` is the matching array module for cheap glue (reshape, slicing, concatenation).

Conventions every implementation follows:
- Activations are float32, row-major, tokens first: `x[T, d]`.
- Weights stay in their GGUF quantisation: `load_weight` takes a `GGUFTensor` and returns an opaque
  handle; `matmul(x, w)` computes `x @ W.T` (W in numpy shape (n_out, n_in), i.e. ggml ne=[n_in, n_out]).
- Small vectors (norm weights, biases, per-head scalars) are loaded with `load_vector` as float32.
- Heads are the second-to-last axis: `q[T, H, D]`.
- The Gated DeltaNet state of one layer is `state[H_v, d_v, d_k]` float32: per head the transpose of
  HF's S[h] (which maps keys to values), as ggml stores it; a value column's d_k entries are
  contiguous, which the GPU recurrence reads and writes as whole lines (kernels/deltanet.py).
  V-head h reads k-head `h % H_k` (GGUF tiled order).
- The attention KV cache of one layer is `k_cache[H_kv, ctx, D]`, `v_cache[H_kv, ctx, D]` float32.
- Reductions for norms accumulate in float32 at least; results must match the CPU backend to
  1e-3 relative (the GPU tests hold them to that).
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence


class BackendError(RuntimeError):
    """A backend cannot be created (no device, missing CuPy) or cannot run an operation."""


class Backend(Protocol):
    name: str            # "cpu", "cuda", "hip"
    device: str          # "cpu", "cuda:0", ...
    xp: Any              # numpy or cupy

    # -- data movement ------------------------------------------------------------------------
    def asarray(self, host_array: Any, dtype: Any = None) -> Any:
        """Copy a host (numpy) array onto the backend's device."""

    def to_host(self, array: Any) -> Any:
        """The array as a numpy array (a copy for device arrays, the array itself on CPU)."""

    def load_weight(self, tensor: Any) -> Any:
        """A matrix (GGUFTensor with ne=[n_in, n_out]) kept in its stored quantisation."""

    def load_vector(self, tensor: Any) -> Any:
        """A small tensor dequantised to float32, in numpy shape."""

    def weight_nbytes(self, weight: Any) -> int:
        """Bytes the weight occupies (its quantised size)."""

    # -- linear algebra -------------------------------------------------------------------------
    def matmul(self, x: Any, weight: Any) -> Any:
        """y[T, n_out] = x[T, n_in] @ W.T, W dequantised block by block (never whole)."""

    def embed(self, weight: Any, token_ids: Sequence[int]) -> Any:
        """Rows `token_ids` of the embedding matrix (ne=[d, vocab]) as float32 [T, d]."""

    # -- elementwise and normalisation --------------------------------------------------------
    def rms_norm(self, x: Any, weight: Any | None, eps: float) -> Any:
        """x / sqrt(mean(x^2, last axis) + eps) * weight (weight broadcast over the last axis)."""

    def l2_norm(self, x: Any, eps: float) -> Any:
        """x / sqrt(sum(x^2, last axis) + eps): HF/FLA's l2norm and current llama.cpp's
        (`build_gdn_l2_norm`, ggml-org/llama.cpp#28068). The older ggml form x / max(||x||, eps)
        quoted in qwen35 math §3.4 differs only for near-zero vectors."""

    def rope_neox(self, x: Any, positions: Any, n_rot: int, theta: float) -> Any:
        """Partial NeoX RoPE on x[T, H, D]: pairs (i, i + n_rot/2) for i < n_rot/2 rotated by
        positions[t] * theta^(-2i/n_rot); dims >= n_rot unchanged. Angles are computed in float64
        and reduced before cos/sin in float32 (the project's choice, math §2 FLAG 3)."""

    def silu_mul(self, gate: Any, up: Any) -> Any:
        """silu(gate) * up (SwiGLU)."""

    def sigmoid_mul(self, x: Any, gate: Any) -> Any:
        """x * sigmoid(gate) (attention output gate)."""

    def gated_rms_norm(self, x: Any, weight: Any, z: Any, eps: float) -> Any:
        """RMSNorm(x; weight) * silu(z) over the last axis (DeltaNet output norm)."""

    # -- recurrent mixers -----------------------------------------------------------------------
    def causal_conv1d_silu(self, x: Any, conv_state: Any, weight: Any) -> tuple[Any, Any]:
        """Depthwise causal conv over time then silu. x[T, C]; conv_state[K-1, C] holds the last K-1
        inputs (row 0 oldest); weight[C, K] with tap K-1 applied to the newest input. Returns
        (y[T, C], new_state[K-1, C])."""

    def deltanet_recurrent(self, q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any,
                           checkpoints: Any | None = None) -> Any:
        """Gated delta rule, token by token (math §3.6), updating `state[H_v, d_v, d_k]` (Sᵀ) in place.
        q, k: [T, H_k, d_k] already L2-normalised (q NOT yet scaled: the kernel scales by 1/sqrt(d_k));
        v: [T, H_v, d_v]; g (log-decay, <= 0) and beta: [T, H_v]. Returns o[T, H_v, d_v].
        If `checkpoints` [T, H_v, d_v, d_k] is given, the state after each token is stored there
        (f32, for exact speculative rollback)."""

    def deltanet_chunked(self, q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any,
                         chunk_size: int = 64) -> Any:
        """Same result as `deltanet_recurrent` (to rounding) by the chunked/parallel form (prefill)."""

    # -- attention ------------------------------------------------------------------------------
    def attention(self, q: Any, k_cache: Any, v_cache: Any, q_positions: Any, kv_len: int,
                  scale: float, mask: Any | None = None) -> Any:
        """Softmax attention of q[T, H_q, D] over cache rows [0, kv_len) of k_cache/v_cache
        [H_kv, ctx, D]; q-head h uses kv-head h // (H_q / H_kv). Row t sees cache row j iff
        j <= q_positions[t] (and mask[t, j] if a boolean mask [T, kv_len] is given). Returns [T, H_q, D]."""

    # -- sampling support -----------------------------------------------------------------------
    def argmax(self, logits: Any) -> Any:
        """Index of the maximum of each row of logits[T, V], lowest index on ties (host int array)."""
