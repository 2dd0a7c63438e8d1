"""The target: a transformers `Qwen3_5ForCausalLM` (Gated DeltaNet + gated attention, full attention
every 4th layer), trained from scratch on the corpus' train split; its held-out perplexity, and the
perplexity of an add-k bigram baseline on the same held-out tokens.

Training: AdamW (β = 0.9/0.95, weight decay on matrices only), linear warm-up then cosine decay to
10 %, gradient clipping at 1, bf16 autocast on CUDA, fixed-length windows cut at random offsets from
the packed token stream. The schedule runs on `progress = max(step / max_steps, elapsed / budget)`, so
a time budget ends the cosine exactly when the time is up and the run stops cleanly there.

Sizes and the byte budget: `gguf_nbytes` computes what `daemons.convert` will write for a model (its
storage rules: 1-D tensors, norms and the conv weight F32; matrices in the outtype, Q8_0 falling back
to F16 for rows not a multiple of 32; a tied head is not written) plus the tokenizer metadata, and
`run.py` asserts target + draft fit the budget before training anything.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

import numpy as np

__all__ = ["TargetSize", "TARGET_SIZES", "make_target_config", "build_target", "gguf_nbytes", "tensor_nbytes",
           "train_target", "TrainLog", "heldout_windows", "model_nll", "bigram_nll",
           "cosine_lr", "autocast"]


@dataclass(frozen=True)
class TargetSize:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    linear_k_heads: int
    linear_v_heads: int
    linear_head_dim: int
    rope_theta: float = 1e6
    partial_rotary: float = 0.5


TARGET_SIZES = {
    # ~16M parameters (tied embeddings): ~17 MB at q8_0. 8 layers, layers 3 and 7 full attention.
    "full": TargetSize(hidden=384, intermediate=1024, layers=8, heads=6, kv_heads=2, head_dim=64,
                       linear_k_heads=2, linear_v_heads=4, linear_head_dim=64),
    # a CPU sanity run of the whole recipe in minutes (README: "Knobs")
    "mini": TargetSize(hidden=128, intermediate=384, layers=4, heads=4, kv_heads=2, head_dim=32,
                       linear_k_heads=2, linear_v_heads=4, linear_head_dim=32),
    # the CPU test's model: same kinds of layers, 4 of them (layer 3 full attention), tiny widths
    "micro": TargetSize(hidden=64, intermediate=128, layers=4, heads=2, kv_heads=1, head_dim=32,
                        linear_k_heads=1, linear_v_heads=2, linear_head_dim=32),
}


def make_target_config(size: TargetSize, vocab_size: int, *, bos_id: int, eos_id: int, pad_id: int,
                       max_positions: int = 4096) -> Any:
    from transformers import Qwen3_5TextConfig

    n_rot = int(size.head_dim * size.partial_rotary)
    half = n_rot // 2                       # M-RoPE sections cover the rotary pairs (text: t = h = w)
    section = [half - 2 * (half // 3), half // 3, half // 3]
    config = Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        head_dim=size.head_dim, linear_num_key_heads=size.linear_k_heads, linear_num_value_heads=size.linear_v_heads,
        linear_key_head_dim=size.linear_head_dim, linear_value_head_dim=size.linear_head_dim,
        linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6, hidden_act="silu",
        attention_bias=False, max_position_embeddings=max_positions, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": size.rope_theta,
                         "partial_rotary_factor": size.partial_rotary, "mrope_section": section,
                         "mrope_interleaved": True},
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    config.architectures = ["Qwen3_5ForCausalLM"]
    return config


def build_target(config: Any, seed: int, device: str) -> Any:
    import torch
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    model = Qwen3_5ForCausalLM(config).float()
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "head not tied"
    return model.to(device)


# ------------------------------------------------------------------------------------------------
# byte budget
# ------------------------------------------------------------------------------------------------

def tensor_nbytes(name: str, shape: tuple[int, ...], outtype: str) -> int:
    """Bytes `daemons.convert` writes for one tensor (its `_storage_type` rule) under its GGUF name
    or any name ending the same way (`norm.weight`, `conv1d.weight`)."""
    n = math.prod(shape)
    if len(shape) <= 1 or name.endswith("norm.weight") or "conv1d" in name or not name.endswith(".weight"):
        return 4 * n
    if outtype == "q8_0":
        return n // 32 * 34 if shape[-1] % 32 == 0 else 2 * n
    return {"f32": 4, "f16": 2, "bf16": 2}[outtype] * n


def gguf_nbytes(named_shapes: Iterable[tuple[str, tuple[int, ...]]], outtype: str, n_vocab_tokens: int = 0,
                n_merges: int = 0) -> int:
    """Estimated GGUF file size: tensor data (each aligned to 32 bytes) + tensor infos + tokenizer
    metadata (token strings, types, merges; ~24 bytes per string, generous for an 8k BPE vocab)."""
    total = 0
    for name, shape in named_shapes:
        total += -(-tensor_nbytes(name, tuple(shape), outtype) // 32) * 32 + 64 + len(name)
    return total + n_vocab_tokens * (24 + 4) + n_merges * 24 + 64 * 1024


def target_named_shapes(model: Any) -> list[tuple[str, tuple[int, ...]]]:
    tied = model.config.tie_word_embeddings
    return [(n, tuple(p.shape)) for n, p in model.state_dict().items() if not (tied and n == "lm_head.weight")]


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------

def heldout_windows(tokens: np.ndarray, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """Non-overlapping windows [n, seq_len] of the held-out stream: the model predicts positions
    1..seq_len-1 of each from the window's own prefix, and so does the bigram (same tokens)."""
    n = len(tokens) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    return np.asarray(tokens[:n * seq_len], dtype=np.int64).reshape(n, seq_len)


