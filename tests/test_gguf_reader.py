"""The GGUF reader: values and types read back exactly, tensors stay mapped in their stored form,
and every kind of broken file raises its own typed one-line error (never a stray exception)."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from daemons import architectures
from daemons.gguf_reader import (GGUFError, GGUFFile, GGUFFormatError, GGUFMetadataError,
                                 GGUFTensorError, UnknownArchitectureError)
from daemons.gguf_writer import TensorData, Typed, write_gguf
from tests import gguf_bytes as gb

F32, F16, Q8_0 = 0, 1, 8


def _small(tmp_path, name="m.gguf", **kw):
    data = np.arange(8, dtype=np.float32).tobytes()
    raw = gb.build_gguf(
        [("general.architecture", gb.STRING, "qwen35"),
         ("qwen35.block_count", gb.U32, 2),
         ("test.f", gb.F32, 0.5),
         ("test.arr", gb.ARRAY, [1, -2, 3], gb.I32),
         ("test.strs", gb.ARRAY, ["a", "ß", "漢"], gb.STRING)],
        [("w", (4, 2), F32, data), ("v", (8,), F32, data)], **kw)
    p = tmp_path / name
    p.write_bytes(raw)
    return p, raw


def test_reads_values_types_and_tensors(tmp_path):
    p, _ = _small(tmp_path)
    with GGUFFile(p) as g:
        assert g.architecture == "qwen35"
        assert g.get_int("qwen35.block_count") == 2
        assert g.get_float("test.f") == 0.5
        assert g.get_array("test.arr") == [1, -2, 3]
        assert g.metadata["test.strs"] == ["a", "ß", "漢"]
        assert g.metadata_types["test.arr"] == "array[i32]"
        w = g.tensor("w")
        assert w.ne == (4, 2) and w.shape == (2, 4) and w.raw.shape == (2, 16)
        np.testing.assert_array_equal(w.raw.view(np.float32).reshape(2, 4), np.arange(8).reshape(2, 4))
        # a view into the file map, not a copy, and read-only
        assert not w.raw.flags.owndata and not w.raw.flags.writeable


def test_round_trip_through_our_writer(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 64)).astype(np.float32)
    p = tmp_path / "rt.gguf"
    write_gguf(p, "qwen35", {"qwen35.block_count": 4, "qwen35.rope.freq_base": 1e7,
                             "qwen35.rope.dimension_sections": [11, 11, 10, 0],
                             "tokenizer.ggml.add_bos_token": False,
                             "x.u64": Typed(2**40, gb_type_u64()), "tokenizer.ggml.tokens": ["a", "b"]},
               [TensorData("a32", a, QT.F32), TensorData("a16", a, QT.F16)])
    with GGUFFile(p) as g:
        assert g.metadata_types["qwen35.block_count"] == "u32"
        assert g.metadata_types["qwen35.rope.dimension_sections"] == "array[i32]"
        assert g.metadata_types["tokenizer.ggml.add_bos_token"] == "bool"
        assert g.get("x.u64") == 2**40
        assert g.get_float("qwen35.rope.freq_base") == pytest.approx(1e7)
        np.testing.assert_array_equal(g.tensor("a32").dequantize(), a)
        np.testing.assert_array_equal(g.tensor("a16").dequantize(), a.astype(np.float16).astype(np.float32))
        assert g.tensor("a16").type_name == "F16"
        np.testing.assert_array_equal(g.tensor("a32").dequantize_rows(1, 3), a[1:3])


def gb_type_u64():
    from gguf import GGUFValueType
    return GGUFValueType.UINT64


@pytest.mark.parametrize("mutate, error, words", [
    (lambda raw: b"GGUX" + raw[4:], GGUFFormatError, "not a GGUF file"),
    (lambda raw: raw[:4] + struct.pack("<I", 1) + raw[8:], GGUFFormatError, "unsupported GGUF version 1"),
    (lambda raw: raw[:4] + struct.pack("<I", 99) + raw[8:], GGUFFormatError, "unsupported GGUF version 99"),
    (lambda raw: raw[:8] + struct.pack("<Q", 2**60) + raw[16:], GGUFFormatError, "tensor count"),
    (lambda raw: raw[:16] + struct.pack("<Q", 2**60) + raw[24:], GGUFFormatError, "metadata count"),
    (lambda raw: raw[:-8], GGUFTensorError, "past the end"),
    (lambda raw: raw[:20], GGUFFormatError, "truncated"),
])
def test_broken_headers_raise_typed_errors(tmp_path, mutate, error, words):
    p, raw = _small(tmp_path)
    p.write_bytes(mutate(raw))
    with pytest.raises(error) as ei:
        GGUFFile(p)
    msg = str(ei.value)
    assert words in msg and str(p) in msg and "\n" not in msg


def test_every_truncation_is_a_typed_error(tmp_path):
    p, raw = _small(tmp_path)
    for n in range(0, len(raw) - 1):
        p.write_bytes(raw[:n])
        with pytest.raises(GGUFError):
            GGUFFile(p)


def test_duplicate_key_and_tensor(tmp_path):
    p = tmp_path / "dup.gguf"
    p.write_bytes(gb.build_gguf([("general.architecture", gb.STRING, "qwen35"),
                                 ("general.architecture", gb.STRING, "qwen35")]))
    with pytest.raises(GGUFMetadataError, match="duplicate metadata key 'general.architecture'"):
        GGUFFile(p)
    d = b"\0" * 16
    p.write_bytes(gb.build_gguf([("general.architecture", gb.STRING, "qwen35")],
                                [("t", (4,), F32, d), ("t", (4,), F32, d)]))
    with pytest.raises(GGUFTensorError, match="duplicate tensor 't'"):
        GGUFFile(p)


def test_bad_tensor_records(tmp_path):
    d = b"\0" * 16
    cases = [
        (dict(tensors=[("t", (4,), 12345, d)]), "unknown ggml type 12345"),
        (dict(tensors=[("t", (5,), Q8_0, d)]), "not a multiple"),
        (dict(tensors=[("t", (4,), F32, d)], offsets=[8]), "not aligned"),
        (dict(tensors=[("t", (4,), F32, d)], offsets=[2**20]), "past the end"),
        (dict(tensors=[("t", (0, 4), F32, d)]), "invalid shape"),
    ]
    p = tmp_path / "t.gguf"
    for kw, words in cases:
        tensors = kw.pop("tensors")
        p.write_bytes(gb.build_gguf([("general.architecture", gb.STRING, "qwen35")], tensors, **kw))
        with pytest.raises(GGUFTensorError, match=words):
            GGUFFile(p)


def test_bad_metadata_values(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(gb.build_gguf([("general.architecture", gb.STRING, "qwen35"),
                                 ("bad.type", 77, b"\0\0\0\0")]))
    with pytest.raises(GGUFFormatError, match="unknown value type 77"):
        GGUFFile(p)
    p.write_bytes(gb.build_gguf([("general.architecture", gb.STRING, b"\xff\xfe")]))
    with pytest.raises(GGUFFormatError, match="not valid UTF-8"):
        GGUFFile(p)
    p.write_bytes(gb.build_gguf([("general.architecture", gb.STRING, "qwen35"),
                                 ("general.alignment", gb.U32, 24)]))
    with pytest.raises(GGUFMetadataError, match="power-of-two"):
        GGUFFile(p)


def test_typed_getters_and_required(tmp_path):
    p, _ = _small(tmp_path)
    with GGUFFile(p) as g:
        with pytest.raises(GGUFMetadataError, match="missing required metadata key 'qwen35.nope'"):
            g.get_int("qwen35.nope")
        with pytest.raises(GGUFMetadataError, match="expected an integer"):
            g.get_int("test.f")
        with pytest.raises(GGUFMetadataError, match="expected string"):
            g.get_str("qwen35.block_count")
        with pytest.raises(GGUFMetadataError, match="expected 2"):
            g.get_array("test.arr", length=2)
        with pytest.raises(GGUFTensorError, match="missing tensor 'nope'"):
            g.tensor("nope")
        with pytest.raises(GGUFTensorError, match=r"has shape \[4, 2\], expected \[2, 4\]"):
            g.expect_tensor("w", (2, 4))
        with pytest.raises(GGUFTensorError, match="is F32, expected one of Q8_0"):
            g.expect_tensor("w", (4, 2), types=(Q8_0,))


def test_unknown_and_unserved_architectures(tmp_path):
    p = tmp_path / "a.gguf"
    p.write_bytes(gb.build_gguf([("general.architecture", gb.STRING, "gpt-j")]))
    with GGUFFile(p) as g, pytest.raises(UnknownArchitectureError, match="unknown architecture 'gpt-j'"):
        architectures.lookup(g)
    p.write_bytes(gb.build_gguf([("general.architecture", gb.STRING, "laguna")]))
    with GGUFFile(p) as g, pytest.raises(architectures.ArchitectureNotServedError, match="no dflashd worker"):
        architectures.worker_module(g)
    p.write_bytes(gb.build_gguf([]))
    with GGUFFile(p) as g, pytest.raises(GGUFMetadataError, match="general.architecture"):
        architectures.lookup(g)


def test_missing_file_is_typed(tmp_path):
    with pytest.raises(GGUFFormatError, match="cannot open"):
        GGUFFile(tmp_path / "absent.gguf")
