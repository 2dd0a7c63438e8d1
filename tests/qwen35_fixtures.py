"""Tiny random Qwen3.5 checkpoints for tests: an HF directory built with transformers, its GGUF made
by our converter, and reference logits from the HF model.

    hf_dir, gguf_path, hf_model = build_tiny_qwen35(root, "gqa_untied", outtype="f32")

`root` is any directory (use one per pytest session, e.g. `session_root(tmp_path_factory)`, so that
every test file reuses the same build; builds are cached in-process by (root, config, seed) and
conversions by outtype). The HF directory holds model.safetensors, config.json, a byte-level BPE
tokenizer.json trained here on generated text (Qwen's pre-tokenizer regex; the special tokens
<|endoftext|>, <|im_start|>, <|im_end|> appended after the BPE vocabulary, as in Qwen's tokenizer),
and a tokenizer_config.json with Qwen's special-token settings and a ChatML chat template.

The random weights are scaled so that every part of the model matters: activations of order one,
zero-centred norm weights away from zero, DeltaNet decays exp(g) spread over (0.02, 0.98) and
non-trivial β, so a wrong gate, decay, norm offset or head order changes the logits visibly; and
tamed so that the net is not chaotic (see `_init_weights`).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHATML_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}")

# Two shapes with different head counts; 8 layers with interval 4 -> layers 3 and 7 are full attention.
# d_k == d_v and row lengths that are multiples of 32 keep them loadable by llama.cpp in every outtype.
CONFIGS: dict[str, dict[str, Any]] = {
    "gqa_untied": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                        "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
    "mqa_tied": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=8, num_attention_heads=3,
                     num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6,
                     linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5,
                                      "mrope_section": [3, 3, 2], "mrope_interleaved": True}),
}
BASE_CONFIG: dict[str, Any] = dict(linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
                                   max_position_embeddings=4096, hidden_act="silu", attention_bias=False)
TOKENIZER_VOCAB = 1000        # BPE vocabulary trained (bytes + merges), before the special tokens

_WORDS = ("the of and to in is was that for it with as his on be at by had are but from or have an they "
          "which one you were all we her she there would their will when who him been has more if no out "
          "so said what up its about into than them can only other new some could time these two may then "
          "do first any my now such like our over man me even most made after also did many before must "
          "through back years where much your way well down should because each just those people how too "
          "little state good very make world still own see men work long get here between both life being "
          "under never day same another know while last might us great old year off come since against go "
          "came right used take three delta rule gated attention state token model cache decode prefill").split()


def training_text(seed: int = 0, n_lines: int = 3000) -> list[str]:
    """Deterministic pseudo-English with numbers, punctuation, a few accented and CJK words."""
    rng = random.Random(seed)
    extras = ["naïve", "café", "Ünïcode", "日本語", "中文", "данные", "λόγος", "x²", "—", "…"]
    lines = []
    for _ in range(n_lines):
        words = []
        for _ in range(rng.randint(3, 14)):
            r = rng.random()
            if r < 0.06:
                words.append(str(rng.randint(0, 99999)))
            elif r < 0.09:
                words.append(rng.choice(extras))
            else:
                w = rng.choice(_WORDS)
                words.append(w.capitalize() if rng.random() < 0.1 else w)
        line = " ".join(words) + rng.choice([".", ",", "!", "?", ":", ";", " -", "'s", "'ll"])
        if rng.random() < 0.1:
            line = "    " + line + "\n"
        lines.append(line)
    return lines


def write_tokenizer(hf_dir: Path, seed: int = 0, vocab_size: int = TOKENIZER_VOCAB) -> Any:
    """Train a byte-level BPE tokenizer and write tokenizer.json + tokenizer_config.json.
    Returns the `tokenizers.Tokenizer`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tok.train_from_iterator(training_text(seed), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(hf_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tok_config = {
        "add_bos_token": False, "add_prefix_space": False, "errors": "replace", "split_special_tokens": False,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "model_max_length": 4096, "tokenizer_class": "Qwen2Tokenizer", "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for t, i in ids.items()},
    }
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2), encoding="utf-8")
    return tok


