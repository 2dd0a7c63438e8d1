"""Fixtures for the tokenizer tests: a byte-level BPE vocabulary trained here, GGUF files holding
it, and seeded generators of test strings.  Nothing is downloaded: the training text is the Python
standard library's own source plus generated multilingual text."""

from __future__ import annotations

import functools
import glob
import json
import os
import random
import sysconfig
from typing import Any, Iterator

import numpy as np

# GGUF token types.
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4

# Qwen-style added tokens: the chat markers and FIM/vision markers are control tokens, the
# thinking/tool tags are user-defined (that is how llama.cpp's converter writes Qwen3 vocabularies).
SPECIAL_TOKENS: list[tuple[str, int]] = [
    ("<|endoftext|>", CONTROL),
    ("<|im_start|>", CONTROL),
    ("<|im_end|>", CONTROL),
    ("<|vision_start|>", CONTROL),
    ("<|vision_end|>", CONTROL),
    ("<|fim_prefix|>", CONTROL),
    ("<|fim_pad|>", CONTROL),
    ("<|file_sep|>", CONTROL),
    ("<tool_call>", USER_DEFINED),
    ("</tool_call>", USER_DEFINED),
    ("<think>", USER_DEFINED),
    ("</think>", USER_DEFINED),
    ("<tool_response>", USER_DEFINED),
    ("</tool_response>", USER_DEFINED),
]
SPECIAL_TEXTS = [text for text, _ in SPECIAL_TOKENS]

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def stdlib_sources(max_bytes: int) -> list[str]:
    """Source files of the standard library of the running interpreter, up to max_bytes in all."""
    stdlib = sysconfig.get_paths()["stdlib"]
    out, total = [], 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        out.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return out


# Scripts for generated text: (first, last) code points of common letters.
_SCRIPTS = {
    "cjk": (0x4E00, 0x62FF),
    "hiragana": (0x3041, 0x3096),
    "katakana": (0x30A1, 0x30FA),
    "hangul": (0xAC00, 0xAFFF),
    "cyrillic": (0x0430, 0x044F),
    "greek": (0x03B1, 0x03C9),
    "arabic": (0x0627, 0x064A),
    "devanagari": (0x0915, 0x0939),
    "thai": (0x0E01, 0x0E2E),
}
_EMOJI = [
    "😀", "😂", "🥲", "👍", "👍🏽", "🎉", "🚀", "❤️", "🇯🇵", "🇺🇸", "👨‍👩‍👧", "🧑🏿‍💻", "🏳️‍🌈", "✨", "🔥",
    "☕", "🙏🏻", "🤖", "🐍", "🦀", "⚙️", "1️⃣", "#️⃣", "©️",
]
_WORDS = (
    "the of and to in is was that for it with as his on be at by had are but from or have an they which "
    "one you were all we her she there would their will when who him been has more if no out so said what "
    "up its about than into them can only other time new some could these two may first then do any like "
    "my now over such our man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state good very make "
    "world still own see men work long get here between both life being under never day same another know"
).split()
_CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'LL", "'D", "'x", "'"]
_PUNCT = list(".,;:!?-–—()[]{}\"'…«»“”‘’/\\@#$%^&*_+=<>|~`") + ["。", "、", "，", "！", "？", "：", "「", "」"]
_WHITESPACE = [" ", "  ", "   ", "    ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ", "\u3000", "\xa0", "\u2028",
               "\x0b", "\x0c", "\x85", "\u2003", "\u202f", " \t \n\n  ", "\r", "\r\r\n", " \r ", "\n\r"]
_COMBINING = ["\u0301", "\u0300", "\u0308", "\u0327", "\u0303", "\u20dd", "\u0e31", "\u093f", "\u064e", "\u302a"]


def _script_text(rng: random.Random, script: str, n: int) -> str:
    lo, hi = _SCRIPTS[script]
    return "".join(chr(rng.randint(lo, hi)) for _ in range(n))


