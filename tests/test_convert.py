"""The HF -> GGUF converter (daemons/convert.py) and the qwen35 file check (daemons/qwen35.check_file).

Expectations here are written from llama.cpp's converter independently of our implementation
(explicit index loops for the V-head order, names and types listed out), so a wrong transform
cannot pass by agreeing with itself.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from daemons.convert import (ConvertError, _storage_type, convert_hf_to_gguf, read_safetensors,
                             v_heads_grouped_to_tiled, v_heads_tiled_to_grouped)
from daemons.gguf_reader import GGUFFile, GGUFMetadataError, GGUFTensorError
from daemons.qwen35 import Qwen35HParams, check_file
from tests import gguf_bytes as gb
from tests.qwen35_fixtures import CONFIGS, SPECIAL_TOKENS, build_tiny_qwen35, session_root

F32, F16, Q8_0 = 0, 1, 8


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    hf_dir, gguf_path, _ = build_tiny_qwen35(session_root(tmp_path_factory), "gqa_untied", outtype="f32")
    hf = {name: st.load(key) for name, (st, key) in read_safetensors(hf_dir).items()}
    return hf_dir, gguf_path, hf


def tiled_index(n_k: int, n_v: int) -> list[int]:
    """gguf v-head j holds HF v-head perm[j]: HF head k·r + i (k-head k) is stored at i·n_k + k."""
    r = n_v // n_k
    perm = [0] * n_v
    for k in range(n_k):
        for i in range(r):
            perm[i * n_k + k] = k * r + i
    return perm


def test_names_types_and_keys(built):
    hf_dir, gguf_path, _ = built
    cfg = CONFIGS["gqa_untied"]
    f = GGUFFile(gguf_path)
    names = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for il in range(8):
        p = f"blk.{il}."
        names |= {p + n for n in ("attn_norm.weight", "post_attention_norm.weight", "ffn_gate.weight",
                                  "ffn_up.weight", "ffn_down.weight")}
        if il in (3, 7):
            names |= {p + n for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                                      "attn_q_norm.weight", "attn_k_norm.weight")}
        else:
            names |= {p + n for n in ("attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_a",
                                      "ssm_dt.bias", "ssm_alpha.weight", "ssm_beta.weight", "ssm_norm.weight",
                                      "ssm_out.weight")}
    assert set(f.tensors) == names
    assert all(t.qtype == F32 for t in f)
    # ggml shapes (ne = numpy shape reversed)
    assert f.tensor("blk.3.attn_q.weight").ne == (64, 2 * 4 * 32)
    assert f.tensor("blk.0.attn_qkv.weight").ne == (64, 2 * 2 * 16 + 4 * 16)
    assert f.tensor("blk.0.ssm_conv1d.weight").ne == (4, 128)
    assert f.tensor("blk.0.ssm_alpha.weight").ne == (64, 4)
    assert f.tensor("blk.0.ssm_out.weight").ne == (64, 64)

    t = f.metadata_types
    md = f.metadata
    expect = {
        "general.architecture": ("string", "qwen35"), "general.file_type": ("u32", 0),
        "general.quantization_version": ("u32", 2),
        "qwen35.block_count": ("u32", 8), "qwen35.context_length": ("u32", 4096),
        "qwen35.embedding_length": ("u32", 64), "qwen35.feed_forward_length": ("u32", 128),
        "qwen35.attention.head_count": ("u32", 4), "qwen35.attention.head_count_kv": ("u32", 2),
        "qwen35.attention.key_length": ("u32", 32), "qwen35.attention.value_length": ("u32", 32),
        "qwen35.rope.dimension_count": ("u32", 8), "qwen35.rope.dimension_sections": ("array[i32]", [2, 1, 1, 0]),
        "qwen35.full_attention_interval": ("u32", 4), "qwen35.ssm.conv_kernel": ("u32", 4),
        "qwen35.ssm.state_size": ("u32", 16), "qwen35.ssm.group_count": ("u32", 2),
        "qwen35.ssm.time_step_rank": ("u32", 4), "qwen35.ssm.inner_size": ("u32", 64),
        "qwen35.attention.recurrent_layers": ("array[bool]", [True, True, True, False] * 2),
        "tokenizer.ggml.model": ("string", "gpt2"), "tokenizer.ggml.pre": ("string", "qwen35"),
        "tokenizer.ggml.add_bos_token": ("bool", False),
    }
    for key, (typ, value) in expect.items():
        assert (t[key], md[key]) == (typ, value), key
    assert t["qwen35.rope.freq_base"] == "f32" and md["qwen35.rope.freq_base"] == pytest.approx(cfg["rope_parameters"]["rope_theta"])
    assert t["qwen35.attention.layer_norm_rms_epsilon"] == "f32"
    assert md["qwen35.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)

    # tokenizer: ids follow tokenizer.json; padding rows are UNUSED; Qwen special ids as llama.cpp writes them
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    assert t["tokenizer.ggml.token_type"] == "array[i32]" and len(tokens) == len(types) == 1024
    for text, i in list(tok["model"]["vocab"].items())[:50]:
        assert tokens[i] == text and types[i] == 1
    ids = {a["content"]: a["id"] for a in tok["added_tokens"]}
    for s in SPECIAL_TOKENS:
        assert tokens[ids[s]] == s and types[ids[s]] == 3
    pad_rows = [i for i in range(1024) if i > max(ids.values())]
    assert pad_rows and all(tokens[i] == f"[PAD{i}]" and types[i] == 5 for i in pad_rows)
    assert md["tokenizer.ggml.eos_token_id"] == ids["<|im_end|>"]
    assert md["tokenizer.ggml.eot_token_id"] == ids["<|im_end|>"]
    assert md["tokenizer.ggml.padding_token_id"] == ids["<|endoftext|>"]
    assert md["tokenizer.ggml.bos_token_id"] == ids["<|endoftext|>"]
    assert len(md["tokenizer.ggml.merges"]) == len(tok["model"]["merges"])
    assert "<|im_start|>" in md["tokenizer.chat_template"]


def test_norms_ssm_a_and_head_reorder(built):
    _, gguf_path, hf = built
    f = GGUFFile(gguf_path)
    g = {name: f.tensor(name).dequantize() for name in f.tensors}
    L = "model.layers."
    # zero-centred norms are stored as 1 + w; the DeltaNet output norm is not shifted
    np.testing.assert_array_equal(g["output_norm.weight"], hf["model.norm.weight"] + 1)
    np.testing.assert_array_equal(g["blk.0.attn_norm.weight"], hf[L + "0.input_layernorm.weight"] + 1)
    np.testing.assert_array_equal(g["blk.3.post_attention_norm.weight"], hf[L + "3.post_attention_layernorm.weight"] + 1)
    np.testing.assert_array_equal(g["blk.3.attn_q_norm.weight"], hf[L + "3.self_attn.q_norm.weight"] + 1)
    np.testing.assert_array_equal(g["blk.7.attn_k_norm.weight"], hf[L + "7.self_attn.k_norm.weight"] + 1)
    np.testing.assert_array_equal(g["blk.1.ssm_norm.weight"], hf[L + "1.linear_attn.norm.weight"])
    # attention weights are copied unchanged (Q and gate are already packed per head)
    np.testing.assert_array_equal(g["blk.3.attn_q.weight"], hf[L + "3.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(g["output.weight"], hf["lm_head.weight"])

    n_k, n_v, dk, dv = 2, 4, 16, 16
    perm = tiled_index(n_k, n_v)
    assert perm == [0, 2, 1, 3]
    rows = np.concatenate([np.arange(h * dv, (h + 1) * dv) for h in perm])
    for il in (0, 5):
        p, hp = f"blk.{il}.", f"{L}{il}.linear_attn."
        a_log = hf[hp + "A_log"]
        np.testing.assert_allclose(g[p + "ssm_a"], -np.exp(a_log[perm]), rtol=1e-6)
        assert (g[p + "ssm_a"] < 0).all()
        np.testing.assert_array_equal(g[p + "ssm_dt.bias"], hf[hp + "dt_bias"][perm])
        np.testing.assert_array_equal(g[p + "ssm_alpha.weight"], hf[hp + "in_proj_a.weight"][perm])
        np.testing.assert_array_equal(g[p + "ssm_beta.weight"], hf[hp + "in_proj_b.weight"][perm])
        np.testing.assert_array_equal(g[p + "attn_gate.weight"], hf[hp + "in_proj_z.weight"][rows])
        qkv = hf[hp + "in_proj_qkv.weight"]
        qk = 2 * n_k * dk
        np.testing.assert_array_equal(g[p + "attn_qkv.weight"][:qk], qkv[:qk])
        np.testing.assert_array_equal(g[p + "attn_qkv.weight"][qk:], qkv[qk:][rows])
        conv = hf[hp + "conv1d.weight"][:, 0, :]
        np.testing.assert_array_equal(g[p + "ssm_conv1d.weight"][:qk], conv[:qk])
        np.testing.assert_array_equal(g[p + "ssm_conv1d.weight"][qk:], conv[qk:][rows])
        np.testing.assert_array_equal(g[p + "ssm_out.weight"], hf[hp + "out_proj.weight"][:, rows])


def test_v_head_reorder_round_trip():
    rng = np.random.default_rng(0)
    for n_k, n_v, hd in [(2, 4, 3), (16, 48, 1), (3, 3, 2), (1, 5, 4)]:
        x = rng.standard_normal((n_v * hd, 7))
        t = v_heads_grouped_to_tiled(x, 0, n_k, n_v, hd)
        perm = tiled_index(n_k, n_v)
        np.testing.assert_array_equal(t.reshape(n_v, hd, 7), x.reshape(n_v, hd, 7)[perm])
        np.testing.assert_array_equal(v_heads_tiled_to_grouped(t, 0, n_k, n_v, hd), x)
        y = rng.standard_normal((5, n_v * hd))
        np.testing.assert_array_equal(v_heads_tiled_to_grouped(v_heads_grouped_to_tiled(y, 1, n_k, n_v, hd),
                                                               1, n_k, n_v, hd), y)
    # the 27B layout (math spec §1): HF head k·3 + r is stored at r·16 + k
    t = v_heads_grouped_to_tiled(np.arange(48), 0, 16, 48, 1)
    assert all(t[r * 16 + k] == k * 3 + r for k in range(16) for r in range(3))


def test_storage_types(built, tmp_path):
    hf_dir, _, _ = built
    out = tmp_path / "q8.gguf"
    convert_hf_to_gguf(hf_dir, out, outtype="q8_0")
    f = GGUFFile(out)
    assert f.get_int("general.file_type") == 7
    for t in f:
        small = len(t.ne) == 1 or t.name.endswith("_norm.weight") or "ssm_conv1d" in t.name
        assert t.qtype == (F32 if small else Q8_0), t.name
    assert check_file(f).n_layer == 8
    # gguf-py cannot quantise a row that is not a multiple of 32 to Q8_0: llama.cpp falls back to F16
    assert _storage_type("blk.0.attn_output.weight", np.zeros((64, 48), np.float32), Q8_0) == F16
    assert _storage_type("blk.0.ssm_a", np.zeros(4, np.float32), Q8_0) == F32


def test_conditional_generation_checkpoint_converts_the_same(built, tmp_path):
    """A Qwen3_5ForConditionalGeneration checkpoint (text under text_config, tensors under
    model.language_model., plus vision and MTP tensors) gives the same file as the text model."""
    from safetensors.numpy import save_file

    hf_dir, gguf_path, hf = built
    d = tmp_path / "vl"
    d.mkdir()
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / fn, d / fn)
    text_cfg = json.loads((hf_dir / "config.json").read_text())
    text_cfg.pop("architectures")
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "text_config": text_cfg, "vision_config": {"depth": 1}}
    (d / "config.json").write_text(json.dumps(cfg))
    renamed = {("lm_head.weight" if k == "lm_head.weight" else "model.language_model." + k[len("model."):]): v
               for k, v in hf.items()}
    renamed["model.visual.patch_embed.proj.weight"] = np.zeros((4, 4), np.float32)
    renamed["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    save_file(renamed, str(d / "model.safetensors"))
    convert_hf_to_gguf(d, tmp_path / "vl.gguf", outtype="f32", name=Path(hf_dir).name)
    a, b = GGUFFile(gguf_path), GGUFFile(tmp_path / "vl.gguf")
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        np.testing.assert_array_equal(a.tensor(name).raw, b.tensor(name).raw)


def _broken_copy(hf_dir: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in hf_dir.iterdir():
        shutil.copy(p, dst / p.name)
    return dst


def test_converter_errors(built, tmp_path):
    """Bad input raises ConvertError with a one-line message naming the problem."""
    from safetensors.numpy import save_file

    hf_dir, _, hf = built

    def expect(match, src, **kw):
        with pytest.raises(ConvertError, match=match) as e:
            convert_hf_to_gguf(src, tmp_path / "x.gguf", **kw)
        assert "\n" not in str(e.value)

    expect("not a directory", tmp_path / "nope")
    expect("outtype", hf_dir, outtype="q4_k")

    d = _broken_copy(hf_dir, tmp_path / "llama")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    expect("LlamaForCausalLM.*not supported", d)

    d = _broken_copy(hf_dir, tmp_path / "noconfig")
    (d / "config.json").unlink()
    expect("config.json", d)

    d = _broken_copy(hf_dir, tmp_path / "notok")
    (d / "tokenizer.json").unlink()
    expect("tokenizer.json", d)

    d = _broken_copy(hf_dir, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    expect("no \\*.safetensors", d)

    d = _broken_copy(hf_dir, tmp_path / "missing")
    save_file({k: v for k, v in hf.items() if k != "model.layers.2.linear_attn.A_log"}, str(d / "model.safetensors"))
    expect("blk.2.ssm_a", d)

    d = _broken_copy(hf_dir, tmp_path / "badshape")
    save_file({**hf, "model.layers.3.self_attn.k_proj.weight": np.zeros((32, 64), np.float32)},
              str(d / "model.safetensors"))
    expect("k_proj.*shape", d)

    d = _broken_copy(hf_dir, tmp_path / "truncated")
    (d / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes()[:1000])
    expect("safetensors|outside the file", d)


def _rewrite(src: Path, dst: Path, *, drop=(), tensors=None, metadata=None) -> Path:
    """Copy a GGUF byte for byte through tests/gguf_bytes, dropping or replacing tensors/keys."""
    f = GGUFFile(src)
    kvs = []
    for key in f.metadata:
        e = f.metadata_entry(key)
        value = (metadata or {}).get(key, e.value)
        kvs.append((key, e.vtype, value) + ((e.item_type,) if e.item_type is not None else ()))
    out = []
    for t in f:
        if t.name in drop:
            continue
        if tensors and t.name in tensors:
            ne, qtype, data = tensors[t.name]
            out.append((t.name, ne, qtype, data))
        else:
            out.append((t.name, t.ne, t.qtype, t.raw.tobytes()))
    dst.write_bytes(gb.build_gguf(kvs, out))
    return dst


def test_check_file_rejects_bad_files(built, tmp_path):
    _, gguf_path, _ = built
    assert check_file(GGUFFile(_rewrite(gguf_path, tmp_path / "same.gguf"))).n_layer == 8

    bad = _rewrite(gguf_path, tmp_path / "missing.gguf", drop={"blk.3.attn_k_norm.weight"})
    with pytest.raises(GGUFTensorError, match="blk.3.attn_k_norm.weight"):
        check_file(GGUFFile(bad))

    bad = _rewrite(gguf_path, tmp_path / "shape.gguf",
                   tensors={"blk.0.ssm_norm.weight": ((8,), F32, np.ones(8, np.float32).tobytes())})
    with pytest.raises(GGUFTensorError, match="blk.0.ssm_norm.weight.*shape"):
        check_file(GGUFFile(bad))

    bad = _rewrite(gguf_path, tmp_path / "heads.gguf", metadata={"qwen35.attention.head_count": 3})
    with pytest.raises(GGUFMetadataError, match="head_count"):
        check_file(GGUFFile(bad))

    bad = _rewrite(gguf_path, tmp_path / "vheads.gguf", metadata={"qwen35.ssm.time_step_rank": 3})
    with pytest.raises(GGUFMetadataError, match="time_step_rank"):
        Qwen35HParams.from_gguf(GGUFFile(bad))

    bad = _rewrite(gguf_path, tmp_path / "arch.gguf", metadata={"general.architecture": "llama"})
    with pytest.raises(GGUFMetadataError, match="architecture"):
        check_file(GGUFFile(bad))

    # the tied layout (no output.weight) is valid: the model falls back to token_embd
    tied = _rewrite(gguf_path, tmp_path / "tied.gguf", drop={"output.weight"})
    assert check_file(GGUFFile(tied)).n_vocab == 1024
