"""The recipe's tokenizer: byte-level BPE trained with HF `tokenizers` on the train split, with
Qwen's pre-tokenizer split (the `qwen35` regex that `daemons/tokenizer.py` runs for
`tokenizer.ggml.pre = qwen35`, which is what our converter writes) and the special tokens a Qwen
chat template uses, appended after the BPE vocabulary as in Qwen's own tokenizer.

No normalizer: llama.cpp (and `daemons.tokenizer`) apply none, so a normalizer here would make the
training ids differ from the serving ids. `check_against_runtime` compares the two on sample text.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = ["SPECIAL_TOKENS", "CONTROL_TOKENS", "MASK_TOKEN", "QWEN35_SPLIT", "train_tokenizer", "load_tokenizer",
           "padded_vocab_size", "check_against_runtime"]

# Control tokens (special=True: never produced by BPE, removed from decoded text) and Qwen's
# user-defined markers (special=False, as in Qwen3's tokenizer_config: they print as text).
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MASK_TOKEN = "<|mask|>"            # DFlash's block filler (Qwen's released drafts use a <|MASK|>-like id)
MARKER_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
SPECIAL_TOKENS = CONTROL_TOKENS + MARKER_TOKENS + (MASK_TOKEN,)
# daemons/tokenizer.py's _QWEN35_REGEX (the case-insensitive contractions written with (?i:...)).
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
VOCAB_MULTIPLE = 64               # the model's embedding rows are padded to this, like Qwen's checkpoints


def padded_vocab_size(n_tokens: int) -> int:
    return -(-n_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def train_tokenizer(texts: Iterable[str], out_dir: str | os.PathLike, vocab_size: int = 8192,
                    chat_template: str | None = None, model_max_length: int = 4096) -> Any:
    """Train on `texts` (the train split only) to `vocab_size` tokens in all (BPE tokens + the
    special tokens; fewer when the text has too few distinct pairs), write tokenizer.json and
    tokenizer_config.json into `out_dir`, and return the `tokenizers.Tokenizer`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS + (MASK_TOKEN,)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    decoder = {}
    for t in SPECIAL_TOKENS:
        decoder[str(tok.token_to_id(t))] = {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                            "single_word": False, "special": t not in MARKER_TOKENS}
    config = {
        "add_bos_token": False, "add_prefix_space": False, "errors": "replace", "split_special_tokens": False,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "mask_token": MASK_TOKEN, "model_max_length": model_max_length, "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": decoder,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return tok


def load_tokenizer(out_dir: str | os.PathLike) -> Any:
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(Path(out_dir) / "tokenizer.json"))


def check_against_runtime(hf_tok: Any, runtime_tok: Any, texts: Sequence[str]) -> dict[str, int]:
    """Encode `texts` with the HF tokenizer (training ids) and with `daemons.tokenizer.Tokenizer`
    (serving ids, built from the GGUF): {"texts": n, "mismatched": m}. A mismatch means the model
    would be served ids it never saw in training."""
    bad = 0
    for t in texts:
        if hf_tok.encode(t).ids != runtime_tok.encode(t, add_special=False, parse_special=True):
            bad += 1
    return {"texts": len(texts), "mismatched": bad}
