"""The qwen35 CPU model (daemons/qwen35.py) against llama.cpp (llama-cpp-python) on the same GGUF files.

Files: tiny random Qwen3_5ForCausalLM checkpoints (tests/qwen35_fixtures.py) converted by our
converter to F32, F16 and Q8_0, plus a Q4_K_M made by llama.cpp's own quantiser from our F16 file.
Configs: the two of CONFIGS (hidden 64 / 96: llama.cpp's Q4_K_M falls back to Q5_0 + Q8_0 there,
since K-quant rows must be multiples of 256), and two with every matrix row a multiple of 256
(K256_UNTIED, K256_TIED) where Q4_K_M really is Q4_K + Q6_K (the types actually written are
checked), and K256_PEAKED (below).

What differs between the two engines, and so what the tolerances measure:
- llama.cpp's CPU matmul rounds the activations to the weight type's `vec_dot_type` (F16 for F16
  weights, Q8_0 blocks of 32 for Q8_0/Q5_0, Q8_K blocks of 256 for K-quants); ours reads the same
  quantised weights exactly but keeps float32 activations. That is ~0.5% noise per matmul input, and
  these untrained random nets amplify it ~10x (a single rounded matmul in layer 0 moves the logits
  by up to 5%), so the logits of the quantised files agree to a few % only, and greedy paths split at
  the first near-tie (random heads have top-2 gaps of ~0.3% of the logit range within 32 steps).
  `test_each_quantised_matrix_matches_llama_in_isolation` shows that this is llama.cpp's rounding and
  not our dequantisation: one quantised matrix at a time in an F32 file, with ggml's rounding
  emulated on our side, agrees to ~2e-6 of the logit range (rarely up to 1e-3).
- KV cache: llama.cpp's is F16 by default; these tests ask it for F32 (ours is float32).

Greedy agreement (32 steps, our `generate` greedy against llama.cpp's greedy sampler) is asserted
where the margins make it meaningful: F32 and F16 on every config (prompts chosen with top-2
margins several times the F16 noise; the tied models' paths repeat a few tokens), and every type on
K256_PEAKED, an untied K256 model whose head is nudged so that each token clearly predicts a
successor (top-2 margins >= 1.5, ~10x the quantised-type noise). For Q8_0/Q4_K_M on the plain random configs the first divergence is reported
and the decode-step logits are held to the per-type tolerance instead.
"""
from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import pytest

from daemons.generate import GenerationRequest, generate_all
from daemons.gguf_reader import GGUFFile
from daemons.qwen35 import Qwen35Model
from daemons.tokenizer import Tokenizer
from tests import gguf_bytes as gb
from tests.llama_helpers import (
    ggml_rounding_backend,
    llama_greedy,
    llama_prompt_logits,
    matrix_type_counts,
    open_llama,
    quantize_with_llama,
    top1_margin,
)
from tests.qwen35_fixtures import TOKENIZER_VOCAB, build_tiny_qwen35, prompt_ids, session_root

pytestmark = pytest.mark.llama

TYPES = ["f32", "f16", "q8_0", "q4_k_m"]
N_STEPS = 32
N_CTX = 128

# Every matrix row (n_in) a multiple of 256: hidden 256, ff 512/768, n_head*head_dim 256,
# n_v_heads*d_v 256; different head counts between the two; layers 3 and 7 full attention.
K256_UNTIED = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=64, linear_value_head_dim=64, tie_word_embeddings=False)
K256_TIED = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=1, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
                 linear_key_head_dim=32, linear_value_head_dim=32, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5,
                                  "mrope_section": [3, 3, 2], "mrope_interleaved": True})
CONFIGS = {"gqa_untied": "gqa_untied", "mqa_tied": "mqa_tied", "k256_untied": K256_UNTIED,
           "k256_tied": K256_TIED, "k256_peaked": K256_UNTIED}

# K256_PEAKED: embeddings x3 (the residual stream carries the current token more strongly) and head
# row perm[i] += PEAK * (unit) embedding i: token i predicts perm[i] with a clear margin.
PEAK_EMBED_SCALE, PEAK_HEAD = 3.0, 1.0

# Matrix types llama.cpp's Q4_K_M wrote (checked, and the reason the K256 configs exist).
Q4_K_M_TYPES = {"gqa_untied": {"Q5_0", "Q8_0"}, "mqa_tied": {"Q5_0", "Q8_0"},
                "k256_untied": {"Q4_K", "Q6_K"}, "k256_tied": {"Q4_K", "Q6_K"}, "k256_peaked": {"Q4_K", "Q6_K"}}