def _prose(rng: random.Random, n_words: int) -> str:
    parts = []
    for _ in range(n_words):
        w = rng.choice(_WORDS)
        r = rng.random()
        if r < 0.1:
            w = w.capitalize()
        elif r < 0.13:
            w = w.upper()
        if rng.random() < 0.08:
            w += rng.choice(_CONTRACTIONS)
        if rng.random() < 0.1:
            w += rng.choice(_PUNCT)
        if rng.random() < 0.05:
            w = str(rng.randint(0, 10 ** rng.randint(1, 9)))
        parts.append(w)
    return " ".join(parts)


def multilingual_corpus(seed: int = 1, n: int = 3000) -> list[str]:
    """Generated text in several scripts, so the trained merges cover multi-byte characters."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        script = rng.choice(list(_SCRIPTS))
        words = [_script_text(rng, script, rng.randint(1, 4)) for _ in range(rng.randint(2, 10))]
        sep = "" if script in ("cjk", "hiragana", "katakana", "thai") and rng.random() < 0.6 else " "
        out.append(sep.join(words) + rng.choice(["。", ". ", "\n", "！", " "]) + _prose(rng, 6))
        if rng.random() < 0.3:
            out.append(" ".join(rng.choice(_EMOJI) for _ in range(rng.randint(1, 5))))
    return out


@functools.lru_cache(maxsize=None)
def trained_vocab(vocab_size: int = 3000) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges) of a byte-level BPE trained with a qwen2-style split, followed
    by SPECIAL_TOKENS, in GGUF form (merges as "left right" strings)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(stdlib_sources(1_500_000) + multilingual_corpus(), trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = [""] * len(model["vocab"])
    for text, i in model["vocab"].items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model["merges"]]
    types = [NORMAL] * len(tokens)
    for text, kind in SPECIAL_TOKENS:
        tokens.append(text)
        types.append(kind)
    return tokens, types, merges


def tokenizer_metadata(pre_name: str = "qwen35", **overrides: Any) -> dict[str, Any]:
    """GGUF tokenizer metadata for the trained vocabulary, with the keys a real qwen35 file has
    (BOS and padding <|endoftext|>, EOS <|im_end|>, no BOS added).  Overrides replace keys;
    an override of None removes the key."""
    tokens, types, merges = trained_vocab()
    md: dict[str, Any] = {
        "general.architecture": "qwen35",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre_name,
        "tokenizer.ggml.tokens": list(tokens),
        "tokenizer.ggml.token_type": list(types),
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.add_bos_token": False,
    }
    return with_overrides(md, **overrides)


def with_overrides(md: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """`md` with keys replaced; a short name means tokenizer.ggml.<name>; None removes the key."""
    for key, value in overrides.items():
        key = key if key.startswith(("tokenizer.", "general.")) else f"tokenizer.ggml.{key}"
        if value is None:
            md.pop(key, None)
        else:
            md[key] = value
    return md


def write_tokenizer_gguf(path: str, md: dict[str, Any]) -> None:
    """Write `md` (as made by tokenizer_metadata) into a GGUF with one tiny tensor."""
    import gguf

    writer = gguf.GGUFWriter(path, arch=md["general.architecture"])
    writer.add_name("dflashd tokenizer test")
    writer.add_tokenizer_model(md["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in md:
        writer.add_tokenizer_pre(md["tokenizer.ggml.pre"])
    writer.add_token_list(md["tokenizer.ggml.tokens"])
    writer.add_token_types(md["tokenizer.ggml.token_type"])
    writer.add_token_merges(md["tokenizer.ggml.merges"])
    setters = {
        "tokenizer.ggml.bos_token_id": writer.add_bos_token_id,
        "tokenizer.ggml.eos_token_id": writer.add_eos_token_id,
        "tokenizer.ggml.eot_token_id": writer.add_eot_token_id,
        "tokenizer.ggml.padding_token_id": writer.add_pad_token_id,
        "tokenizer.ggml.add_bos_token": writer.add_add_bos_token,
        "tokenizer.chat_template": writer.add_chat_template,
    }
    for key, setter in setters.items():
        if key in md:
            setter(md[key])
    writer.add_tensor("token_embd.weight", np.zeros((len(md["tokenizer.ggml.tokens"]), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_metadata(path: str) -> dict[str, Any]:
    """Metadata of a GGUF file as Python values, through the project's reader."""
    from daemons.gguf_reader import GGUFFile

    with GGUFFile(path) as f:
        return dict(f.metadata)


