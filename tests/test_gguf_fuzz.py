"""Fuzzing the whole load path (reader, architecture registry, per-architecture checks, tokenizer,
chat template) with mutated copies of a valid small qwen35 GGUF.

Guards against: a corrupted count or length that makes us allocate unbounded memory or loop, a
stray IndexError/struct.error/UnicodeError escaping as a traceback, and a check that silently accepts
a file a worker would then crash on. Every mutant must either load or raise one of our typed errors,
each within 2 s.
"""
from __future__ import annotations

import struct
import time

import numpy as np
import pytest

from daemons.chat_template import ChatTemplateError
from daemons.gguf_reader import GGUFError, GGUFFile
from daemons.model_info import describe, validate
from daemons.synthetic import write_synthetic_qwen35
from daemons.tokenizer import TokenizerError

N_MUTANTS = 600
TYPED = (GGUFError, TokenizerError, ChatTemplateError)


def _mutate(raw: bytes, rng: np.random.Generator, meta_end: int) -> bytes:
    b = bytearray(raw)
    kind = rng.integers(0, 5)
    # Most mutations land in the header/metadata/tensor-index region, where parsing happens;
    # flips in tensor data only change weights.
    pos = int(rng.integers(0, meta_end)) if rng.random() < 0.85 else int(rng.integers(0, len(b)))
    if kind == 0:  # bit flips
        for _ in range(int(rng.integers(1, 4))):
            p = int(rng.integers(0, meta_end))
            b[p] ^= 1 << int(rng.integers(0, 8))
    elif kind == 1:  # truncation
        return bytes(b[: int(rng.integers(0, len(b)))])
    elif kind == 2:  # rewrite a 64-bit field (counts, lengths, offsets, dims)
        choices = [0, 1, 2**32, 2**62, 2**64 - 1, int(rng.integers(0, 2**63))]
        v = choices[int(rng.integers(0, len(choices)))]
        b[pos:pos + 8] = struct.pack("<Q", v)[: len(b[pos:pos + 8])]
    elif kind == 3:  # rewrite a 32-bit field (types, versions, dim counts)
        choices = [0, 5, 9, 13, 30, 2**31, 2**32 - 1, int(rng.integers(0, 40))]
        v = choices[int(rng.integers(0, len(choices)))]
        b[pos:pos + 4] = struct.pack("<I", v)[: len(b[pos:pos + 4])]
    else:  # insert or delete a few bytes, shifting everything after
        n = int(rng.integers(1, 9))
        if rng.random() < 0.5:
            b[pos:pos] = bytes(rng.integers(0, 256, n, dtype=np.uint8))
        else:
            del b[pos:pos + n]
    return bytes(b)


def test_mutated_files_raise_only_typed_errors(tmp_path):
    src = tmp_path / "valid.gguf"
    write_synthetic_qwen35(src, "tiny")
    raw = src.read_bytes()
    with GGUFFile(src) as g:  # the valid file passes the whole path
        validate(g)
        describe(g)
        meta_end = min(t.offset for t in g.tensors.values())

    rng = np.random.default_rng(1234)
    outcomes = {"loaded": 0, "typed_error": 0}
    slowest = 0.0
    p = tmp_path / "mutant.gguf"
    for i in range(N_MUTANTS):
        p.write_bytes(_mutate(raw, rng, meta_end))
        t0 = time.perf_counter()
        try:
            with GGUFFile(p) as g:
                describe(g, with_metadata=True)
                validate(g)
            outcomes["loaded"] += 1
        except TYPED as e:
            assert "\n" not in str(e), f"mutant {i}: multi-line message {e!r}"
            outcomes["typed_error"] += 1
        except Exception as e:  # noqa: BLE001 - the point of the test
            pytest.fail(f"mutant {i}: untyped {type(e).__name__}: {e}")
        dt = time.perf_counter() - t0
        slowest = max(slowest, dt)
        assert dt < 2.0, f"mutant {i} took {dt:.2f}s"
    print(f"\nfuzz: {N_MUTANTS} mutants, {outcomes}, slowest {slowest * 1000:.0f} ms")
    assert outcomes["typed_error"] > N_MUTANTS // 3  # the mutations really do break files