# ------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------

def cosine_lr(progress: float, base_lr: float, warmup: float, floor: float = 0.1) -> float:
    """Linear warm-up over the first `warmup` of progress, then cosine from base_lr to floor·base_lr."""
    if progress < warmup:
        return base_lr * max(progress, 1e-3) / warmup
    t = min(1.0, (progress - warmup) / max(1e-9, 1.0 - warmup))
    return base_lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t)))


# Mixed precision on CUDA: "bf16" (autocast) or "fp32" (TF32 matmuls; for when the bf16 run of
# transformers' reference DeltaNet kernels proves unstable). run.py sets it from its settings.
AMP = "bf16"


def autocast(device: str):
    import contextlib

    import torch
    if device.startswith("cuda") and AMP == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return contextlib.nullcontext()


@dataclass
class TrainLog:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    stopped_by: str = ""
    curve: list = None            # [{step, tokens, seconds, lr, train_loss}] every log interval
    eval_curve: list = None       # [{step, seconds, heldout_loss}] at eval points
    best_step: int = 0            # the weights returned are those of the best held-out evaluation
    best_heldout_loss: float = float("inf")

    def to_dict(self) -> dict:
        return asdict(self)


def _param_groups(model: Any, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim == 2 and "embed" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_target(model: Any, train_tokens: np.ndarray, eval_windows: np.ndarray, *, device: str, seq_len: int,
                 batch_size: int, max_steps: int, budget_s: float, lr: float, seed: int, warmup: float = 0.03,
                 weight_decay: float = 0.1, log_every: int = 10, eval_every_s: float = 15.0,
                 eval_every_steps: int | None = None, log: Callable[[str], None] = print) -> TrainLog:
    """Train in place until `max_steps` or `budget_s` seconds, whichever comes first."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    data = torch.from_numpy(train_tokens.astype(np.int64)).to(device)
    n_windows_max = len(train_tokens) - seq_len - 1
    if n_windows_max < 1:
        raise ValueError(f"the train split has {len(train_tokens)} tokens, fewer than one window of {seq_len + 1}")
    offsets = torch.arange(seq_len + 1, device=device)
    eval_x = torch.from_numpy(eval_windows).to(device)
    opt = torch.optim.AdamW(_param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.startswith("cuda"))
    V = model.config.vocab_size
    out = TrainLog(curve=[], eval_curve=[])
    t0 = time.perf_counter()
    last_eval = t0
    running = None

    best_state: dict | None = None

    def evaluate(step: int) -> None:
        # Early stopping: the corpus is small (a few M tokens) and a longer run memorises it, so the
        # held-out loss turns up while the train loss keeps falling (first H200 run: best 3.41 at
        # step 408, 5.08 at step 1773). Keep the weights of the best evaluation.
        nonlocal best_state
        nll = model_nll(model, eval_x, device=device, batch_size=batch_size)
        model.train()
        out.eval_curve.append({"step": step, "seconds": round(time.perf_counter() - t0, 2), "heldout_loss": nll})
        log(f"[target] step {step}: held-out loss {nll:.4f}")
        if nll < out.best_heldout_loss:
            out.best_step, out.best_heldout_loss = step, nll
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    model.train()
    step = 0
    while True:
        elapsed = time.perf_counter() - t0
        progress = max(step / max_steps, elapsed / budget_s)
        if progress >= 1.0:
            out.stopped_by = "steps" if step >= max_steps else "time budget"
            break
        cur_lr = cosine_lr(progress, lr, warmup)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        starts = torch.from_numpy(rng.integers(0, n_windows_max, size=batch_size)).to(device)
        x = data[starts[:, None] + offsets[None, :]]
        with autocast(device):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, V), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        out.tokens += batch_size * seq_len
        if step % log_every == 0 or step == 1:
            value = float(loss.item())
            running = value if running is None else 0.9 * running + 0.1 * value
            out.curve.append({"step": step, "tokens": out.tokens, "seconds": round(time.perf_counter() - t0, 2),
                              "lr": cur_lr, "train_loss": round(value, 4)})
            if step % (log_every * 10) == 0 or step == 1:
                log(f"[target] step {step} loss {value:.4f} lr {cur_lr:.2e} {time.perf_counter() - t0:.0f}s")
        now = time.perf_counter()
        if (eval_every_steps is not None and step % eval_every_steps == 0) or \
                (eval_every_steps is None and now - last_eval >= eval_every_s):
            evaluate(step)
            last_eval = time.perf_counter()
    out.steps = step
    out.seconds = round(time.perf_counter() - t0, 2)
    if not out.eval_curve or out.eval_curve[-1]["step"] != step:
        evaluate(step)
    if best_state is not None and out.best_step != step:
        model.load_state_dict(best_state)
        log(f"[target] keeping the weights of step {out.best_step} (held-out loss {out.best_heldout_loss:.4f})")
    model.eval()
    return out


def model_nll(model: Any, windows: Any, *, device: str, batch_size: int) -> float:
    """Mean next-token NLL (nats) over positions 1.. of every window."""
    import torch
    import torch.nn.functional as F

    model.eval()
    x_all = windows if isinstance(windows, torch.Tensor) else torch.from_numpy(np.asarray(windows)).to(device)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, x_all.shape[0], batch_size):
            x = x_all[i:i + batch_size]
            with autocast(device):
                logits = model(input_ids=x[:, :-1], use_cache=False).logits
            nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
            total += float(nll)
            count += x[:, 1:].numel()
    return total / max(1, count)


# ------------------------------------------------------------------------------------------------
# the bigram baseline
# ------------------------------------------------------------------------------------------------

def _bigram_counts(tokens: np.ndarray, V: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = np.asarray(tokens, dtype=np.int64)
    codes, counts = np.unique(t[:-1] * V + t[1:], return_counts=True)
    return codes, counts, np.bincount(t[:-1], minlength=V)


def _bigram_eval(codes: np.ndarray, counts: np.ndarray, prev: np.ndarray, V: int, k: float,
                 a: np.ndarray, b: np.ndarray) -> float:
    q = a * V + b
    idx = np.clip(np.searchsorted(codes, q), 0, max(0, len(codes) - 1))
    c_ab = np.where(codes[idx] == q, counts[idx], 0) if len(codes) else np.zeros(len(q))
    p = (c_ab + k) / (prev[a] + k * V)
    return float(-np.log(p).mean())


def bigram_nll(train_tokens: np.ndarray, windows: np.ndarray, V: int,
               ks: tuple[float, ...] = (1.0, 0.3, 0.1, 0.03, 0.01, 0.003, 0.001), k: float | None = None) -> dict:
    """Add-k bigram NLL on the held-out windows' positions 1.. (the tokens the model is scored on):
    p(b | a) = (c(a, b) + k) / (c(a) + k·V) with counts from the train split. Unless `k` is given, it
    is chosen from `ks` on the last 5 % of the train stream with counts from the first 95 %."""
    t = np.asarray(train_tokens, dtype=np.int64)
    scores: dict[float, float] = {}
    cut = int(len(t) * 0.95)
    if k is None and len(t) - cut >= 2:
        codes, counts, prev = _bigram_counts(t[:cut], V)
        val = t[cut:]
        scores = {kk: _bigram_eval(codes, counts, prev, V, kk, val[:-1], val[1:]) for kk in ks}
    best_k = k if k is not None else (min(scores, key=scores.get) if scores else 1.0)
    codes, counts, prev = _bigram_counts(t, V)
    w = np.asarray(windows, dtype=np.int64)
    nll = _bigram_eval(codes, counts, prev, V, best_k, w[:, :-1].reshape(-1), w[:, 1:].reshape(-1))
    return {"k": best_k, "validation_nll_by_k": {str(k): round(v, 4) for k, v in scores.items()}, "nll": nll}
