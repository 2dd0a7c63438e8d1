"""Tests for daemons/dflash.py: the DFlash draft in its three file forms, its math against a torch
oracle of the z-lab reference, the draft KV ring, validation against the target, and the converter.

The target is a tiny random qwen35 (4 layers: 3 DeltaNet + 1 attention, built with transformers and
converted by our converter); drafts are tiny random ones from tests/dflash_fixtures.py.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from daemons.dflash import (DFlashDraft, DFlashDrafter, DraftModelError, FeatureRing, check_file, read_config,
                            top2_margins, zlab_target_layer_ids)
from tests.dflash_fixtures import MASK_TOKEN_ID, build_zlab_draft, draft_forms, write_luce_gguf
from tests.qwen35_fixtures import build_tiny_qwen35, prompt_ids, session_root

TARGET_CONFIG = {"num_hidden_layers": 4}


@pytest.fixture(autouse=True, scope="module")
def one_numba_thread():
    """The tiny models are latency-bound: numba's thread pool only adds wake-ups per kernel call (and
    stalls badly on a loaded machine). Results do not depend on the thread count."""
    import numba
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from daemons.qwen35 import Qwen35Model
    _, path, hf = build_tiny_qwen35(session_root(tmp_path_factory), TARGET_CONFIG, outtype="f32")
    return Qwen35Model.load(path), hf, path


@pytest.fixture(scope="module")
def forms(target, tmp_path_factory):
    model, _, path = target
    return draft_forms(tmp_path_factory.mktemp("drafts"), model.hparams, target_gguf=path)


@pytest.fixture(scope="module")
def context(target):
    """A 40-token prompt's captured features for layers (1, 3) and its tokens."""
    model, hf, _ = target
    ids = prompt_ids(hf, 40, seed=3)
    state = model.new_state(64)
    _, caps = model.prefill(ids, state, capture_layers=[1, 3])
    return ids, np.concatenate([caps[1], caps[3]], axis=1)


# ---- the three forms ------------------------------------------------------------------------------

def test_three_forms_read_the_same_config(forms, target):
    # Bugs guarded: llama.cpp's target_layers read without the -1 (it stores HF id + 1), the mask id
    # taken from the wrong key, Luce's dflash.* names not mapped to the same tensors.
    model = target[0]
    configs = {k: read_config(p)[0].bind(model.hparams) for k, p in forms.items()}
    for c in configs.values():
        assert c.target_layer_ids == (1, 3)
        assert c.mask_token_id == MASK_TOKEN_ID and c.block_size == 8
        assert (c.n_layer, c.n_head, c.n_head_kv, c.head_dim, c.n_ff, c.n_rot) == (2, 4, 2, 16, 96, 16)
        assert c.rope_theta == pytest.approx(1e6) and c.rms_eps == pytest.approx(1e-6)
        assert c.layer_ids_source == "file"
    assert {c.format for c in configs.values()} == {"z-lab", "dflash", "qwen35-dflash-draft"}


def test_three_forms_propose_identically(forms, target, context):
    # Bug guarded: a tensor mapped to the wrong weight in one form (e.g. hidden_norm vs output_norm,
    # attn_norm vs ffn_norm) - every form holds the same float32 weights, so logits must be equal.
    model = target[0]
    ids, feats = context
    outs = {}
    for name, path in forms.items():
        drafter = DFlashDrafter(DFlashDraft.load(path, model), context_window=64)
        drafter.start(0)
        drafter.observe(0, ids[:30], feats[:30])
        rows = [drafter.ring.block_logits(ids[30], 30)]
        drafter.observe(30, ids[30:37], feats[30:37])
        rows.append(drafter.ring.block_logits(ids[37], 37))
        outs[name] = np.stack(rows)
    ref = outs.pop("z-lab")
    for name, got in outs.items():
        assert np.array_equal(got, ref), name


# ---- the math, against a torch oracle of the z-lab reference -------------------------------------

