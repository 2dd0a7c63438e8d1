"""The qwen35 model on CPU (daemons/qwen35.py + kernels/cpu_backend.py) against transformers.

Two tiny random Qwen3_5ForCausalLM configs (different attention and DeltaNet head counts, one
tied and one untied output, layers 3 and 7 full attention), converted to GGUF in f32 by our
converter, must give transformers' logits (eager attention, float32) to 1e-3 on a 48-token prompt
(every position) and 16 further single-token decode steps. That covers the converter's transforms
(1+w norms, -exp(A_log), V-head reorder), gated attention with q/k norms, partial RoPE and GQA,
the DeltaNet conv/L2/β/g/recurrence in both forms, the FFN and the tied / untied head.
"""
from __future__ import annotations

import numpy as np
import pytest

from daemons.qwen35 import ModelInputError, Qwen35Model, StateError
from tests.qwen35_fixtures import build_tiny_qwen35, hf_reference, prompt_ids, session_root

CONFIG_NAMES = ["gqa_untied", "mqa_tied"]
TOL = 1e-3


@pytest.fixture(scope="module", params=CONFIG_NAMES)
def case(request, tmp_path_factory):
    hf_dir, gguf_path, hf_model = build_tiny_qwen35(session_root(tmp_path_factory), request.param, outtype="f32")
    prompt = prompt_ids(hf_model, 48, seed=1)
    ref = hf_reference(hf_model, prompt, n_decode=16)
    return {"name": request.param, "hf_dir": hf_dir, "gguf": gguf_path, "hf": hf_model,
            "prompt": prompt, "ref": ref, "model": Qwen35Model.load(gguf_path)}


def test_logits_match_transformers(case):
    model, ref = case["model"], case["ref"]
    assert model.tied_output == (case["name"] == "mqa_tied")
    # the reference is not degenerate: logits spread out and the greedy path varies
    assert ref["prompt_logits"].std() > 0.5 and len(set(ref["decode_tokens"].tolist())) > 3
    state = model.new_state(128)
    logits = model.forward(case["prompt"], state, logits="all")
    assert logits.shape == ref["prompt_logits"].shape and logits.dtype == np.float32
    assert np.abs(logits - ref["prompt_logits"]).max() <= TOL
    assert state.n_past == 48
    for tok, ref_logits in zip(ref["decode_tokens"], ref["decode_logits"]):
        step = model.forward([int(tok)], state)
        assert step.shape == (1, model.n_vocab)
        assert np.abs(step[0] - ref_logits).max() <= TOL
        assert int(np.argmax(step[0])) == int(np.argmax(ref_logits))
    assert state.n_past == 64


def test_prefill_chunks_and_deltanet_forms_agree(case):
    """Chunked prefill across calls, the recurrent form over the whole prompt and one chunked
    pass give the same logits (a wrong conv/KV/DeltaNet state hand-over between chunks breaks this)."""
    model, prompt = case["model"], case["prompt"]
    one = model.forward(prompt, model.new_state(64), logits="all")
    st = model.new_state(64)
    chunked = model.prefill(prompt, st, chunk=20, logits="all")
    assert st.n_past == 48
    rec = model.forward(prompt, model.new_state(64), logits="all", deltanet_mode="recurrent")
    # float32 rounding differs between batch shapes; a broken hand-over errs by O(1)
    tol = 1e-4 * np.abs(one).max()
    print(f"{case['name']}: chunked {np.abs(chunked - one).max():.2e}, recurrent {np.abs(rec - one).max():.2e}, tol {tol:.2e}")
    assert np.abs(chunked - one).max() <= tol
    assert np.abs(rec - one).max() <= tol
    last = model.prefill(prompt, model.new_state(64), chunk=16)
    assert last.shape == (1, model.n_vocab) and np.abs(last[0] - one[-1]).max() <= tol