# Prompt seed per config (prompt_ids(hf, 48, seed)) for the greedy runs: chosen (scanning seeds
# from 0) for top-2 margins along the greedy path of at least ~3x the F16 noise.
GREEDY_PROMPT_SEED = {"gqa_untied": 3, "mqa_tied": 0, "k256_untied": 0, "k256_tied": 3, "k256_peaked": 0}
GREEDY_IDENTICAL = {(c, t) for c in CONFIGS for t in ("f32", "f16")} | {("k256_peaked", t) for t in TYPES}

# max |ours - llama.cpp| / max |llama.cpp logit|, over all 48 prompt positions and over the 32
# decode steps of llama.cpp's greedy path (ours fed the same tokens). Set a little above what was
# measured (see the module docstring for why the quantised types are loose on random nets).
REL_TOL = {            # measured, worst of the four random configs (prompt / decode)
    "f32": 1e-5,       # 3.7e-6 / 1.4e-6
    "f16": 5e-3,       # 2.2e-3 / 1.8e-3
    "q8_0": 0.15,      # 9.6e-2 / 7.5e-2
    "q4_k_m": 0.15,    # 1.0e-1 / 7.9e-2 (Q5_0+Q8_0 fall-back on the CONFIGS; Q4_K+Q6_K: 5.4e-2 / 7.9e-2)
}
# K256_PEAKED (clear margins, calmer: the embedding dominates the residual stream): 7.1e-7,
# 2.7e-4, 9.7e-3, 1.4e-2.
REL_TOL_PEAKED = {"f32": 1e-5, "f16": 1e-3, "q8_0": 0.02, "q4_k_m": 0.03}
# One quantised matrix in an F32 file, ggml's activation rounding emulated on our side: typically
# 2e-6; up to 9e-4 measured where float summation-order differences flip a few roundings of an
# activation to the neighbouring Q8 step (one step is ~1/127 of a block's largest value).
ISOLATED_REL_TOL = 5e-3


# ------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------

def _peaked_hf_dir(root: Path) -> Path:
    """K256_UNTIED with a head that makes each token clearly predict a successor (see above)."""
    import torch

    base_dir, _, hf = build_tiny_qwen35(root, K256_UNTIED, outtype=None)
    out = root / f"{base_dir.name}-peaked"
    if (out / "config.json").exists():
        return out
    model = copy.deepcopy(hf)
    perm = torch.as_tensor(np.random.default_rng(0).permutation(TOKENIZER_VOCAB))
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        real = emb[:TOKENIZER_VOCAB]
        model.lm_head.weight[perm] += PEAK_HEAD * real / real.norm(dim=1, keepdim=True)
        emb.mul_(PEAK_EMBED_SCALE)
    tmp = root / f"{out.name}.part"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base_dir / name, tmp / name)
    tmp.rename(out)
    return out