# ---------------------------------------------------------------------------------------------
# Test strings.


def _random_codepoint(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.55:
        cp = rng.randint(0x20, 0x2FFF)
    elif r < 0.75:
        cp = rng.randint(0x3000, 0xFFFD)
    elif r < 0.9:
        cp = rng.randint(0x10000, 0x1FFFF)
    else:
        cp = rng.randint(0x20000, 0x10FFFF)
    if 0xD800 <= cp < 0xE000:  # surrogates are not text
        cp -= 0x800
    return chr(cp)


def _code_chunk(rng: random.Random, sources: list[str]) -> str:
    src = rng.choice(sources)
    start = rng.randrange(len(src))
    return src[start:start + rng.randint(1, 400)]


def _special_mix(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 8)):
        r = rng.random()
        if r < 0.35:
            parts.append(rng.choice(SPECIAL_TEXTS))
        elif r < 0.5:
            # A special token cut short or doubled up, which must stay plain text.
            t = rng.choice(SPECIAL_TEXTS)
            parts.append(rng.choice([t[:-1], t[1:], t[: len(t) // 2], "<" + t, t + ">", t.upper()]))
        elif r < 0.7:
            parts.append(rng.choice(["user", "assistant", "system", "tool"]) + rng.choice(["\n", "", " "]))
        elif r < 0.85:
            parts.append(_prose(rng, rng.randint(1, 8)))
        else:
            parts.append(rng.choice(_WHITESPACE) + rng.choice(_EMOJI + ["你好", "{\"a\": 1}"]))
    return "".join(parts)


def _whitespace_mix(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 12)):
        r = rng.random()
        if r < 0.5:
            parts.append(rng.choice(_WHITESPACE) * rng.randint(1, 4))
        elif r < 0.8:
            parts.append(rng.choice(_WORDS + _PUNCT + ["0", "42", "3.14"]))
        else:
            parts.append(rng.choice(_EMOJI + ["日本", "é", "ß"]))
    return "".join(parts)


def _unicode_mix(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 20)):
        r = rng.random()
        if r < 0.5:
            parts.append(_random_codepoint(rng))
        elif r < 0.65:
            parts.append(rng.choice(_COMBINING))
        elif r < 0.8:
            parts.append(rng.choice(_WHITESPACE + _PUNCT))
        elif r < 0.9:
            parts.append(rng.choice(_WORDS) + rng.choice(_CONTRACTIONS))
        else:
            # Digits of several scripts: ASCII, Arabic-Indic, Devanagari, full-width, superscripts.
            parts.append("".join(rng.choice("0123456789٠١٢٣४५६７８⁹½Ⅻ") for _ in range(rng.randint(1, 6))))
    return "".join(parts)


def _cjk_mix(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 8)):
        script = rng.choice(["cjk", "cjk", "hiragana", "katakana", "hangul"])
        parts.append(_script_text(rng, script, rng.randint(1, 12)))
        parts.append(rng.choice(["", "", " ", "。", "、", "，", "！", "\n", "ABC", "123", "（注）", "😀"]))
    return "".join(parts)


def _emoji_mix(rng: random.Random) -> str:
    return "".join(
        rng.choice(_EMOJI) + rng.choice(["", "", " ", "\n", "a", "!", "\ufe0f", "\u200d"])
        for _ in range(rng.randint(1, 10))
    )


def _prose_mix(rng: random.Random) -> str:
    text = _prose(rng, rng.randint(1, 60))
    if rng.random() < 0.3:
        text = text.replace(" ", rng.choice(["  ", "\n", " \n ", "\t"]), rng.randint(1, 3))
    return text


def _script_mix(rng: random.Random) -> str:
    script = rng.choice(list(_SCRIPTS))
    words = [_script_text(rng, script, rng.randint(1, 8)) for _ in range(rng.randint(1, 8))]
    if rng.random() < 0.5:
        words = [w + rng.choice(_COMBINING) for w in words]
    return rng.choice([" ", "", "\n", ", "]).join(words)


STRING_KINDS = ("code", "prose", "cjk", "emoji", "whitespace", "special", "unicode", "scripts")


def parity_strings(n: int, seed: int = 0) -> Iterator[tuple[str, str]]:
    """n (kind, text) pairs, cycling through STRING_KINDS, plus fixed edge cases first."""
    rng = random.Random(seed)
    sources = stdlib_sources(400_000)
    edge_cases = [
        "", " ", "\n", "  ", "\n\n\n", "\r\n\r\n", " \n", "\t\t", "a", "'s", "'S", "don't", "I'LL",
        "x" * 300, " " * 300, "\n" * 50, "1234567890", "3.14159", "①②③", "٣٤٥", "a\u0301", "\u0301",
        "e\u0301\u0302x", " \u0301", "<|im_start|>", "<|im_start|><|im_end|>", "<|im_start|>user\nhi<|im_end|>\n",
        "<think>\n\n</think>\n\n", "<<think>>", "<|im_start", "|im_start|>", "<|endoftext|><|endoftext|>",
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", "\u3000\u3000", "\xa0x", "\x85",
        "\u2028\u2029", "\x00", "\x00\x01\x02", "\U0001F600" * 5, "🇯🇵🇺🇸", "👨‍👩‍👧‍👦",
        "\u1c89\u1c8a", "a\u1c89", "\U00010D40\U00010D41", "x\u0897y", "\u1b4e!", "\U0002EBF0\u4e00",
    ]
    for text in edge_cases[:n]:
        yield "edge", text
    makers = {
        "code": lambda: _code_chunk(rng, sources),
        "prose": lambda: _prose_mix(rng),
        "cjk": lambda: _cjk_mix(rng),
        "emoji": lambda: _emoji_mix(rng),
        "whitespace": lambda: _whitespace_mix(rng),
        "special": lambda: _special_mix(rng),
        "unicode": lambda: _unicode_mix(rng),
        "scripts": lambda: _script_mix(rng),
    }
    for i in range(max(0, n - len(edge_cases))):
        kind = STRING_KINDS[i % len(STRING_KINDS)]
        yield kind, makers[kind]()


# ---------------------------------------------------------------------------------------------
# Probe vocabulary for the code-point sweep.  A pre-tokenizer difference only changes the ids when
# a merge spans the place where one split cuts and the other does not; a trained vocabulary has
# no merges for rare characters, so a Unicode classification difference would go unseen.  This
# vocabulary has, for every byte character c, the merges a+c, c+a, 1+c and c+!, so in
# "aX" / "Xa" / "1X" / "X!" the ids show whether X joined its neighbour in the split.


def _byte_chars() -> list[str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return [chars[b] for b in range(256)]


@functools.lru_cache(maxsize=None)
def probe_vocab() -> tuple[list[str], list[int], list[str]]:
    tokens = _byte_chars()
    seen = set(tokens)
    merges = []
    for c in list(tokens):
        for left, right in (("a", c), (c, "a"), ("1", c), (c, "!")):
            if left + right not in seen:
                seen.add(left + right)
                tokens.append(left + right)
                merges.append(f"{left} {right}")
    types = [NORMAL] * len(tokens)
    for text, kind in SPECIAL_TOKENS:
        tokens.append(text)
        types.append(kind)
    return tokens, types, merges


def probe_metadata(pre_name: str) -> dict[str, Any]:
    tokens, types, merges = probe_vocab()
    return tokenizer_metadata(
        pre_name, tokens=list(tokens), token_type=list(types), merges=list(merges),
        bos_token_id=tokens.index("<|endoftext|>"), eos_token_id=tokens.index("<|im_end|>"),
        padding_token_id=tokens.index("<|endoftext|>"),
    )


def sweep_texts(first: int, last: int, contexts: tuple[str, ...], chunk: int = 8192) -> Iterator[tuple[int, str]]:
    """(first code point, text) chunks holding every code point in [first, last] (surrogates
    excepted) in each of `contexts`, where "X" stands for the code point, one context per line."""
    cps = [c for c in range(first, last + 1) if not 0xD800 <= c < 0xE000]
    for i in range(0, len(cps), chunk):
        yield cps[i], "".join(
            context.replace("X", chr(c)) + "\n" for c in cps[i:i + chunk] for context in contexts
        )
