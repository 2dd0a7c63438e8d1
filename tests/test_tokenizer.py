"""The GGUF tokenizer against llama.cpp (llama-cpp-python, vocab_only) on a vocabulary built here.

Bugs these tests guard against:
* a pre-tokenizer regex that differs from llama.cpp's (contractions, digit grouping, \\p{M} in
  qwen35, whitespace/newline runs) -> different ids for the same prompt;
* Unicode tables of different versions (HF's Oniguruma knows Unicode 16, llama.cpp's tables are
  15.1) -> different splits around newly assigned characters;
* special tokens matched in the wrong order or in the wrong mode (control tokens parsed when
  parse_special is off, user-defined ones not parsed);
* wrong BOS/EOS/EOT/padding ids, wrong add_bos, a wrong end-of-generation set;
* detokenisation that loses bytes, or streams half a UTF-8 character.
"""

from __future__ import annotations

import random

import pytest

import llama_cpp

import daemons.tokenizer as tokenizer_module
from daemons.tokenizer import StreamDecoder, Tokenizer, TokenizerError
from tests.fixtures_tokenizer import (
    SPECIAL_TEXTS,
    STRING_KINDS,
    parity_strings,
    probe_metadata,
    read_metadata,
    sweep_texts,
    tokenizer_metadata,
    trained_vocab,
    with_overrides,
    write_tokenizer_gguf,
)

pytestmark = pytest.mark.llama

# qwen35 and qwen2 are what the served models use; llama-bpe (llama3 split, ignore_merges, BOS
# added), gpt-2 and default (four chained regexes) are the other supported names.
PRE_TOKENIZERS = ["qwen35", "qwen2", "llama-bpe", "gpt-2", "default"]
N_PARITY_STRINGS = 2400


def _load_llama(path: str) -> llama_cpp.Llama:
    return llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def pair_for(tmp_path_factory):
    """pre -> (our Tokenizer, llama.cpp's Llama) on the same GGUF file; built once per name."""
    cache: dict[tuple, tuple[Tokenizer, llama_cpp.Llama]] = {}

    def get(pre: str, vocab: str = "trained", **overrides) -> tuple[Tokenizer, llama_cpp.Llama]:
        key = (pre, vocab, tuple(sorted(overrides.items())))
        if key not in cache:
            path = str(tmp_path_factory.mktemp("tok") / f"{vocab}-{pre}.gguf")
            md = tokenizer_metadata(pre) if vocab == "trained" else probe_metadata(pre)
            write_tokenizer_gguf(path, with_overrides(md, **overrides))
            cache[key] = (Tokenizer.from_metadata(read_metadata(path), source=path), _load_llama(path))
        return cache[key]

    return get


def _llama_ids(llm: llama_cpp.Llama, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)


# ---------------------------------------------------------------------------------------------
# Parity on generated strings.


@pytest.mark.parametrize("pre", PRE_TOKENIZERS)
def test_encode_matches_llama_cpp(pair_for, pre, record_property):
    tok, llm = pair_for(pre)
    strings = list(parity_strings(N_PARITY_STRINGS, seed=2024))
    assert len(strings) == N_PARITY_STRINGS
    kinds = {kind for kind, _ in strings}
    assert set(STRING_KINDS) <= kinds
    mismatches = []
    n_compared = 0
    n_multi_token = 0
    for kind, text in strings:
        for parse_special in (True, False):
            ours = tok.encode(text, add_special=False, parse_special=parse_special)
            theirs = _llama_ids(llm, text, special=parse_special)
            n_compared += 1
            if ours != theirs:
                mismatches.append((kind, parse_special, text, ours, theirs))
        n_multi_token += len(ours) > 1
        # Byte-level BPE loses nothing: decoding gives the text back, special tokens included.
        assert tok.decode(tok.encode(text)) == text, (kind, text)
    record_property("parity_compared", n_compared)
    print(f"\ntokenizer parity [{pre}]: {n_compared - len(mismatches)}/{n_compared} encodings identical "
          f"to llama.cpp ({len(strings)} strings x parse_special on/off)")
    assert not mismatches, "first mismatches (kind, parse_special, text, ours, llama.cpp): " + repr(mismatches[:3])
    # The strings must exercise merges, not only single bytes.
    assert n_multi_token > len(strings) // 2