def _files(root: Path, config: str) -> tuple[dict[str, Path], object]:
    """{type: GGUF path} for one config, and the HF model (for prompt ids)."""
    from daemons.convert import convert_hf_to_gguf

    paths: dict[str, Path] = {}
    if config == "k256_peaked":
        hf_dir = _peaked_hf_dir(root)
        _, _, hf = build_tiny_qwen35(root, K256_UNTIED, outtype=None)
        for t in ("f32", "f16", "q8_0"):
            p = root / f"{hf_dir.name}-{t}.gguf"
            if not p.exists():
                convert_hf_to_gguf(hf_dir, p.with_suffix(".part"), outtype=t)
                p.with_suffix(".part").rename(p)
            paths[t] = p
    else:
        for t in ("f32", "f16", "q8_0"):
            _, paths[t], hf = build_tiny_qwen35(root, CONFIGS[config], outtype=t)
    q4 = paths["f16"].with_name(paths["f16"].name.replace("-f16.gguf", "-q4_k_m-llama.gguf"))
    if not q4.exists():
        quantize_with_llama(paths["f16"], q4, "Q4_K_M")
    paths["q4_k_m"] = q4
    return paths, hf


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Lazily built files, models and llama.cpp contexts, shared by every test of the module."""
    root = session_root(tmp_path_factory)
    files: dict[str, tuple[dict[str, Path], object]] = {}
    ours: dict[Path, Qwen35Model] = {}
    llamas: dict[Path, object] = {}

    class World:
        def paths(self, config: str) -> dict[str, Path]:
            if config not in files:
                files[config] = _files(root, config)
            return files[config][0]

        def hf(self, config: str):
            self.paths(config)
            return files[config][1]

        def ours(self, path: Path) -> Qwen35Model:
            if path not in ours:
                ours[path] = Qwen35Model.load(path)
            return ours[path]

        def llama(self, path: Path):
            if path not in llamas:
                llamas[path] = open_llama(path, N_CTX)
            return llamas[path]

    yield World()
    for llm in llamas.values():
        llm.close()


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", list(CONFIGS))
def test_files_hold_the_types_compared(world, config):
    """Guards the premise of every comparison: each file really stores its type, and llama.cpp's
    Q4_K_M really is K-quants where the rows allow it (it silently falls back otherwise)."""
    paths = world.paths(config)
    for t in ("f32", "f16", "q8_0"):
        assert set(matrix_type_counts(paths[t])) == {t.upper()}, (config, t)
    q4 = matrix_type_counts(paths["q4_k_m"])
    print(f"{config}: llama.cpp Q4_K_M wrote {q4}")
    assert set(q4) == Q4_K_M_TYPES[config]


@pytest.mark.parametrize("dtype", TYPES)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_prompt_and_decode_logits_close(world, config, dtype):
    """All 48 prompt positions in one prefill, then 32 single-token steps along llama.cpp's greedy
    path: ours within the per-type tolerance of llama.cpp (a wrong layout, dequantisation, state
    hand-over or position breaks this at O(1))."""
    path = world.paths(config)[dtype]
    model, llm = world.ours(path), world.llama(path)
    prompt = prompt_ids(world.hf(config), 48, seed=1)
    ref = llama_prompt_logits(llm, prompt)
    got = model.forward(prompt, model.new_state(N_CTX), logits="all")
    prompt_err = _rel(got, ref)

    run = llama_greedy(llm, prompt, N_STEPS)
    state = model.new_state(N_CTX)
    step_logits = [model.prefill(prompt, state)[0]]
    for tok in run.tokens[:-1]:
        step_logits.append(model.forward([tok], state)[0])
    decode_err = _rel(np.stack(step_logits), run.logits)
    # where our greedy path would leave llama.cpp's (the first step whose argmax differs)
    split = next((i for i, lg in enumerate(step_logits) if int(np.argmax(lg)) != run.tokens[i]), None)
    tol = (REL_TOL_PEAKED if config == "k256_peaked" else REL_TOL)[dtype]
    print(f"{config} {dtype}: prompt {prompt_err:.2e}, decode {decode_err:.2e} of max|logit| "
          f"{np.abs(ref).max():.2f} (tol {tol:.2g}); greedy {'identical' if split is None else f'splits at step {split}'}, "
          f"min top-2 margin {top1_margin(run.logits).min():.3f}")
    assert prompt_err <= tol
    assert decode_err <= tol
    # llama.cpp's greedy sampler took the first maximum of the logits it returned
    assert run.tokens == [int(np.argmax(r)) for r in run.logits]


@pytest.mark.parametrize("config,dtype", sorted(GREEDY_IDENTICAL, key=lambda c: (list(CONFIGS).index(c[0]), TYPES.index(c[1]))))
def test_greedy_tokens_match_llama(world, config, dtype):
    """Our greedy `generate` (32 tokens) against llama.cpp's greedy sampler, same prompt: identical
    (a wrong argmax tie rule, an off-by-one in the decode loop's state or positions, or logits
    off by more than the margins breaks this)."""
    path = world.paths(config)[dtype]
    model, llm = world.ours(path), world.llama(path)
    prompt = prompt_ids(world.hf(config), 48, seed=GREEDY_PROMPT_SEED[config])
    run = llama_greedy(llm, prompt, N_STEPS)
    tok = Tokenizer.from_metadata(model.metadata, source=str(path))
    res = generate_all(model, tok, GenerationRequest(prompt_ids=prompt, max_tokens=N_STEPS))
    ours = list(res.token_ids)
    assert len(ours) == N_STEPS and res.finish_reason == "length"
    first = next((i for i, (a, b) in enumerate(zip(ours, run.tokens)) if a != b), None)
    margin = float(top1_margin(run.logits).min())
    print(f"{config} {dtype}: {'identical' if first is None else f'first divergence at step {first}'}, "
          f"{len(set(run.tokens))} distinct tokens, min top-2 margin {margin:.3f}")
    assert ours == run.tokens


# Matrices checked one at a time: DeltaNet (qkv, beta, out), FFN (down), attention (v, output), the
# head and the embedding (the head too when tied); Q4_K and Q6_K both occur in the K256 Q4_K_M files.
ISOLATED = ["token_embd.weight", "output.weight", "blk.0.attn_qkv.weight", "blk.0.ssm_beta.weight",
            "blk.0.ssm_out.weight", "blk.1.ffn_down.weight", "blk.3.attn_v.weight", "blk.3.attn_output.weight"]


def _hybrid(f32_path: Path, donor_path: Path, name: str, out: Path) -> Path:
    """`f32_path` with tensor `name` replaced by its bytes (and type) from `donor_path`."""
    base, donor = GGUFFile(f32_path), GGUFFile(donor_path)
    try:
        kvs = []
        for key in base.metadata:
            e = base.metadata_entry(key)
            kvs.append((key, e.vtype, e.value) + ((e.item_type,) if e.item_type is not None else ()))
        tensors = []
        for t in base:
            src = donor.tensor(t.name) if t.name == name else t
            tensors.append((src.name, src.ne, src.qtype, src.raw.tobytes()))
        out.write_bytes(gb.build_gguf(kvs, tensors))
    finally:
        base.close()
        donor.close()
    return out


@pytest.mark.parametrize("config,dtype", [("k256_untied", "f16"), ("k256_untied", "q8_0"),
                                          ("k256_untied", "q4_k_m"), ("k256_tied", "q4_k_m"),
                                          ("gqa_untied", "q4_k_m")])
def test_each_quantised_matrix_matches_llama_in_isolation(world, config, dtype, tmp_path):
    """One matrix of the `dtype` file in the F32 file, everything else F32: with ggml's activation
    rounding emulated (tests.llama_helpers.round_activations_like_ggml) our logits equal llama.cpp's
    to ~2e-6 of the logit range (at most ~1e-3, when a rounding flips), prompt and decode, against
    1e-3..5e-2 without the emulation. So our dequantisation of F16, Q8_0, Q5_0, Q4_K and Q6_K and
    the matrix layouts are llama.cpp's, and the few-% differences of whole quantised files come from
    llama.cpp rounding activations (a wrong scale, sub-block or nibble order would show at 1e-2..1)."""
    paths = world.paths(config)
    donor = GGUFFile(paths[dtype])
    names = [n for n in ISOLATED if n in donor.tensors]
    types = {n: donor.tensor(n).type_name for n in names}
    donor.close()
    prompt = prompt_ids(world.hf(config), 48, seed=1)
    rounding = ggml_rounding_backend()
    worst = 0.0
    for name in names:
        path = _hybrid(paths["f32"], paths[dtype], name, tmp_path / f"{name}.gguf")
        llm = open_llama(path, N_CTX)
        try:
            ref = llama_prompt_logits(llm, prompt)
            run = llama_greedy(llm, prompt, 4)
        finally:
            llm.close()
        emulated = Qwen35Model.load(path, rounding)
        plain = Qwen35Model.load(path)
        plain_err = _rel(plain.forward(prompt, plain.new_state(N_CTX), logits="all"), ref)
        state = emulated.new_state(N_CTX)
        got = emulated.forward(prompt, state, logits="all")
        steps = [got[-1]]
        for tok in run.tokens[:-1]:
            steps.append(emulated.forward([tok], state)[0])
        err = max(_rel(got, ref), _rel(np.stack(steps), run.logits))
        worst = max(worst, err)
        print(f"{config} {name:26s} {types[name]:5s} emulated {err:.2e}  plain {plain_err:.2e}")
        emulated.gguf.close()
        plain.gguf.close()
        assert err <= ISOLATED_REL_TOL, name
    assert types and worst <= ISOLATED_REL_TOL


TOKENIZER_TEXTS = [
    "Hello world",
    "the delta rule and gated attention: 12345 tokens, 3.14159!",
    "naïve café Ünïcode 日本語 中文 данные λόγος x² — …",
    "  leading spaces\n\n\tand tabs,\r\nnewlines   and trailing   ",
    "<|im_start|>user\nWhat's up? We'll see.<|im_end|>\n<|im_start|>assistant\n",
    "don't I'M you've THEY'RE it'd",
]


@pytest.mark.parametrize("config", ["gqa_untied", "k256_tied"])
def test_tokenizer_matches_llama_on_the_converted_file(world, config):
    """Our Tokenizer built from the converted file's metadata splits text as llama.cpp does."""
    path = world.paths(config)["f32"]
    f = GGUFFile(path)
    tok = Tokenizer.from_metadata(f.metadata, source=str(path))
    f.close()
    llm = world.llama(path)
    for text in TOKENIZER_TEXTS:
        ref = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert tok.encode(text, add_special=False, parse_special=True) == ref, text
        assert tok.decode(ref) == text
