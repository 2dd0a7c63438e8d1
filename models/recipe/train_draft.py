"""The DFlash draft: a small torch module with z-lab's `DFlashDraftModel` layout (what
`daemons/dflash.py` loads), trained on the frozen target's hidden states with SpecForge's recipe
(../shared/design/peers-and-anchors.md §3.4; the math the loader runs is qwen35-dflash-ddtree-math.md §5).

**The module** (`DFlashDraftTorch`) computes what `daemons.dflash.DFlashDraft.block_logits` computes:
context `T_p = RMSNorm(fc · F_p; hidden_norm)` from the concatenated target-layer outputs F_p; per
layer, queries from the block, keys/values `[W_k T ; W_k h]`, `[W_v T ; W_v h]` (k_norm, q_norm, full
head-dim NeoX RoPE at absolute positions, GQA), SwiGLU MLP, plain (not 1+w) RMSNorms; logits =
target head · RMSNorm(h; norm). Tensor names are z-lab's (`fc`, `hidden_norm`, `norm`,
`layers.N.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj,
self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}`); `save_zlab` writes them with a z-lab config.json.
The tests check the module against the loader on the exported files.

**Training** (per batch of token windows):
1. the frozen target runs once (no grad, bf16 autocast on CUDA); forward hooks on its decoder layers
   capture the outputs of the `target_layer_ids` layers (HF `hidden_states[id + 1]`, what
   `Qwen35Model` captures at serving time); its argmax at every position gives the labels;
2. random anchors a (A per window, distinct, in [1, T − B]); each opens a block
   `[x_a, MASK × (B − 1)]` at positions a..a+B−1;
3. attention mask: block j sees the context positions < a_j and its own block (bidirectionally);
   blocks do not see each other;
4. same-position cross-entropy: row k ≥ 1 of block j predicts the label of position a_j + k,
   weighted by exp(−(k − 1)/γ); the target's embedding and head are used frozen (not parameters of
   the draft).
Labels are the target's greedy tokens (argmax of its logits at the previous position, given the
window), not the data: acceptance is agreement with the target. Most windows are the target's own
greedy continuations of chat prompts from the train split (`generate_continuations`), so the block
positions past 1 are labelled with exactly the chain greedy decoding produces.
Per-position acceptance estimates on held-out windows: accuracy of row k, and the fraction of
blocks whose rows 1..k are all right; their sum + 1 estimates the acceptance length (AL).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["DraftSize", "DRAFT_SIZES", "DFlashDraftTorch", "draft_layer_ids", "capture_features", "target_labels",
           "make_blocks", "draft_loss", "acceptance_estimate", "loop_acceptance_length", "generate_continuations", "train_draft", "save_zlab",
           "draft_named_shapes"]


@dataclass(frozen=True)
class DraftSize:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    block_size: int
    n_features: int
    rope_theta: float = 1e6


DRAFT_SIZES = {
    "full": DraftSize(layers=2, heads=6, kv_heads=2, head_dim=64, intermediate=1024, block_size=8, n_features=4),
    "mini": DraftSize(layers=1, heads=4, kv_heads=2, head_dim=32, intermediate=384, block_size=8, n_features=2),
    "micro": DraftSize(layers=1, heads=2, kv_heads=1, head_dim=32, intermediate=128, block_size=8, n_features=2),
}


def draft_layer_ids(n_target_layers: int, n_features: int) -> list[int]:
    """Target layers the draft reads: evenly spaced from layer 1 to the last layer. (z-lab's rule stops
    at n − 3 for deep targets; a shallow target's last layers carry most of what predicts the next
    tokens, so this recipe reads up to the last one. The ids travel in the draft's files.)"""
    if n_features == 1:
        return [n_target_layers - 1]
    lo, hi = 1, n_target_layers - 1
    return sorted({int(round(lo + i * (hi - lo) / (n_features - 1))) for i in range(n_features)})


# ------------------------------------------------------------------------------------------------
# the module
# ------------------------------------------------------------------------------------------------

def _torch():
    import torch
    return torch


def _rms(x: Any, w: Any, eps: float) -> Any:
    torch = _torch()
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def _rope(x: Any, pos: Any, theta: float) -> Any:
    """NeoX RoPE over the full head dim: x [N, R, H, D], pos [N, R] (absolute positions)."""
    torch = _torch()
    D = x.shape[-1]
    half = D // 2
    inv = theta ** (-torch.arange(half, device=x.device, dtype=torch.float64) * 2.0 / D)
    ang = (pos.to(torch.float64)[..., None] * inv).float()[:, :, None, :]       # [N, R, 1, half]
    cos, sin = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _make_module_classes():
    torch = _torch()
    nn = torch.nn

    class RMSNorm(nn.Module):
        def __init__(self, n: int, eps: float):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))
            self.eps = eps

        def forward(self, x):
            return _rms(x, self.weight, self.eps)

    class Attention(nn.Module):
        def __init__(self, d: int, s: DraftSize, eps: float):
            super().__init__()
            self.s = s
            self.q_proj = nn.Linear(d, s.heads * s.head_dim, bias=False)
            self.k_proj = nn.Linear(d, s.kv_heads * s.head_dim, bias=False)
            self.v_proj = nn.Linear(d, s.kv_heads * s.head_dim, bias=False)
            self.o_proj = nn.Linear(s.heads * s.head_dim, d, bias=False)
            self.q_norm = RMSNorm(s.head_dim, eps)
            self.k_norm = RMSNorm(s.head_dim, eps)

        def forward(self, hn, ctx, block_pos, ctx_pos, mask):
            s = self.s
            N, R, _ = hn.shape
            C = ctx.shape[1]
            q = _rope(self.q_norm(self.q_proj(hn).view(N, R, s.heads, s.head_dim)), block_pos, s.rope_theta)
            kv_in = torch.cat([ctx, hn], dim=1)
            kv_pos = torch.cat([ctx_pos, block_pos], dim=1)
            k = _rope(self.k_norm(self.k_proj(kv_in).view(N, C + R, s.kv_heads, s.head_dim)), kv_pos, s.rope_theta)
            v = self.v_proj(kv_in).view(N, C + R, s.kv_heads, s.head_dim)
            rep = s.heads // s.kv_heads          # q-head h reads kv-head h // rep (the loader's GQA)
            k = k.repeat_interleave(rep, dim=2).transpose(1, 2)
            v = v.repeat_interleave(rep, dim=2).transpose(1, 2)
            o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None])
            return self.o_proj(o.transpose(1, 2).reshape(N, R, s.heads * s.head_dim))

    class MLP(nn.Module):
        def __init__(self, d: int, ff: int):
            super().__init__()
            self.gate_proj = nn.Linear(d, ff, bias=False)
            self.up_proj = nn.Linear(d, ff, bias=False)
            self.down_proj = nn.Linear(ff, d, bias=False)

        def forward(self, x):
            return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self, d: int, s: DraftSize, eps: float):
            super().__init__()
            self.input_layernorm = RMSNorm(d, eps)
            self.self_attn = Attention(d, s, eps)
            self.post_attention_layernorm = RMSNorm(d, eps)
            self.mlp = MLP(d, s.intermediate)

        def forward(self, h, ctx, block_pos, ctx_pos, mask):
            h = h + self.self_attn(self.input_layernorm(h), ctx, block_pos, ctx_pos, mask)
            return h + self.mlp(self.post_attention_layernorm(h))

    class DFlashDraftTorch(nn.Module):
        """z-lab DFlashDraftModel (v1) without embedding or head: `forward` returns the final-normed
        hidden states of the block rows; `logits` applies the (frozen, external) target head."""

        def __init__(self, d: int, s: DraftSize, target_layer_ids: Sequence[int], mask_token_id: int, eps: float = 1e-6):
            super().__init__()
            self.d, self.s, self.eps = d, s, eps
            self.target_layer_ids = list(target_layer_ids)
            self.mask_token_id = int(mask_token_id)
            self.fc = nn.Linear(len(self.target_layer_ids) * d, d, bias=False)
            self.hidden_norm = RMSNorm(d, eps)
            self.layers = nn.ModuleList([Layer(d, s, eps) for _ in range(s.layers)])
            self.norm = RMSNorm(d, eps)
            for name, p in self.named_parameters():
                if p.ndim == 2:
                    nn.init.normal_(p, std=0.02)
            for layer in self.layers:           # residual branches start small (GPT-2's 1/sqrt(2L))
                for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * s.layers))

        def context(self, features):
            return self.hidden_norm(self.fc(features))

        def forward(self, block_emb, block_pos, ctx, ctx_pos, mask):
            h = block_emb
            for layer in self.layers:
                h = layer(h, ctx, block_pos, ctx_pos, mask)
            return self.norm(h)

    return DFlashDraftTorch