def _torch_reference(draft: DFlashDraft, hf, feats: np.ndarray, ctx_pos: np.ndarray, anchor: int, n: int,
                     window: int | None = None, causal: bool = False) -> np.ndarray:
    """z-lab `DFlashDraftModel.forward` + `compute_logits` for one block, written with transformers'
    Qwen3 building blocks (RMSNorm, rotary embedding, rotate_half, MLP) and SDPA-style attention over
    [context ; block] keys with the reference's `_attention_mask` rule."""
    import torch
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

    c = draft.config
    cfg_path = Path(c.path)
    tensors = {}
    from safetensors.numpy import load_file
    for k, v in load_file(str(cfg_path / "model.safetensors")).items():
        tensors[k] = torch.from_numpy(v.copy())
    qcfg = Qwen3Config(hidden_size=c.n_embd, intermediate_size=c.n_ff, num_attention_heads=c.n_head,
                       num_key_value_heads=c.n_head_kv, head_dim=c.head_dim, rms_norm_eps=c.rms_eps,
                       rope_theta=c.rope_theta, num_hidden_layers=c.n_layer, hidden_act="silu")

    def norm(w, x):
        m = Qwen3RMSNorm(w.shape[0], eps=c.rms_eps)
        m.weight.data = w
        return m(x)

    B, H, Hkv, D = c.block_size, c.n_head, c.n_head_kv, c.head_dim
    rot = Qwen3RotaryEmbedding(qcfg)
    with torch.no_grad():
        emb = hf.model.embed_tokens.weight
        head = hf.lm_head.weight
        h = emb[torch.tensor([anchor] + [c.mask_token_id] * (B - 1))][None]                # [1, B, d]
        th = norm(tensors["hidden_norm.weight"], torch.from_numpy(feats) @ tensors["fc.weight"].T)[None]
        pos = torch.tensor(np.concatenate([ctx_pos, np.arange(n, n + B)]))[None]
        cos, sin = rot(h, pos)
        qp = torch.arange(n, n + B)[:, None]
        kp = pos[0][None, :]
        visible = torch.ones(B, kp.shape[1], dtype=torch.bool)
        if causal:
            visible &= kp <= qp
        if window is not None:
            visible &= (qp - kp) < window
            if not causal:
                visible &= (kp - qp) < window
        for il in range(c.n_layer):
            p = f"layers.{il}."
            hn = norm(tensors[p + "input_layernorm.weight"], h)
            q = norm(tensors[p + "self_attn.q_norm.weight"], (hn @ tensors[p + "self_attn.q_proj.weight"].T).view(1, B, H, D))
            kin = torch.cat([th, hn], dim=1)
            k = norm(tensors[p + "self_attn.k_norm.weight"],
                     (kin @ tensors[p + "self_attn.k_proj.weight"].T).view(1, -1, Hkv, D))
            v = (kin @ tensors[p + "self_attn.v_proj.weight"].T).view(1, -1, Hkv, D)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos[:, None, -B:] + rotate_half(q) * sin[:, None, -B:]
            k = k * cos[:, None] + rotate_half(k) * sin[:, None]
            k = k.repeat_interleave(H // Hkv, dim=1)
            v = v.repeat_interleave(H // Hkv, dim=1)
            scores = (q @ k.transpose(-1, -2)) / np.sqrt(D)
            scores = scores.masked_fill(~visible, float("-inf"))
            o = torch.softmax(scores, dim=-1) @ v
            h = h + o.transpose(1, 2).reshape(1, B, H * D) @ tensors[p + "self_attn.o_proj.weight"].T
            mlp = Qwen3MLP(qcfg)
            mlp.gate_proj.weight.data = tensors[p + "mlp.gate_proj.weight"]
            mlp.up_proj.weight.data = tensors[p + "mlp.up_proj.weight"]
            mlp.down_proj.weight.data = tensors[p + "mlp.down_proj.weight"]
            h = h + mlp(norm(tensors[p + "post_attention_layernorm.weight"], h))
        out = norm(tensors["norm.weight"], h)
        return (out[0, 1:] @ head.T).numpy()


def test_draft_matches_torch_reference(forms, target, context):
    # Bugs guarded: RoPE pairing (NeoX halves vs interleaved), RoPE at relative instead of absolute
    # context positions, q/k norms skipped, the block made causal, GQA head mapping, row 0 not dropped.
    model, hf, _ = target
    ids, feats = context
    draft = DFlashDraft.load(forms["z-lab"], model)
    n = 33
    got = draft.block_logits_direct(ids[n], n, feats[:n], np.arange(n))
    ref = _torch_reference(draft, hf, feats[:n], np.arange(n), ids[n], n)
    assert got.shape == (7, model.hparams.n_vocab)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4 * np.abs(ref).max())


def test_sliding_window_draft_matches_torch_reference(target, context, tmp_path):
    # Bug guarded: the sliding window anchored once at n (lucebox) instead of per query row (z-lab),
    # or SWA layers left bidirectional inside the block.
    model, hf, _ = target
    ids, feats = context
    zdir = build_zlab_draft(tmp_path, model.hparams, sliding_window=5, seed=4)
    draft = DFlashDraft.load(zdir, model)
    assert draft.config.swa_layers == (True, True) and draft.config.causal_layers == (True, True)
    n = 20
    got = draft.block_logits_direct(ids[n], n, feats[:n], np.arange(n))
    ref = _torch_reference(draft, hf, feats[:n], np.arange(n), ids[n], n, window=5, causal=True)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4 * np.abs(ref).max())
    # the window matters: the full-attention version of the same weights differs
    full = _torch_reference(draft, hf, feats[:n], np.arange(n), ids[n], n)
    assert np.abs(full - ref).max() > 1e-2