def test_state_copy_and_host_round_trip(case):
    model, prompt, toks = case["model"], case["prompt"], [int(t) for t in case["ref"]["decode_tokens"][:4]]
    state = model.new_state(80)
    model.prefill(prompt, state)
    snap = state.to_host()
    assert snap["k.3"].shape[1] == 48 and snap["ssm.0"].dtype == np.float32
    twin = state.copy()
    first = [model.forward([t], state)[0] for t in toks]
    # the copy was not advanced by the steps above, and replays them bit for bit
    assert twin.n_past == 48
    np.testing.assert_array_equal(np.stack([model.forward([t], twin)[0] for t in toks]), np.stack(first))
    # restore the snapshot into the advanced state (and into a state of another size)
    for target in (state, model.new_state(60)):
        target.from_host(snap)
        assert target.n_past == 48
        np.testing.assert_array_equal(np.stack([model.forward([t], target)[0] for t in toks]), np.stack(first))
    with pytest.raises(StateError, match="n_past"):
        model.new_state(40).from_host(snap)
    with pytest.raises(StateError, match="missing"):
        model.new_state(80).from_host({k: v for k, v in snap.items() if k != "ssm.0"})
    # copy_from: the advanced state's arrays overwritten in place (the same objects: a GPU step
    # bound to them stays bound), then the same steps again
    arrays = {name: id(a) for name, a in state._arrays().items()}
    state.copy_from(twin.copy_from(model.new_state(80).from_host(snap)))
    assert state.n_past == 48 and {name: id(a) for name, a in state._arrays().items()} == arrays
    np.testing.assert_array_equal(np.stack([model.forward([t], state)[0] for t in toks]), np.stack(first))
    with pytest.raises(StateError, match="max_ctx"):
        state.copy_from(model.new_state(60))


def test_capture_layers_match_hf_hidden_states(case):
    """x' after the FFN residual of layer il is HF's hidden_states[il + 1] (DFlash feature capture)."""
    import torch

    model, prompt, hf = case["model"], case["prompt"], case["hf"]
    with torch.no_grad():
        hs = hf(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
    layers = [1, 3, 6]
    logits, caps = model.prefill(prompt, model.new_state(64), chunk=32, capture_layers=layers)
    assert sorted(caps) == layers and logits.shape == (1, model.n_vocab)
    for il in layers:
        ref = hs[il + 1][0].numpy()
        assert caps[il].shape == ref.shape
        assert np.abs(caps[il] - ref).max() <= TOL * max(1.0, np.abs(ref).max())


def test_bad_inputs_raise(case):
    model = case["model"]
    state = model.new_state(8)
    with pytest.raises(ModelInputError, match="outside"):
        model.forward([model.n_vocab], state)
    with pytest.raises(ModelInputError, match="non-empty"):
        model.forward([], state)
    with pytest.raises(ModelInputError, match="context overflow"):
        model.forward(list(range(9)), state)
    with pytest.raises(ModelInputError, match="logits"):
        model.forward([1], state, logits="first")
    assert state.n_past == 0


def _dequantized_copy(src, dst):
    """The same file with every tensor dequantised to F32 (written byte by byte, independently of
    our writer)."""
    from daemons.gguf_reader import GGUFFile
    from tests import gguf_bytes as gb

    f = GGUFFile(src)
    kvs = []
    for key in f.metadata:
        e = f.metadata_entry(key)
        kvs.append((key, e.vtype, e.value) + ((e.item_type,) if e.item_type is not None else ()))
    tensors = [(t.name, t.ne, 0, np.ascontiguousarray(t.dequantize(), dtype=np.float32).tobytes()) for t in f]
    dst.write_bytes(gb.build_gguf(kvs, tensors))
    return dst


# Max |logit - f32 logit| / max |f32 logit| reached on the two fixtures (measured: f16 ~0.3%,
# bf16 ~2%, q8_0 ~4-7%; the tiny random nets amplify weight rounding several-fold).
@pytest.mark.parametrize("outtype,tol", [("f16", 0.01), ("bf16", 0.06), ("q8_0", 0.12)])
def test_other_outtypes_load_and_stay_close(case, outtype, tol, tmp_path):
    """Lower-precision conversions load, run through the quantised matmul exactly like their
    dequantised F32 copy, and track the f32 logits."""
    _, path, _ = build_tiny_qwen35(case["hf_dir"].parent, case["name"], outtype=outtype)
    model = Qwen35Model.load(path)
    logits = model.forward(case["prompt"], model.new_state(64), logits="all")
    # the stored-quantisation path equals running the dequantised weights in f32
    plain = Qwen35Model.load(_dequantized_copy(path, tmp_path / "deq.gguf"))
    plain_logits = plain.forward(case["prompt"], plain.new_state(64), logits="all")
    assert np.abs(logits - plain_logits).max() <= 1e-4 * np.abs(plain_logits).max()
    ref = case["ref"]["prompt_logits"]
    rel = np.abs(logits - ref).max() / np.abs(ref).max()
    print(f"{case['name']} {outtype}: max |diff| / max |logit| = {rel:.2e}, "
          f"argmax agreement {np.mean(np.argmax(logits, 1) == np.argmax(ref, 1)):.2f}")
    assert 0 < rel <= tol
    assert np.mean(np.argmax(logits, axis=1) == np.argmax(ref, axis=1)) >= 0.85