_CLASS = None


def DFlashDraftTorch(*args: Any, **kwargs: Any) -> Any:          # noqa: N802 - a class factory (torch is lazy)
    global _CLASS
    if _CLASS is None:
        _CLASS = _make_module_classes()
    return _CLASS(*args, **kwargs)


def draft_named_shapes(d: int, s: DraftSize) -> list[tuple[str, tuple[int, ...]]]:
    """The z-lab tensors of a draft of this size for a width-d target (for the byte budget)."""
    out = [("fc.weight", (d, s.n_features * d)), ("hidden_norm.weight", (d,)), ("norm.weight", (d,))]
    for il in range(s.layers):
        p = f"layers.{il}."
        out += [(p + "input_layernorm.weight", (d,)), (p + "post_attention_layernorm.weight", (d,)),
                (p + "self_attn.q_proj.weight", (s.heads * s.head_dim, d)),
                (p + "self_attn.k_proj.weight", (s.kv_heads * s.head_dim, d)),
                (p + "self_attn.v_proj.weight", (s.kv_heads * s.head_dim, d)),
                (p + "self_attn.o_proj.weight", (d, s.heads * s.head_dim)),
                (p + "self_attn.q_norm.weight", (s.head_dim,)), (p + "self_attn.k_norm.weight", (s.head_dim,)),
                (p + "mlp.gate_proj.weight", (s.intermediate, d)), (p + "mlp.up_proj.weight", (s.intermediate, d)),
                (p + "mlp.down_proj.weight", (d, s.intermediate))]
    return out


