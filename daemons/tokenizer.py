"""Byte-level BPE tokenizer built from GGUF metadata, token-for-token identical to llama.cpp.

A GGUF file carries its tokenizer as metadata: the vocabulary (`tokenizer.ggml.tokens`), the merge
ranks (`tokenizer.ggml.merges`), a type per token (`tokenizer.ggml.token_type`) and the name of the
pre-tokenizer (`tokenizer.ggml.pre`).  This module rebuilds that tokenizer on top of HF `tokenizers`
and reproduces the parts of llama.cpp's `llama-vocab.cpp` that decide which ids come out:

* special-token partitioning: control/user-defined tokens are cut out of the text first, longest
  token text first, before any pre-tokenization (`tokenizer_st_partition`); control tokens only
  when `parse_special` is set, user-defined tokens always;
* the pre-tokenizer split chosen by `tokenizer.ggml.pre` (llama.cpp's regexes, run by HF's
  Oniguruma-backed `Split`), pinned to the Unicode version of llama.cpp's character tables;
* GPT-2 byte-to-unicode mapping and rank-ordered BPE merges (`llm_tokenizer_bpe_session`);
* the special-id rules: BOS/EOS/EOT/EOM/padding ids from metadata, EOT and FIM tokens found by their
  text when the ids are missing, the end-of-generation set, and tokens whose type llama.cpp
  overrides to "control".

Only `tokenizer.ggml.model = "gpt2"` is supported; other models raise `TokenizerError`.
"""

from __future__ import annotations

import codecs
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

__all__ = ["TokenizerError", "Tokenizer", "StreamDecoder", "SUPPORTED_PRE_TOKENIZERS"]


class TokenizerError(ValueError):
    """The tokenizer metadata is missing, malformed or unsupported, or the input cannot be tokenized."""


# GGUF token types (`tokenizer.ggml.token_type`, gguf-py's TokenType / llama.cpp's llama_token_type).
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6
_KNOWN_TOKEN_TYPES = frozenset(range(7))

# Token types that are matched as whole units in the text instead of going through BPE.
_SPECIAL_TYPES = frozenset({TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN})
# Token types that are only matched when parse_special is set, and dropped by skip_special.
_CONTROL_TYPES = frozenset({TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN})


# ---------------------------------------------------------------------------------------------
# GPT-2 byte <-> unicode mapping: printable bytes stand for themselves, the others are shifted to
# U+0100.. in byte order, so every byte string has a printable, reversible text form.


def _bytes_to_unicode() -> dict[int, str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


_BYTE_TO_UNICODE: dict[int, str] = _bytes_to_unicode()
_UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in _BYTE_TO_UNICODE.items()}


# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, as llama.cpp writes them in llm_tokenizer_bpe's constructor
# (src/llama-vocab.cpp).  llama.cpp runs the ones for gpt2/llama3/qwen2/qwen35 through hand-written
# splitters (src/unicode.cpp, unicode_regex_split_custom_*) that behave as these regexes do; the
# `default` list goes through std::regex.  Each list is applied in order, each regex splitting the
# pieces the previous one produced, with the unmatched stretches kept as pieces of their own, which
# is what a sequence of HF `Split(..., "isolated")` does.