# ---- the draft KV ring ----------------------------------------------------------------------------

def _assert_same_proposals(a: np.ndarray, b: np.ndarray) -> None:
    """Logits equal to float32 rounding (the ring sums keys in slot order, the direct path in position
    order) and the same greedy tokens wherever the top-2 gap exceeds that rounding."""
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(1.0, np.abs(b).max()))
    top2 = np.sort(b, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-4
    assert np.array_equal(np.argmax(a, -1)[clear], np.argmax(b, -1)[clear])


def test_ring_larger_than_context_equals_no_ring(forms, target, context):
    # Bug guarded: ring slots or masks that drop, duplicate or mis-position context rows.
    model = target[0]
    ids, feats = context
    draft = DFlashDraft.load(forms["dflash"], model)
    drafter = DFlashDrafter(draft, context_window=64)
    drafter.start(0)
    drafter.observe(0, ids[:12], feats[:12])
    for n in (12, 15, 23, 31, 38):
        drafter.observe(drafter._next, ids[drafter._next:n], feats[drafter._next:n])
        prop = drafter.propose(n, ids[n], 7)
        direct = draft.block_logits_direct(ids[n], n, feats[:n], np.arange(n))
        _assert_same_proposals(drafter.ring.block_logits(ids[n], n), direct)
        assert prop.tokens == tuple(int(t) for t in np.argmax(direct, -1))
    # each position's rows were computed once, not once per step
    assert drafter.ring.rows_computed == 38


def test_small_ring_gives_exactly_the_windowed_draft(forms, target, context):
    # Bugs guarded: slot = position mod capacity wrong at the wrap point, stale slots left visible,
    # RoPE re-based on the slot instead of the absolute position.
    model = target[0]
    ids, feats = context
    draft = DFlashDraft.load(forms["z-lab"], model)
    cap = 7
    drafter = DFlashDrafter(draft, context_window=cap)
    drafter.start(0)
    drafter.observe(0, ids[:10], feats[:10])
    steps = (10, 11, 14, 19, 20, 27, 35, 39)
    for n in steps:
        drafter.observe(drafter._next, ids[drafter._next:n], feats[drafter._next:n])
        drafter.propose(n, ids[n], 7)
        windowed = draft.block_logits_direct(ids[n], n, feats[n - cap:n], np.arange(n - cap, n))
        _assert_same_proposals(drafter.ring.block_logits(ids[n], n), windowed)
        assert sorted(drafter.ring.slot_pos.tolist()) == list(range(n - cap, n))
    # the window is a real restriction: the unwindowed draft differs
    n = steps[-1]
    full = draft.block_logits_direct(ids[n], n, feats[:n], np.arange(n))
    assert np.abs(full - drafter.ring.block_logits(ids[n], n)).max() > 1e-3
    # each position's rows were computed at most once, and only if it was inside a step's window
    # (the 27 -> 35 jump skips position 27 entirely)
    expected, prev = 0, 0
    for n in steps:
        expected += n - max(prev, n - cap)
        prev = n
    assert drafter.ring.rows_computed == expected == 35


def test_ring_forgets_rolled_back_positions(forms, target, context):
    # Bug guarded: after a rewind (a new request sharing a prefix), rows of the abandoned positions
    # stay visible.
    model = target[0]
    ids, feats = context
    draft = DFlashDraft.load(forms["dflash"], model)
    drafter = DFlashDrafter(draft, context_window=64)
    drafter.start(0)
    drafter.observe(0, ids[:30], feats[:30])
    drafter.propose(30, ids[30], 7)
    drafter.propose(20, ids[20], 7)            # rewind to 20
    direct = draft.block_logits_direct(ids[20], 20, feats[:20], np.arange(20))
    _assert_same_proposals(drafter.ring.block_logits(ids[20], 20), direct)


def test_feature_ring_wraps_and_reports_missing_positions():
    r = FeatureRing(4, 2)
    r.write(0, np.arange(12, dtype=np.float32).reshape(6, 2))      # positions 0..5, keeps 2..5
    rows, present = r.read(1, 6)
    assert present.tolist() == [False, True, True, True, True]
    assert rows[1:].tolist() == [[4, 5], [6, 7], [8, 9], [10, 11]]
    r.write(6, np.array([[100, 101]], dtype=np.float32))            # crosses the wrap point
    rows, present = r.read(3, 7)
    assert present.all() and rows[-1].tolist() == [100, 101]


def test_margins_are_probability_gaps():
    logits = np.array([[2.0, 0.0, 2.0], [np.log(3.0), 0.0, -50.0]])
    m = top2_margins(logits)
    assert m[0] == pytest.approx(0.0)
    assert m[1] == pytest.approx(3 / 4 - 1 / 4, abs=1e-9)


# ---- validation against the target and unsupported variants ---------------------------------------

def _zlab(tmp_path, target, name, **kw):
    return build_zlab_draft(tmp_path, target[0].hparams, name=name, **kw)


@pytest.mark.parametrize("kw, message", [
    (dict(mask_token_id=5000), "mask token id 5000 lies outside the target's vocabulary"),
    (dict(target_layer_ids=(1, 4)), "target layer id 4 does not exist in the target"),
    (dict(block_size=1), "block size 1 must be at least 2"),
    (dict(extra_config={"num_target_layers": 64}), "trained on a 64-layer target"),
    (dict(extra_config={"hidden_act": "gelu"}), "hidden_act 'gelu' is not supported"),
])
def test_mismatches_are_clear_errors(tmp_path, target, kw, message):
    # Bug guarded: a draft made for another model loads and silently proposes garbage (or crashes
    # deep in a matmul).
    d = _zlab(tmp_path, target, "bad", **kw)
    with pytest.raises(DraftModelError, match=message):
        DFlashDraft.load(d, target[0])


def test_width_mismatch_is_a_clear_error(tmp_path, target):
    class Wider:
        n_embd, n_layer, n_vocab = 96, 4, 1024
    d = build_zlab_draft(tmp_path, Wider, name="wide")
    with pytest.raises(DraftModelError, match="fc reads 192 features, but 2 target layers of width 64|"
                                              "draft width 96 differs from the target's embedding width 64"):
        DFlashDraft.load(d, target[0])


def test_dflash2_is_refused_naming_what_is_missing(tmp_path, target):
    # Bug guarded: a DFlash2 checkpoint loading as v1 (its conv and selector ignored) and drafting
    # from a different model than it was trained as.
    hp = target[0].hparams
    d = build_zlab_draft(tmp_path, hp, name="v2", extra_tensors={
        "layers.0.attention_conv.base_kernel": np.zeros((2, 2, 64), np.float32),
        "candidate_selector.hidden_projection.weight": np.zeros((8, 64), np.float32)},
        extra_config={"architectures": ["DFlash2DraftModel"]})
    with pytest.raises(DraftModelError, match="DFlash2 draft .* not supported: missing the grouped dynamic "
                                              "causal conv .*CandidateSelector"):
        DFlashDraft.load(d, target[0])


def test_luce_file_without_layer_ids_derives_them_from_the_target(tmp_path, target):
    # The reference's converter writes no target_layer_ids for Qwen drafts: they follow z-lab's rule.
    assert zlab_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert zlab_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert zlab_target_layer_ids(7, 3) == [1, 2, 4]              # Python's round: 2.5 -> 2
    assert zlab_target_layer_ids(48, 1) == [24]
    model = target[0]
    derived = tuple(zlab_target_layer_ids(model.hparams.n_layer, 1))
    d = build_zlab_draft(tmp_path, model.hparams, name="one", target_layer_ids=derived)
    luce = write_luce_gguf(d, tmp_path / "one.gguf", with_layer_ids=False)
    draft = DFlashDraft.load(luce, model)
    assert draft.target_layer_ids == derived
    assert "derived" in draft.config.layer_ids_source


def test_non_draft_files_are_refused(tmp_path, target):
    model, _, target_path = target
    with pytest.raises(DraftModelError, match="architecture 'qwen35' is not a DFlash draft"):
        DFlashDraft.load(target_path, model)
    with pytest.raises(DraftModelError, match="no config.json"):
        DFlashDraft.load(tmp_path, model)
    with pytest.raises(DraftModelError, match="no such file"):
        DFlashDraft.load(tmp_path / "absent.gguf", model)


def test_gguf_without_target_layers_is_refused(tmp_path, forms):
    from daemons.gguf_reader import GGUFFile, GGUFMetadataError
    from daemons.gguf_writer import TensorData, Typed, write_gguf
    with GGUFFile(forms["dflash"]) as f:
        md = {k: Typed(v, f.metadata_entry(k).vtype, f.metadata_entry(k).item_type) for k, v in f.metadata.items()
              if k not in ("dflash.target_layers", "general.architecture")}
        tensors = [TensorData(n, t.dequantize()) for n, t in f.tensors.items()]
    write_gguf(tmp_path / "x.gguf", "dflash", md, tensors)
    with GGUFFile(tmp_path / "x.gguf") as f, pytest.raises(GGUFMetadataError, match="dflash.target_layers"):
        check_file(f)


# ---- converter, registry, llama.cpp ------------------------------------------------------------------

def test_converter_writes_llama_cpp_dflash_layout(forms):
    # Bug guarded: target layers written as HF ids (llama.cpp would read the layer before each).
    from daemons.gguf_reader import GGUFFile
    with GGUFFile(forms["dflash"]) as f:
        assert f.architecture == "dflash"
        assert f.get("dflash.target_layers") == [2, 4]
        assert f.get("tokenizer.ggml.mask_token_id") == MASK_TOKEN_ID
        assert f.get("dflash.block_size") == 8
        assert {"fc.weight", "enc.output_norm.weight", "output_norm.weight", "blk.1.ffn_down.weight"} <= set(f.tensors)
        assert "tokenizer.ggml.tokens" in f.metadata            # copied from the target
        check_file(f)


def test_llama_cpp_loads_the_converted_draft(forms):
    # The layout check that matters: llama.cpp's own `dflash` loader accepts our file.
    llama_cpp = pytest.importorskip("llama_cpp")
    from tests.llama_helpers import quiet_llama
    quiet_llama()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    mdl = llama_cpp.llama_model_load_from_file(os.fsencode(str(forms["dflash"])), params)
    assert mdl, "llama.cpp refused the converted dflash GGUF"
    try:
        assert llama_cpp.llama_model_n_layer(mdl) == 2
        assert llama_cpp.llama_model_n_embd(mdl) == 64
    finally:
        llama_cpp.llama_model_free(mdl)


def test_registry_validates_and_refuses_to_load_drafts_alone(forms):
    from daemons import architectures, model_info
    from daemons.gguf_reader import GGUFFile
    for key in ("dflash", "qwen35-dflash-draft"):
        with GGUFFile(forms[key]) as g:
            model_info.validate(g)
            assert architectures.lookup(g).role == "draft"
        with pytest.raises(architectures.ArchitectureNotServedError, match="is a draft model"):
            architectures.load_model(str(forms[key]))


def test_cli_convert_and_generate_with_a_draft(forms, target, tmp_path):
    # `dflashd convert` turns a z-lab draft directory into a dflash GGUF; `dflashd generate --draft
    # --json` reports the spec object and the same tokens as without the draft.
    from click.testing import CliRunner
    from daemons.cli import main
    model, hf, target_path = target
    runner = CliRunner()
    out = tmp_path / "conv.gguf"
    r = runner.invoke(main, ["convert", str(forms["z-lab"]), str(out), "--outtype", "f32"])
    assert r.exit_code == 0, r.output
    ids = ",".join(str(t) for t in prompt_ids(hf, 12, seed=9))
    base = ["generate", "-m", str(target_path), "--tokens", ids, "-n", "20", "--json"]
    ar = json.loads(runner.invoke(main, base).stdout)
    r = runner.invoke(main, base + ["--draft", str(out), "--draft-max", "5", "--draft-margin", "0.0"])
    assert r.exit_code == 0, r.output
    spec = json.loads(r.stdout)
    assert spec["tokens"] == ar["tokens"]
    assert set(spec["spec"]) == {"drafted", "accepted", "accepted_per_position", "steps", "acceptance_length"}
    assert spec["spec"]["steps"] > 0 and "spec" not in ar
    r = runner.invoke(main, base + ["--draft", str(target_path)])
    assert r.exit_code == 2 and "is not a DFlash draft" in r.output
    r = runner.invoke(main, base + ["--draft-max", "3"])
    assert r.exit_code == 2 and "need --draft" in r.output