def save_zlab(draft: Any, out_dir: str | os.PathLike, *, n_vocab: int, n_target_layers: int,
              max_positions: int = 4096) -> Path:
    """Write the draft as a z-lab DFlashDraftModel directory (config.json + model.safetensors, f32)."""
    from safetensors.torch import save_file

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in draft.state_dict().items()}
    save_file(tensors, str(d / "model.safetensors"))
    s = draft.s
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": draft.d,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim, "intermediate_size": s.intermediate, "hidden_act": "silu", "attention_bias": False,
        "rms_norm_eps": draft.eps, "rope_theta": s.rope_theta, "max_position_embeddings": max_positions,
        "vocab_size": n_vocab, "num_target_layers": n_target_layers, "block_size": s.block_size,
        "tie_word_embeddings": False,
        "dflash_config": {"mask_token_id": draft.mask_token_id, "target_layer_ids": list(draft.target_layer_ids),
                          "block_size": s.block_size},
    }
    (d / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return d


# ------------------------------------------------------------------------------------------------
# target side
# ------------------------------------------------------------------------------------------------

def capture_features(target: Any, x: Any, layer_ids: Sequence[int], device: str) -> tuple[Any, Any]:
    """(features [N, T, len(ids)·d] = the outputs of the given decoder layers concatenated in order,
    logits [N, T, V]) of the frozen target on windows x [N, T]."""
    torch = _torch()
    from models.recipe.train_target import autocast

    got: dict[int, Any] = {}
    hooks = []
    for il in layer_ids:
        def hook(_m, _inp, out, il=il):
            got[il] = out[0] if isinstance(out, tuple) else out
        hooks.append(target.model.layers[il].register_forward_hook(hook))
    try:
        with torch.no_grad(), autocast(device):
            logits = target(input_ids=x, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([got[il] for il in layer_ids], dim=-1), logits


def target_labels(logits: Any) -> Any:
    """labels[:, p] = the target's greedy token for position p given the window's tokens < p
    (argmax of the logits at p − 1); position 0 gets -1 (never a label)."""
    torch = _torch()
    g = logits.argmax(-1)
    return torch.cat([torch.full_like(g[:, :1], -1), g[:, :-1]], dim=1)


def _past_cache(out: Any) -> Any:
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


def generate_continuations(target: Any, prompts: Any, n_new: int, device: str, batch_size: int) -> Any:
    """Greedy continuations of equal-length prompts [N, P] by the target (its cache, token by token):
    returns [N, P + n_new]. This is the text the draft will face when decoding greedily."""
    torch = _torch()
    from models.recipe.train_target import autocast

    outs = []
    target.eval()
    with torch.no_grad():
        for i in range(0, prompts.shape[0], batch_size):
            x = prompts[i:i + batch_size]
            with autocast(device):
                out = target(input_ids=x, use_cache=True)
            seq = [x]
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(n_new):
                seq.append(nxt)
                with autocast(device):
                    out = target(input_ids=nxt, past_key_values=_past_cache(out), use_cache=True)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            outs.append(torch.cat(seq, dim=1))
    return torch.cat(outs, dim=0)


# ------------------------------------------------------------------------------------------------
# blocks, loss, acceptance
# ------------------------------------------------------------------------------------------------

def make_blocks(x: Any, n_anchors: int, block_size: int, mask_token_id: int, gen: Any,
                min_anchor: int = 1) -> tuple[Any, Any, Any, Any]:
    """For windows x [N, T]: (anchors [N, A], block tokens [N, A·B], block positions [N, A·B],
    attention mask [N, A·B, T + A·B] over [context ; block] keys)."""
    torch = _torch()
    N, T = x.shape
    B = block_size
    hi = T - B                                    # anchor + B - 1 <= T - 1: every row has a label
    n_pos = hi - min_anchor + 1
    A = min(n_anchors, n_pos)
    scores = torch.rand(N, n_pos, generator=gen, device=x.device)
    anchors = scores.topk(A, dim=1).indices.sort(dim=1).values + min_anchor          # distinct, sorted
    k = torch.arange(B, device=x.device)
    pos = (anchors[:, :, None] + k).reshape(N, A * B)
    tok = torch.full((N, A, B), mask_token_id, dtype=x.dtype, device=x.device)
    tok[:, :, 0] = torch.gather(x, 1, anchors)
    ctx_ok = torch.arange(T, device=x.device)[None, None, :] < anchors[:, :, None]       # [N, A, T]
    ctx_ok = ctx_ok[:, :, None, :].expand(N, A, B, T).reshape(N, A * B, T)
    blk = torch.arange(A, device=x.device).repeat_interleave(B)
    own = (blk[:, None] == blk[None, :])[None].expand(N, A * B, A * B)
    return anchors, tok.reshape(N, A * B), pos, torch.cat([ctx_ok, own], dim=2)


def draft_logits(draft: Any, embed: Any, head: Any, features: Any, x: Any, n_anchors: int,
                 gen: Any, min_anchor: int = 1) -> tuple[Any, Any]:
    """(logits [N, A, B, V], anchors [N, A]) of the draft on windows x with target features; `embed`
    and `head` are the target's (frozen) token embedding and output matrices [V, d]."""
    torch = _torch()
    N, T = x.shape
    B = draft.s.block_size
    anchors, tok, pos, mask = make_blocks(x, n_anchors, B, draft.mask_token_id, gen, min_anchor)
    ctx = draft.context(features)
    ctx_pos = torch.arange(T, device=x.device)[None].expand(N, T)
    h = draft(torch.nn.functional.embedding(tok, embed), pos, ctx, ctx_pos, mask)
    logits = h @ head.t().to(h.dtype)
    return logits.view(N, anchors.shape[1], B, -1), anchors


def _block_labels(labels: Any, anchors: Any, B: int) -> Any:
    torch = _torch()
    idx = anchors[:, :, None] + torch.arange(B, device=anchors.device)
    return torch.gather(labels, 1, idx.reshape(labels.shape[0], -1)).view(idx.shape)     # [N, A, B]


def draft_loss(logits: Any, labels: Any, anchors: Any, gamma: float) -> Any:
    """Same-position CE over rows 1..B−1, row k weighted by exp(−(k − 1)/γ)."""
    torch = _torch()
    N, A, B, V = logits.shape
    y = _block_labels(labels, anchors, B)[:, :, 1:]
    lg = logits[:, :, 1:].float()
    ce = torch.nn.functional.cross_entropy(lg.reshape(-1, V), y.reshape(-1), reduction="none").view(N, A, B - 1)
    w = torch.exp(-torch.arange(B - 1, device=lg.device, dtype=torch.float32) / gamma)
    return (ce * w).sum() / (w.sum() * N * A)


def acceptance_estimate(logits: Any, labels: Any, anchors: Any) -> dict:
    """Row k accuracy and P(rows 1..k all right) over the blocks, and AL ≈ 1 + Σ_k P(rows 1..k right)."""
    torch = _torch()
    B = logits.shape[2]
    y = _block_labels(labels, anchors, B)[:, :, 1:]
    ok = (logits[:, :, 1:].argmax(-1) == y).float()                          # [N, A, B-1]
    prefix = torch.cumprod(ok, dim=-1)
    acc = ok.mean(dim=(0, 1)).tolist()
    pre = prefix.mean(dim=(0, 1)).tolist()
    return {"position_accuracy": [round(a, 4) for a in acc], "prefix_acceptance": [round(p, 4) for p in pre],
            "estimated_al": round(1.0 + sum(pre), 4)}


def loop_acceptance_length(logits: Any, labels: Any, anchors: Any) -> float:
    """The AL the greedy speculative loop would measure (tokens per step) on these windows, given
    blocks at *every* position of a stretch (anchors [N, A] consecutive, as `make_blocks` gives when
    n_anchors covers the range): walk from the first anchor, each step commits the accepted rows + 1.
    The uniform-anchor `estimated_al` weights every position once; the loop takes few steps where
    drafts are long (e.g. where greedy text repeats) and many where they fail, so it measures less
    (2026-11-29 run: 4.03 uniform vs 2.01 loop on the same windows, see README)."""
    torch = _torch()
    B = logits.shape[2]
    y = _block_labels(labels, anchors, B)[:, :, 1:]
    acc = torch.cumprod((logits[:, :, 1:].argmax(-1) == y).long(), dim=-1).sum(-1).cpu().numpy()   # [N, A]
    starts = anchors.cpu().numpy()
    tokens = steps = 0
    for row, a0 in zip(acc, starts):
        if np.any(np.diff(a0) != 1):
            raise ValueError("loop_acceptance_length needs consecutive anchors (a block at every position)")
        i = 0
        while i < len(row):
            tokens += int(row[i]) + 1
            steps += 1
            i += int(row[i]) + 1
    return round(tokens / max(1, steps), 4)


# ------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------

@dataclass
class DraftLog:
    steps: int = 0
    seconds: float = 0.0
    generation_seconds: float = 0.0
    generated_windows: int = 0
    stopped_by: str = ""
    curve: list = None                 # [{step, seconds, lr, loss}]
    eval_curve: list = None            # [{step, seconds, loss, position_accuracy, prefix_acceptance, estimated_al}]

    def to_dict(self) -> dict:
        return asdict(self)


def train_draft(draft: Any, target: Any, *, train_windows: Callable[[Any, int], Any], gen_prompts: Any,
                eval_prompts: Any, device: str, n_new: int, gen_budget_s: float, gen_batch: int, batch_size: int,
                n_anchors: int, max_steps: int, budget_s: float, lr: float, seed: int, gamma: float = 4.0,
                gen_fraction: float = 0.75, warmup: float = 0.05, log_every: int = 10,
                eval_every_s: float = 60.0, eval_every_steps: int | None = None, loop_windows: int = 8,
                log: Callable[[str], None] = print) -> DraftLog:
    """Generate greedy continuations of `gen_prompts` [N, P] (until gen_budget_s), then train the draft
    on batches that are `gen_fraction` continuation windows and the rest data windows
    (`train_windows(rng, n)` -> [n, T]), for max_steps or budget_s (generation included). The
    acceptance estimates are measured on greedy continuations of `eval_prompts` (held-out), with
    anchors in the generated part; `loop_al` walks blocks at every generated position of the first
    `loop_windows` of them, as the speculative loop does."""
    torch = _torch()
    from models.recipe.train_target import autocast, cosine_lr

    t0 = time.perf_counter()
    out = DraftLog(curve=[], eval_curve=[])
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    eval_gen_seed = seed + 1
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()
    # the target's embedding and head, frozen: used by the draft, not parameters of it
    embed = target.model.embed_tokens.weight.detach()
    head = target.lm_head.weight.detach()
    eval_x = generate_continuations(target, eval_prompts, n_new, device, gen_batch)

    # 1. the target's own greedy continuations (the text greedy decoding will meet)
    pool = []
    n_done = 0
    while n_done < gen_prompts.shape[0] and time.perf_counter() - t0 < gen_budget_s:
        chunk = gen_prompts[n_done:n_done + gen_batch]
        pool.append(generate_continuations(target, chunk, n_new, device, gen_batch))
        n_done += chunk.shape[0]
    gen_pool = torch.cat(pool) if pool else None
    out.generation_seconds = round(time.perf_counter() - t0, 2)
    out.generated_windows = 0 if gen_pool is None else int(gen_pool.shape[0])
    log(f"[draft] generated {out.generated_windows} greedy continuations in {out.generation_seconds:.0f}s")

    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01, fused=device.startswith("cuda"))
    draft.train()

    def batch(n: int) -> Any:
        n_gen = int(round(n * gen_fraction)) if gen_pool is not None else 0
        parts = []
        if n_gen:
            parts.append(gen_pool[torch.from_numpy(rng.integers(0, gen_pool.shape[0], size=n_gen)).to(device)])
        if n - n_gen:
            w = train_windows(rng, n - n_gen)
            if gen_pool is not None:
                w = w[:, :gen_pool.shape[1]]
            parts.append(w)
        return torch.cat(parts)

    def evaluate(step: int) -> None:
        draft.eval()
        g = torch.Generator(device=device).manual_seed(eval_gen_seed)
        with torch.no_grad():
            feats, tlog = capture_features(target, eval_x, draft.target_layer_ids, device)
            labels = target_labels(tlog)
            with autocast(device):
                # anchors in the generated part only: what greedy decoding drafts from
                lg, anchors = draft_logits(draft, embed, head, feats, eval_x, n_anchors, g,
                                           min_anchor=eval_prompts.shape[1])
            loss = float(draft_loss(lg, labels, anchors, gamma))
            est = acceptance_estimate(lg, labels, anchors)
            # the loop's AL: blocks at every generated position of a few windows
            k = min(loop_windows, eval_x.shape[0])
            with autocast(device):
                lg_all, anchors_all = draft_logits(draft, embed, head, feats[:k], eval_x[:k], eval_x.shape[1], g,
                                                   min_anchor=eval_prompts.shape[1])
            est["loop_al"] = loop_acceptance_length(lg_all, labels[:k], anchors_all)
            del lg_all
        draft.train()
        out.eval_curve.append({"step": step, "seconds": round(time.perf_counter() - t0, 2), "loss": round(loss, 4), **est})
        log(f"[draft] step {step}: held-out loss {loss:.4f}, estimated AL {est['estimated_al']:.2f} "
            f"(uniform anchors; loop AL {est['loop_al']:.2f}), "
            f"row accuracy {est['position_accuracy'][:4]}")

    t_train = time.perf_counter()
    train_budget = max(1e-3, budget_s - (t_train - t0))
    last_eval = t_train
    step = 0
    while True:
        progress = max(step / max_steps, (time.perf_counter() - t_train) / train_budget)
        if progress >= 1.0:
            out.stopped_by = "steps" if step >= max_steps else "time budget"
            break
        cur_lr = cosine_lr(progress, lr, warmup)
        for gr in opt.param_groups:
            gr["lr"] = cur_lr
        x = batch(batch_size)
        feats, tlog = capture_features(target, x, draft.target_layer_ids, device)
        labels = target_labels(tlog)
        del tlog
        with autocast(device):
            lg, anchors = draft_logits(draft, embed, head, feats, x, n_anchors, gen)
        loss = draft_loss(lg, labels, anchors, gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % log_every == 0 or step == 1:
            out.curve.append({"step": step, "seconds": round(time.perf_counter() - t0, 2), "lr": cur_lr,
                              "loss": round(float(loss.item()), 4)})
            if step % (log_every * 10) == 0 or step == 1:
                log(f"[draft] step {step} loss {float(loss.item()):.4f} lr {cur_lr:.2e} {time.perf_counter() - t0:.0f}s")
        now = time.perf_counter()
        if (eval_every_steps is not None and step % eval_every_steps == 0) or \
                (eval_every_steps is None and now - last_eval >= eval_every_s):
            evaluate(step)
            last_eval = time.perf_counter()
    out.steps = step
    out.seconds = round(time.perf_counter() - t0, 2)
    if not out.eval_curve or out.eval_curve[-1]["step"] != step:
        evaluate(step)
    draft.eval()
    return out