def test_special_tokens_are_parsed_only_when_asked(pair_for):
    tok, llm = pair_for("qwen35")
    im_start = tok.token_id("<|im_start|>")
    think = tok.token_id("<think>")
    text = "<|im_start|>user\n<think>x</think><|im_end|>"
    with_special = tok.encode(text, add_special=False, parse_special=True)
    without = tok.encode(text, add_special=False, parse_special=False)
    assert with_special[0] == im_start and think in with_special
    # Control tokens are plain text without parse_special; user-defined ones are still parsed.
    assert im_start not in without and think in without
    assert without == _llama_ids(llm, text, special=False)


def test_add_special_adds_bos_like_llama_cpp(pair_for):
    # Without tokenizer.ggml.add_bos_token, llama-bpe adds BOS and qwen35 does not.
    tok, llm = pair_for("llama-bpe", add_bos_token=None)
    assert tok.add_bos and tok.bos_id is not None
    for text in ["hello world", "", "<|im_start|>x"]:
        ours = tok.encode(text, add_special=True)
        assert ours == _llama_ids(llm, text, add_bos=True), text
        assert ours[0] == tok.bos_id
    tok35, llm35 = pair_for("qwen35")
    assert not tok35.add_bos  # qwen35 files set add_bos_token = false
    assert tok35.encode("hello", add_special=True) == _llama_ids(llm35, "hello", add_bos=True)


# ---------------------------------------------------------------------------------------------
# Every code point, in contexts where its Unicode category decides the split.


@pytest.mark.parametrize("pre", ["qwen2", "qwen35", "default"])
def test_every_code_point_splits_like_llama_cpp(pair_for, pre):
    # qwen2 shows letters, numbers and whitespace; qwen35 letters+marks; default punctuation.
    tok, llm = pair_for(pre, "probe")
    contexts = {"qwen2": ("aX", "Xa", "X!"), "qwen35": ("aX",), "default": ("X!",)}[pre]
    bad = []
    for first, last in [(0x0, 0x3FFFF), (0xE0000, 0xE0FFF)]:
        for start, text in sweep_texts(first, last, contexts):
            if tok.encode(text, add_special=False) != _llama_ids(llm, text):
                bad.append(start)
    assert not bad, "chunks starting at these code points split differently: " + ", ".join(
        f"U+{c:04X}" for c in bad[:10]
    )


def test_code_point_sweep_detects_unicode_version_skew(pair_for, monkeypatch):
    # Without pinning the categories to llama.cpp's Unicode 15.1 tables, a Unicode 16 letter
    # (U+1C89) splits differently; this shows the sweep above can see such a difference.
    tok, llm = pair_for("qwen2", "probe")
    _, text = next(sweep_texts(0x1C80, 0x1C8F, ("aX",)))
    assert tok.encode(text, add_special=False) == _llama_ids(llm, text)
    monkeypatch.setattr(tokenizer_module, "_pin_unicode_categories", lambda pattern: pattern)
    unpinned = Tokenizer.from_metadata(probe_metadata("qwen2"))
    assert unpinned.encode(text, add_special=False) != _llama_ids(llm, text)


# ---------------------------------------------------------------------------------------------
# Ids and token attributes.


def _llama_vocab(llm: llama_cpp.Llama):
    return llm._model.vocab


@pytest.mark.parametrize("pre", ["qwen35", "llama-bpe"])
def test_special_ids_match_llama_cpp(pair_for, pre):
    tok, llm = pair_for(pre)
    vocab = _llama_vocab(llm)
    n = llama_cpp.llama_vocab_n_tokens(vocab)
    assert tok.vocab_size == n
    assert tok.bos_id == llama_cpp.llama_vocab_bos(vocab) == tok.token_id("<|endoftext|>")
    assert tok.eos_id == llama_cpp.llama_vocab_eos(vocab) == tok.token_id("<|im_end|>")
    # No eot key in the file: both find <|im_end|> by its text.
    assert tok.eot_id == llama_cpp.llama_vocab_eot(vocab) == tok.token_id("<|im_end|>")
    assert tok.pad_id == llama_cpp.llama_vocab_pad(vocab)
    assert tok.add_bos == bool(llama_cpp.llama_vocab_get_add_bos(vocab))
    eog = {i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert tok.stop_ids == eog
    # <|endoftext|>, <|im_end|>, and the FIM pad and file-separator tokens end generation.
    assert {tok.token_id(t) for t in ("<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|file_sep|>")} == eog
    control = {i for i in range(n) if llama_cpp.llama_vocab_get_attr(vocab, i) & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL}
    user = {i for i in range(n) if llama_cpp.llama_vocab_get_attr(vocab, i) & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED}
    assert control == {i for i in range(n) if tok.is_control(i)}
    assert control | user == {i for i in range(n) if tok.is_special(i)}
    # token_to_piece, for every id, special tokens rendered.
    import ctypes

    buf = ctypes.create_string_buffer(512)
    for i in range(n):
        size = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, True)
        assert tok.token_to_piece(i) == buf.raw[:size], i