_CONTRACTIONS_CI = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX = (
    _CONTRACTIONS_CI
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    _CONTRACTIONS_CI
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5 keeps combining marks (\p{M}) inside letter runs and out of punctuation runs.
_QWEN35_REGEX = (
    _CONTRACTIONS_CI
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT_REGEXES = (
    r"[\p{P}\$\+<=>\^~\|]+",
    _GPT2_REGEX,
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)

# name -> (regexes, ignore_merges, add_bos when tokenizer.ggml.add_bos_token is absent),
# with the names and flags llama.cpp's llama_vocab::impl::load gives them.
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "default": (_DEFAULT_REGEXES, False, False),
    "gpt-2": ((_GPT2_REGEX,), False, False),
    "llama-bpe": ((_LLAMA3_REGEX,), True, True),
    "llama3": ((_LLAMA3_REGEX,), True, True),
    "llama-v3": ((_LLAMA3_REGEX,), True, True),
    "qwen2": ((_QWEN2_REGEX,), False, False),
    "deepseek-r1-qwen": ((_QWEN2_REGEX,), False, False),
    "qwen35": ((_QWEN35_REGEX,), False, False),
}
SUPPORTED_PRE_TOKENIZERS: tuple[str, ...] = tuple(sorted(_PRE_TOKENIZERS))

# llama.cpp classifies code points with tables generated from Unicode 15.1 (src/unicode-data.cpp);
# the Oniguruma inside HF `tokenizers` knows Unicode 16.0.  The code points below were assigned in
# Unicode 16.0 (to the general category named), so llama.cpp treats them as unassigned: not a letter,
# mark, number or punctuation.  Without these exclusions a Unicode-16 letter such as U+1C89 joins a
# word in HF's split and stands alone in llama.cpp's, and the ids differ.  tests/test_tokenizer.py
# sweeps every code point against llama.cpp, so a change on either side shows up there.
_UNICODE16_ADDITIONS: dict[str, tuple[tuple[int, int], ...]] = {
    "L": (
        (0x01C89, 0x01C8A), (0x0A7CB, 0x0A7CD), (0x0A7DA, 0x0A7DC), (0x105C0, 0x105F3),
        (0x10D4A, 0x10D65), (0x10D6F, 0x10D85), (0x10EC2, 0x10EC4), (0x11380, 0x11389),
        (0x1138B, 0x1138B), (0x1138E, 0x1138E), (0x11390, 0x113B5), (0x113B7, 0x113B7),
        (0x113D1, 0x113D1), (0x113D3, 0x113D3), (0x11BC0, 0x11BE0), (0x13460, 0x143FA),
        (0x16100, 0x1611D), (0x16D40, 0x16D6C), (0x18CFF, 0x18CFF), (0x1E5D0, 0x1E5ED),
        (0x1E5F0, 0x1E5F0),
    ),
    "N": (
        (0x10D40, 0x10D49), (0x116D0, 0x116E3), (0x11BF0, 0x11BF9), (0x16130, 0x16139),
        (0x16D70, 0x16D79), (0x1CCF0, 0x1CCF9), (0x1E5F1, 0x1E5FA),
    ),
    "M": (
        (0x00897, 0x00897), (0x10D69, 0x10D6D), (0x10EFC, 0x10EFC), (0x113B8, 0x113C0),
        (0x113C2, 0x113C2), (0x113C5, 0x113C5), (0x113C7, 0x113CA), (0x113CC, 0x113D0),
        (0x113D2, 0x113D2), (0x113E1, 0x113E2), (0x11F5A, 0x11F5A), (0x1611E, 0x1612F),
        (0x1E5EE, 0x1E5EF),
    ),
    "P": (
        (0x01B4E, 0x01B4F), (0x01B7F, 0x01B7F), (0x10D6E, 0x10D6E), (0x113D4, 0x113D5),
        (0x113D7, 0x113D8), (0x11BE1, 0x11BE1), (0x16D6D, 0x16D6F), (0x1E5FF, 0x1E5FF),
    ),
}


def _pin_unicode_categories(pattern: str) -> str:
    """Rewrite each \\p{X} of `pattern` into Oniguruma's class `[\\p{X}&&[^<Unicode 16 additions>]]`.

    The nested class works both on its own and inside another class (`[^\\s\\p{L}]`), where
    Oniguruma takes the union of the members, so negated classes pick the excluded points up."""
    for category, ranges in _UNICODE16_ADDITIONS.items():
        excluded = "".join(
            f"\\x{{{lo:X}}}" if lo == hi else f"\\x{{{lo:X}}}-\\x{{{hi:X}}}" for lo, hi in ranges
        )
        pattern = pattern.replace(f"\\p{{{category}}}", f"[\\p{{{category}}}&&[^{excluded}]]")
    return pattern


# ---------------------------------------------------------------------------------------------
# Token texts llama.cpp recognises when the metadata does not name the id (llama_vocab::impl::load,
# "auto-detect special tokens by text").  Where several candidates exist llama.cpp takes whichever
# its hash map yields first; this module takes the first in the order listed, which is deterministic.

_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "tokenizer.ggml.fim_pre_token_id": (
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
        "<|code_prefix|>", "<|prefix|>",
    ),
    "tokenizer.ggml.fim_suf_token_id": (
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
        "<|code_suffix|>", "<|suffix|>",
    ),
    "tokenizer.ggml.fim_mid_token_id": (
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
        "<|code_middle|>", "<|middle|>",
    ),
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": (
        "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    ),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}
# Old spellings of the FIM keys that llama.cpp still reads.
_FIM_KEY_ALIASES = {
    "tokenizer.ggml.fim_pre_token_id": "tokenizer.ggml.prefix_token_id",
    "tokenizer.ggml.fim_suf_token_id": "tokenizer.ggml.suffix_token_id",
    "tokenizer.ggml.fim_mid_token_id": "tokenizer.ggml.middle_token_id",
}
# FIM tokens that end generation.
_EOG_FIM_KEYS = (
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
)
# Every token with one of these texts ends generation (and is made a control token).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
# gpt-oss control tokens that llama.cpp always renders (it makes them user-defined).
_ALWAYS_RENDERED_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


# ---------------------------------------------------------------------------------------------
# Metadata access with typed errors.


def _get_str_list(md: Mapping[str, Any], key: str, where: str, required: bool = True) -> list[str] | None:
    value = md.get(key)
    if value is None:
        if required:
            raise TokenizerError(f"{where}missing metadata key {key}")
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TokenizerError(f"{where}{key} must be an array of strings, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise TokenizerError(f"{where}{key}[{i}] must be a string, got {type(item).__name__}")
    return list(value)


def _get_int_list(md: Mapping[str, Any], key: str, where: str) -> list[int] | None:
    value = md.get(key)
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TokenizerError(f"{where}{key} must be an array of integers, got {type(value).__name__}")
    out = []
    for i, item in enumerate(value):
        # numpy integer scalars are accepted; bools are not integers here.
        if isinstance(item, bool) or not hasattr(item, "__index__"):
            raise TokenizerError(f"{where}{key}[{i}] must be an integer, got {type(item).__name__}")
        out.append(int(item))
    return out


def _get_id(md: Mapping[str, Any], key: str, n_vocab: int, where: str) -> int | None:
    value = md.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TokenizerError(f"{where}{key} must be an integer, got {type(value).__name__}")
    value = int(value)
    if not 0 <= value < n_vocab:
        raise TokenizerError(f"{where}{key} = {value} is outside the vocabulary (size {n_vocab})")
    return value


def _get_bool(md: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = md.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TokenizerError(f"{where}{key} must be a boolean, got {value!r}")


def _get_str(md: Mapping[str, Any], key: str, where: str) -> str | None:
    value = md.get(key)
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise TokenizerError(f"{where}{key} is not valid UTF-8") from None
    if not isinstance(value, str):
        raise TokenizerError(f"{where}{key} must be a string, got {type(value).__name__}")
    return value


class Tokenizer:
    """A GGUF `gpt2` (byte-level BPE) tokenizer.  Build it with `Tokenizer.from_metadata`.

    Ids: `bos_id`, `eos_id`, `eot_id`, `eom_id`, `pad_id`, `unk_id` (None when the model has none),
    `add_bos`/`add_eos` (whether `encode(add_special=True)` adds them) and `stop_ids`, the set of
    ids that end generation (llama.cpp's end-of-generation set: EOS, EOT, EOM, the FIM pad/repo/sep
    tokens and every token whose text is a known end marker such as `<|im_end|>`)."""

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int],
        merges: Sequence[tuple[str, str]],
        pre: str,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        eot_id: int | None = None,
        eom_id: int | None = None,
        pad_id: int | None = None,
        unk_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        stop_ids: Iterable[int] = (),
        source: str = "",
    ) -> None:
        """Low-level constructor: `token_types` must already hold llama.cpp's effective types.
        Use `from_metadata` to get them from GGUF metadata."""
        where = f"{source}: " if source else ""
        if pre not in _PRE_TOKENIZERS:
            raise TokenizerError(
                f"{where}unsupported pre-tokenizer {pre!r} (supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)})"
            )
        if len(token_types) != len(tokens):
            raise TokenizerError(f"{where}{len(token_types)} token types for {len(tokens)} tokens")
        self.source = source
        self.pre = pre
        self._tokens: list[str] = list(tokens)
        self._types: list[int] = list(token_types)
        self.bos_id, self.eos_id, self.eot_id, self.eom_id = bos_id, eos_id, eot_id, eom_id
        self.pad_id, self.unk_id = pad_id, unk_id
        self.add_bos, self.add_eos = add_bos, add_eos
        if add_bos and bos_id is None:
            raise TokenizerError(f"{where}the tokenizer adds BOS but has no tokenizer.ggml.bos_token_id")
        if add_eos and eos_id is None:
            raise TokenizerError(f"{where}the tokenizer adds EOS but has no tokenizer.ggml.eos_token_id")
        self.stop_ids: frozenset[int] = frozenset(stop_ids)

        # Like llama.cpp's token_to_id, a later duplicate of a token text wins.
        self._text_to_id: dict[str, int] = {text: i for i, text in enumerate(self._tokens)}

        # Special tokens, longest text first: llama.cpp cuts every occurrence of the longest token
        # out of all text fragments before it looks for the next one.  Equal lengths go by id.
        specials = [i for i, t in enumerate(self._types) if t in _SPECIAL_TYPES]
        specials.sort(key=lambda i: (-len(self._tokens[i].encode("utf-8")), i))
        self._specials_all: list[tuple[str, int]] = [(self._tokens[i], i) for i in specials]
        self._specials_always: list[tuple[str, int]] = [
            (self._tokens[i], i) for i in specials if self._types[i] not in _CONTROL_TYPES
        ]

        # Byte characters missing from the vocabulary: llama.cpp cannot encode such bytes, and HF's
        # BPE would drop them silently, so text containing them is refused.
        self._missing_bytes = frozenset(
            b for b, ch in _BYTE_TO_UNICODE.items() if ch not in self._text_to_id
        )

        regexes, ignore_merges, _ = _PRE_TOKENIZERS[pre]
        for n, (left, right) in enumerate(merges):
            for part in (left, right, left + right):
                if part not in self._text_to_id:
                    raise TokenizerError(
                        f"{where}merge {n} ({left!r} + {right!r}) uses {part!r}, which is not in the vocabulary"
                    )
        try:
            bpe = models.BPE(
                vocab=self._text_to_id, merges=list(merges), ignore_merges=ignore_merges, fuse_unk=False
            )
        except Exception as exc:  # tokenizers raises its own exception types
            raise TokenizerError(f"{where}cannot build the BPE model: {exc}") from None
        hf = _HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_pin_unicode_categories(r)), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        hf.decoder = decoders.ByteLevel()
        self._hf = hf
        self._pieces: list[bytes | None] = [None] * len(self._tokens)

    # -----------------------------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], source: str = "") -> "Tokenizer":
        """Build the tokenizer from a GGUF metadata mapping (key -> Python value).

        `source` (usually the file path) prefixes error messages."""
        where = f"{source}: " if source else ""
        if not isinstance(md, Mapping):
            raise TokenizerError(f"{where}metadata must be a mapping, got {type(md).__name__}")
        model = _get_str(md, "tokenizer.ggml.model", where)
        if model is None:
            raise TokenizerError(f"{where}missing metadata key tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(f"{where}unsupported tokenizer model {model!r} (supported: 'gpt2')")
        # llama.cpp falls back to the `default` pre-tokenizer when the key is absent.
        pre = _get_str(md, "tokenizer.ggml.pre", where) or "default"
        if pre not in _PRE_TOKENIZERS:
            raise TokenizerError(
                f"{where}unsupported pre-tokenizer {pre!r} (supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)})"
            )
        tokens = _get_str_list(md, "tokenizer.ggml.tokens", where)
        assert tokens is not None
        n_vocab = len(tokens)
        if n_vocab == 0:
            raise TokenizerError(f"{where}tokenizer.ggml.tokens is empty")
        # llama.cpp renames empty token texts so that they stay distinct and never match.
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]

        types = _get_int_list(md, "tokenizer.ggml.token_type", where)
        if types is None:
            types = [TOKEN_TYPE_NORMAL] * n_vocab
        elif len(types) < n_vocab:
            raise TokenizerError(
                f"{where}tokenizer.ggml.token_type has {len(types)} entries for {n_vocab} tokens"
            )
        # Unknown type numbers behave as "undefined" in llama.cpp: never matched, empty text.
        types = [t if t in _KNOWN_TOKEN_TYPES else TOKEN_TYPE_UNDEFINED for t in types[:n_vocab]]

        raw_merges = _get_str_list(md, "tokenizer.ggml.merges", where)
        assert raw_merges is not None
        merges: list[tuple[str, str]] = []
        for n, merge in enumerate(raw_merges):
            # Split at the first space after the first character, as llama.cpp does: a merge's left
            # part can itself be a space.
            cut = merge.find(" ", 1)
            if cut < 0:
                raise TokenizerError(f"{where}tokenizer.ggml.merges[{n}] = {merge!r} is not 'left right'")
            merges.append((merge[:cut], merge[cut + 1:]))

        def get_id(key: str) -> int | None:
            return _get_id(md, key, n_vocab, where)

        bos_id = get_id("tokenizer.ggml.bos_token_id")
        eos_id = get_id("tokenizer.ggml.eos_token_id")
        eot_id = get_id("tokenizer.ggml.eot_token_id")
        eom_id = get_id("tokenizer.ggml.eom_token_id")
        pad_id = get_id("tokenizer.ggml.padding_token_id")
        unk_id = get_id("tokenizer.ggml.unknown_token_id")
        fim_ids: dict[str, int | None] = {}
        for key, alias in [(k, _FIM_KEY_ALIASES.get(k)) for k in _FIM_TEXTS]:
            fim_ids[key] = get_id(key)
            if fim_ids[key] is None and alias is not None:
                fim_ids[key] = get_id(alias)

        _, _, add_bos_default = _PRE_TOKENIZERS[pre]
        add_bos = _get_bool(md, "tokenizer.ggml.add_bos_token", add_bos_default, where)
        add_eos = _get_bool(md, "tokenizer.ggml.add_eos_token", False, where)

        # --- llama.cpp's text-based special-token rules, in its order ---------------------------
        text_to_id = {text: i for i, text in enumerate(tokens)}

        def find_by_text(candidates: Iterable[str]) -> int | None:
            for text in candidates:
                if text in text_to_id:
                    return text_to_id[text]
            return None

        def make_control(token_id: int) -> None:
            # llama.cpp overrides the type of end/FIM markers it finds, so they parse and render
            # as control tokens whatever the file says.
            types[token_id] = TOKEN_TYPE_CONTROL

        if eot_id is None:
            eot_id = find_by_text(_EOT_TEXTS)
            if eot_id is not None:
                make_control(eot_id)
        if eom_id is None:
            eom_id = find_by_text(_EOM_TEXTS)
            if eom_id is not None:
                make_control(eom_id)
        for key, candidates in _FIM_TEXTS.items():
            if fim_ids[key] is None:
                fim_ids[key] = find_by_text(candidates)
                if fim_ids[key] is not None:
                    make_control(fim_ids[key])

        stop: set[int] = {fim_ids[k] for k in _EOG_FIM_KEYS if fim_ids[k] is not None}
        for text, token_id in text_to_id.items():
            if text in _EOG_TEXTS:
                stop.add(token_id)
                make_control(token_id)
        for text in _ALWAYS_RENDERED_TEXTS:
            if text in text_to_id:
                types[text_to_id[text]] = TOKEN_TYPE_USER_DEFINED
        stop.update(i for i in (eos_id, eot_id, eom_id) if i is not None)

        stop_texts = {tokens[i] for i in stop}
        # gpt-oss / solar-open: "<|end|>" ends a message, not the generation, when the vocabulary
        # also has the "return"/"call" (or "calls"/"flush") markers.
        if "<|end|>" in stop_texts and (
            {"<|return|>", "<|call|>"} <= stop_texts or {"<|calls|>", "<|flush|>"} <= stop_texts
        ):
            end_ids = {i for i in stop if tokens[i] == "<|end|>"}
            stop -= end_ids
            for i in end_ids:
                types[i] = TOKEN_TYPE_USER_DEFINED
        # gemma4 / plamo: "</s>" is an ordinary token there.
        if "</s>" in stop_texts and ({"<|tool_response>", "<|plamo:eos|>"} & stop_texts):
            s_ids = {i for i in stop if tokens[i] == "</s>"}
            stop -= s_ids
            for i in s_ids:
                types[i] = TOKEN_TYPE_NORMAL

        return cls(
            tokens, types, merges, pre,
            bos_id=bos_id, eos_id=eos_id, eot_id=eot_id, eom_id=eom_id, pad_id=pad_id, unk_id=unk_id,
            add_bos=add_bos, add_eos=add_eos, stop_ids=stop, source=source,
        )

    # -----------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def add_bos_token(self) -> bool:
        """Same as `add_bos`, under the GGUF key's name (`tokenizer.ggml.add_bos_token`)."""
        return self.add_bos

    def token_text(self, token_id: int) -> str:
        """The token's vocabulary string, as stored in the GGUF (byte-level form for normal tokens)."""
        self._check_id(token_id)
        return self._tokens[token_id]

    def token_type(self, token_id: int) -> int:
        """The token's effective GGUF token type (after llama.cpp's overrides)."""
        self._check_id(token_id)
        return self._types[token_id]

    def token_id(self, text: str) -> int | None:
        """The id whose vocabulary string is `text`, or None."""
        return self._text_to_id.get(text)

    def is_special(self, token_id: int) -> bool:
        """True for tokens matched as whole units in text (control, user-defined, unknown)."""
        self._check_id(token_id)
        return self._types[token_id] in _SPECIAL_TYPES

    def is_control(self, token_id: int) -> bool:
        """True for control and unknown tokens: only parsed with parse_special, dropped by skip_special."""
        self._check_id(token_id)
        return self._types[token_id] in _CONTROL_TYPES

    def _check_id(self, token_id: int) -> None:
        if isinstance(token_id, bool) or not hasattr(token_id, "__index__"):
            raise TokenizerError(f"token id must be an integer, got {type(token_id).__name__}")
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (size {len(self._tokens)})")

    # -----------------------------------------------------------------------------------------
    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special tokens out of `text`: the result alternates raw-text fragments and ids."""
        fragments: list[str | int] = [text]
        for token_text, token_id in self._specials_all if parse_special else self._specials_always:
            if not any(isinstance(f, str) and token_text in f for f in fragments):
                continue
            cut: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, str) and token_text in fragment:
                    parts = fragment.split(token_text)
                    for k, part in enumerate(parts):
                        if k:
                            cut.append(token_id)
                        if part:
                            cut.append(part)
                else:
                    cut.append(fragment)
            fragments = cut
        return fragments

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`, as llama.cpp's llama_tokenize(text, add_special, parse_special).

        add_special adds BOS (and EOS) where the model asks for it (`add_bos`/`add_eos`);
        parse_special lets control tokens written in the text (e.g. "<|im_start|>") become their ids,
        otherwise they are tokenized as plain text.  User-defined tokens are always recognised."""
        if not isinstance(text, str):
            raise TokenizerError(f"text to encode must be a str, got {type(text).__name__}")
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(
                f"text is not valid Unicode: lone surrogate U+{ord(text[exc.start]):04X} at index {exc.start}"
            ) from None
        if self._missing_bytes and any(b in self._missing_bytes for b in raw):
            bad = next(b for b in raw if b in self._missing_bytes)
            raise TokenizerError(f"the vocabulary has no token for byte 0x{bad:02X}, which the text contains")
        ids: list[int] = []
        if add_special and self.add_bos:
            ids.append(self.bos_id)  # type: ignore[arg-type]
        for fragment in self._partition(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
            else:
                ids.extend(self._hf.encode(fragment, add_special_tokens=False).ids)
        if add_special and self.add_eos:
            ids.append(self.eos_id)  # type: ignore[arg-type]
        return ids

    # -----------------------------------------------------------------------------------------
    def token_to_piece(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (llama.cpp's token_to_piece with special=True).

        Normal tokens map back through the byte-level alphabet; control, user-defined and unknown
        tokens are their own text; unused and undefined tokens are empty."""
        self._check_id(token_id)
        piece = self._pieces[token_id]
        if piece is None:
            piece = self._make_piece(token_id)
            self._pieces[token_id] = piece
        return piece

    def _make_piece(self, token_id: int) -> bytes:
        text, kind = self._tokens[token_id], self._types[token_id]
        if kind in _SPECIAL_TYPES:
            return text.encode("utf-8")
        if kind == TOKEN_TYPE_NORMAL:
            out = bytearray()
            for ch in text:
                b = _UNICODE_TO_BYTE.get(ch)
                if b is None:
                    # Not a byte-level character (a malformed vocabulary): keep it as UTF-8 text
                    # rather than lose it.
                    out += ch.encode("utf-8")
                else:
                    out.append(b)
            return bytes(out)
        if kind == TOKEN_TYPE_BYTE:
            # Byte tokens are written "<0xAB>".
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                try:
                    return bytes([int(text[3:5], 16)])
                except ValueError:
                    pass
            return b""
        return b""

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of `ids`.  skip_special leaves out control and unknown tokens (like llama.cpp's
        special=false); byte sequences that are not valid UTF-8 become U+FFFD."""
        pieces = []
        for token_id in ids:
            if skip_special and self.is_control(token_id):
                continue
            pieces.append(self.token_to_piece(token_id))
        return b"".join(pieces).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"Tokenizer(gpt2/{self.pre}, vocab_size={self.vocab_size}, source={self.source!r})"


class StreamDecoder:
    """Incremental detokenizer: feed ids one at a time, get text only once it is complete UTF-8.

    A multi-byte character split across tokens is held back until its last byte arrives, so what
    `push` returns never contains a partial character (or a U+FFFD standing for one).  Bytes that can
    never become valid UTF-8 are replaced with U+FFFD as soon as that is certain."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if self._skip_special and self._tokenizer.is_control(token_id):
            return ""
        return self._utf8.decode(self._tokenizer.token_to_piece(token_id), final=False)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character becomes U+FFFD) and start afresh."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out

    @property
    def pending(self) -> bool:
        """True while bytes of an incomplete character are held back."""
        return bool(self._utf8.getstate()[0])