def _init_weights(model: Any, seed: int) -> None:
    """Re-draw every parameter (see the module docstring for why these scales)."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                # A in (0.05, 2): with softplus(a + dt_bias) ~ 0.3..2 the decay exp(g) spans ~(0.02, 0.98)
                p.copy_(torch.empty(p.shape).uniform_(np.log(0.05), np.log(2.0), generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("linear_attn.norm.weight"):          # plain weight around 1
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):                       # zero-centred: HF uses 1 + w
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                # residual updates at half the stream's scale (see below)
                p.copy_(0.5 * torch.randn(p.shape, generator=g) / np.sqrt(p.shape[1]))
            elif p.ndim == 2:                                        # linear layers: unit-variance outputs
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[1]))
            else:
                raise AssertionError(f"unexpected parameter {name}")
        # An untrained random net is chaotic: a 0.5% weight perturbation (Q8_0) grew ~2x per layer,
        # mostly because the DeltaNet output RMSNorm renormalises heads whose q·k is near zero and
        # flips sign under tiny changes. Keys correlated with queries (as in trained models) plus the
        # halved residual updates keep Q8_0 logits within a few % of F32, so comparisons across
        # types and against llama.cpp stay meaningful; F32 exactness tests are unaffected.
        for name, mod in model.named_modules():
            if name.endswith("linear_attn"):
                kd = mod.key_dim
                for w in (mod.in_proj_qkv.weight, mod.conv1d.weight):
                    w[kd:2 * kd] = 0.9 * w[:kd] + np.sqrt(1 - 0.9 ** 2) * w[kd:2 * kd]


def make_config(name_or_overrides: str | dict[str, Any] = "gqa_untied", vocab_size: int | None = None,
                **overrides: Any) -> Any:
    """A `Qwen3_5TextConfig` from one of CONFIGS (or a dict of overrides on the first one)."""
    from transformers import Qwen3_5TextConfig

    if isinstance(name_or_overrides, str):
        cfg = {**BASE_CONFIG, **CONFIGS[name_or_overrides]}
    else:
        cfg = {**BASE_CONFIG, **CONFIGS["gqa_untied"], **name_or_overrides}
    cfg.update(overrides)
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    config = Qwen3_5TextConfig(**cfg)
    config.architectures = ["Qwen3_5ForCausalLM"]
    return config


_BUILDS: dict[tuple, tuple[Path, Any]] = {}


def build_tiny_qwen35(root: str | os.PathLike, config: str | dict[str, Any] = "gqa_untied", *,
                      outtype: str | None = "f32", seed: int = 0) -> tuple[Path, Path | None, Any]:
    """Build (or reuse) a tiny random `Qwen3_5ForCausalLM` under `root` and convert it.

    config: a CONFIGS name, or a dict of overrides on CONFIGS["gqa_untied"] (any Qwen3_5TextConfig
    field, e.g. {"num_hidden_layers": 4, "tie_word_embeddings": True}).
    Returns (hf_dir, gguf_path or None when outtype is None, hf_model in eval mode, float32, eager
    attention). The GGUF is `<hf_dir>/../<hf_dir name>-<outtype>.gguf`, converted once per outtype."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    from daemons.convert import convert_hf_to_gguf

    root = Path(root)
    overrides = CONFIGS[config] if isinstance(config, str) else config
    key_src = json.dumps(overrides, sort_keys=True) + f"|{seed}"
    tag = (config if isinstance(config, str) else "custom") + f"-s{seed}-" + hashlib.sha1(key_src.encode()).hexdigest()[:8]
    key = (str(root.resolve()), key_src)
    if key not in _BUILDS:
        hf_dir = root / tag
        hf_dir.mkdir(parents=True, exist_ok=True)
        tok = write_tokenizer(hf_dir, seed)
        n_tokens = tok.get_vocab_size(with_added_tokens=True)
        vocab = -(-n_tokens // 64) * 64            # padded like real checkpoints: [PAD] rows exist
        cfg = make_config(config, vocab_size=vocab,
                          bos_token_id=tok.token_to_id("<|endoftext|>"), eos_token_id=tok.token_to_id("<|im_end|>"),
                          pad_token_id=tok.token_to_id("<|endoftext|>"))
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(cfg)
        model.config._attn_implementation = "eager"
        _init_weights(model, seed)
        if cfg.tie_word_embeddings:
            model.tie_weights()
        model = model.float().eval()
        model.save_pretrained(hf_dir, safe_serialization=True)
        _BUILDS[key] = (hf_dir, model)
    hf_dir, model = _BUILDS[key]
    if outtype is None:
        return hf_dir, None, model
    gguf_path = hf_dir.parent / f"{hf_dir.name}-{outtype}.gguf"
    if not gguf_path.exists():
        tmp = gguf_path.with_suffix(".tmp")
        convert_hf_to_gguf(hf_dir, tmp, outtype=outtype)
        os.replace(tmp, gguf_path)
    return hf_dir, gguf_path, model


def session_root(tmp_path_factory: Any) -> Path:
    """One fixture directory per pytest session (shared by every test file that asks)."""
    root = tmp_path_factory.getbasetemp() / "qwen35-fixtures"
    root.mkdir(exist_ok=True)
    return root


def prompt_ids(hf_model: Any, n: int = 48, seed: int = 0) -> list[int]:
    """`n` random ids of real (non-padding, non-special) tokens."""
    rng = np.random.default_rng(seed)
    n_real = TOKENIZER_VOCAB if hf_model.config.vocab_size > TOKENIZER_VOCAB else hf_model.config.vocab_size
    return [int(t) for t in rng.integers(0, n_real, size=n)]


def hf_reference(hf_model: Any, prompt: list[int], n_decode: int = 16) -> dict[str, np.ndarray]:
    """transformers' logits for `prompt` (all positions) and `n_decode` greedy single-token steps
    with the cache: {"prompt_logits": [T, V], "decode_tokens": [n_decode], "decode_logits": [n_decode, V]}
    where decode_logits[i] are the logits after feeding decode_tokens[i]; decode_tokens[0] is the
    argmax of the last prompt position."""
    import torch

    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor([prompt]), use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        prompt_logits = out.logits[0].float().numpy().copy()
        tokens, logits = [], []
        nxt = int(np.argmax(prompt_logits[-1]))
        for _ in range(n_decode):
            tokens.append(nxt)
            step = hf_model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
            cache = step.cache if hasattr(step, "cache") else step.past_key_values
            lg = step.logits[0, -1].float().numpy().copy()
            logits.append(lg)
            nxt = int(np.argmax(lg))
    return {"prompt_logits": prompt_logits, "decode_tokens": np.array(tokens, dtype=np.int64),
            "decode_logits": np.stack(logits)}