def test_explicit_eot_and_forced_control(tmp_path):
    # An explicit eot id wins over text detection; an end-of-generation token written as
    # user-defined becomes control (llama.cpp overrides it), so parse_special=False leaves it as text.
    tokens, _, _ = trained_vocab()
    types = list(trained_vocab()[1])
    types[tokens.index("<|im_end|>")] = 4
    md = tokenizer_metadata("qwen2", eot_token_id=tokens.index("<|im_start|>"), token_type=types)
    path = str(tmp_path / "forced.gguf")
    write_tokenizer_gguf(path, md)
    tok = Tokenizer.from_metadata(read_metadata(path), source=path)
    llm = _load_llama(path)
    vocab = _llama_vocab(llm)
    assert tok.eot_id == llama_cpp.llama_vocab_eot(vocab) == tokens.index("<|im_start|>")
    assert tok.is_control(tokens.index("<|im_end|>"))
    n = tok.vocab_size
    assert tok.stop_ids == {i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    text = "a<|im_end|>b<think>"
    for special in (True, False):
        assert tok.encode(text, add_special=False, parse_special=special) == _llama_ids(llm, text, special=special)


def test_decode_skip_special_drops_control_tokens_only():
    tok = Tokenizer.from_metadata(tokenizer_metadata("qwen35"))
    ids = tok.encode("<|im_start|>assistant\n<think>ok</think>done<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>assistant\n<think>ok</think>done<|im_end|>"
    assert tok.decode(ids, skip_special=True) == "assistant\n<think>ok</think>done"


# ---------------------------------------------------------------------------------------------
# Streaming detokenisation.


def _texts_with_split_characters(tok: Tokenizer) -> list[str]:
    rng = random.Random(7)
    rare = [chr(c) for c in (0x9F98, 0x9F8D, 0x4DB5, 0x20000, 0x2A6D6, 0x1F9A9, 0x1FAE0, 0x10348, 0xA98B)]
    texts = []
    for _ in range(200):
        parts = [rng.choice(rare + ["日本語", "é", "😀👍🏽", " ", "ok", "\n", "👨‍👩‍👧", "<|im_end|>"])
                 for _ in range(rng.randint(1, 12))]
        texts.append("".join(parts))
    return texts


def test_stream_decoder_never_emits_partial_characters():
    tok = Tokenizer.from_metadata(tokenizer_metadata("qwen35"))
    n_held = 0
    for text in _texts_with_split_characters(tok):
        ids = tok.encode(text)
        decoder = StreamDecoder(tok)
        chunks = []
        for token_id in ids:
            chunk = decoder.push(token_id)
            assert "\ufffd" not in chunk, (text, ids)
            n_held += decoder.pending
            chunks.append(chunk)
        chunks.append(decoder.flush())
        assert "".join(chunks) == tok.decode(ids) == text
    # The texts must really split characters across tokens, or the test proves nothing.
    assert n_held > 100


def test_stream_decoder_flush_and_invalid_bytes():
    tok = Tokenizer.from_metadata(tokenizer_metadata("qwen35"))
    byte_id = {b: tok.token_id(tokenizer_module._BYTE_TO_UNICODE[b]) for b in range(256)}
    decoder = StreamDecoder(tok)
    # "€" is E2 82 AC: nothing comes out until the last byte.
    assert decoder.push(byte_id[0xE2]) == "" and decoder.pending
    assert decoder.push(byte_id[0x82]) == ""
    assert decoder.push(byte_id[0xAC]) == "€" and not decoder.pending
    # A cut-off character is only replaced at flush.
    assert decoder.push(byte_id[0xF0]) == ""
    assert decoder.flush() == "\ufffd"
    # A byte that can never start a character is replaced at once.
    assert decoder.push(byte_id[0xFF]) == "\ufffd"
    assert decoder.push(byte_id[ord("a")]) == "a"
    skipping = StreamDecoder(tok, skip_special=True)
    assert skipping.push(tok.token_id("<|im_end|>")) == ""
    assert skipping.push(tok.token_id("<think>")) == "<think>"


# ---------------------------------------------------------------------------------------------
# Bad metadata and bad input.


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"model": None}, "tokenizer.ggml.model"),
        ({"model": "llama"}, "'llama'"),
        ({"pre": "made-up"}, "'made-up'"),
        ({"tokens": None}, "tokenizer.ggml.tokens"),
        ({"tokens": "abc"}, "array of strings"),
        ({"tokens": [1, 2]}, "must be a string"),
        ({"tokens": []}, "empty"),
        ({"merges": None}, "tokenizer.ggml.merges"),
        ({"merges": ["nospace"]}, "merges[0]"),
        ({"merges": ["Ġ zzzz"]}, "not in the vocabulary"),
        ({"token_type": [1, 1]}, "token_type"),
        ({"bos_token_id": 10**6}, "bos_token_id"),
        ({"eos_token_id": "x"}, "eos_token_id"),
        ({"add_bos_token": "yes"}, "add_bos_token"),
        ({"add_bos_token": True, "bos_token_id": None}, "BOS"),
    ],
)
def test_bad_metadata_raises_tokenizer_error(overrides, words):
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_metadata(tokenizer_metadata("qwen35", **overrides), source="m.gguf")
    message = str(info.value)
    assert words in message and message.startswith("m.gguf: ") and "\n" not in message


def test_bad_input_raises_tokenizer_error():
    tok = Tokenizer.from_metadata(tokenizer_metadata("qwen35"))
    with pytest.raises(TokenizerError, match="surrogate"):
        tok.encode("a\ud800b")
    with pytest.raises(TokenizerError, match="str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.token_to_piece(-1)
    assert not tok.is_special(0)
    # Like llama.cpp, a file without tokenizer.ggml.pre gets the `default` pre-tokenizer.
    assert Tokenizer.from_metadata(tokenizer_metadata("qwen35", pre=None)).pre == "default"
    assert all(tok.is_special(tok.token_id(t)) for t in SPECIAL_TEXTS)


def test_missing_byte_token_is_refused_not_dropped():
    # HF's BPE would silently drop a byte it has no token for; llama.cpp cannot encode it either.
    tokens, types, merges = trained_vocab()
    missing = tokenizer_module._BYTE_TO_UNICODE[0xBF]
    keep = [i for i, t in enumerate(tokens) if missing not in t]
    md = tokenizer_metadata(
        "qwen35",
        tokens=[tokens[i] for i in keep],
        token_type=[types[i] for i in keep],
        merges=[m for m in merges if missing not in m],
        bos_token_id=None, eos_token_id=None, padding_token_id=None,
    )
    tok = Tokenizer.from_metadata(md)
    assert tok.decode(tok.encode("fine")) == "fine"
    with pytest.raises(TokenizerError, match="0xBF"):
        tok.encode("ÿ")  # UTF-8 C3 BF


def test_longest_special_token_wins_like_llama_cpp(tmp_path):
    # llama.cpp cuts out the longest special token everywhere before looking for shorter ones, so
    # in "<x><y>" the user-defined "x><y>" wins over the control "<x>" that starts earlier.
    tokens, types, merges = trained_vocab()
    md = tokenizer_metadata(
        "qwen35", tokens=list(tokens) + ["<x>", "x><y>"], token_type=list(types) + [3, 4], merges=list(merges)
    )
    path = str(tmp_path / "overlap.gguf")
    write_tokenizer_gguf(path, md)
    tok = Tokenizer.from_metadata(read_metadata(path), source=path)
    llm = _load_llama(path)
    long_id = tok.token_id("x><y>")
    assert tok.encode("<x><y>", add_special=False)[-1] == long_id
    for text in ["<x><y>", "<x><x><y>", "<x>x><y><x>", "x><y<x>", "<x><y><|im_end|><x><y>x><y>"]:
        for special in (True, False):
            assert tok.encode(text, add_special=False, parse_special=special) == _llama_ids(
                llm, text, special=special
            ), (text, special)
