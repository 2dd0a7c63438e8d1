"""The training recipe of the embedded default pair (models/recipe/), run end to end at micro scale:
`run.py --micro` (a slice of the local stdlib, a 4-layer target, a 1-layer draft, a few dozen steps
each, export with `dflashd convert`, measurement through the serving code) into a temporary directory,
then its artifacts checked with the serving code itself.

What the real run (on the GPU machine) depends on and these tests guard: the split is by file and
never leaks; the shipped chat template renders exactly the text the model was trained on; the
tokenizer the GGUF carries gives the training ids; the torch draft module computes what the draft
loader computes (else the trained draft accepts nothing once served); the byte budget estimate is an
upper bound of what the converter writes; and speculative decoding of the pair is token-identical to
greedy decoding.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def one_numba_thread():
    """Tiny models are latency-bound: numba's thread pool only adds wake-ups (see test_dflash_draft)."""
    import numba
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(before)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe-micro")
    r = subprocess.run([sys.executable, str(REPO / "models/recipe/run.py"), "--out", str(out), "--micro"],
                       cwd=str(REPO), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"run.py --micro failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def report(run_dir):
    return json.loads((run_dir / "report.json").read_text())


@pytest.fixture(scope="module")
def pair(run_dir, report, one_numba_thread):
    from daemons.architectures import load_model
    from daemons.dflash import DFlashDraft
    model = load_model(str(run_dir / report["export"]["target_file"]))
    draft = DFlashDraft.load(run_dir / report["export"]["draft_file"], model)
    return model, draft


def test_report_has_every_field(report):
    for key in ("settings", "device", "device_name", "python", "torch", "transformers", "corpus", "target", "draft",
                "export", "measure", "seconds", "seed"):
        assert key in report, key
    t = report["target"]
    for key in ("config", "byte_plan", "training", "heldout_eval", "train_tokens", "heldout_tokens", "vocab_tokens"):
        assert key in t, key
    assert t["training"]["steps"] == report["settings"]["target_steps"]
    assert t["training"]["curve"] and t["training"]["eval_curve"]
    d = report["draft"]
    assert d["training"]["steps"] == report["settings"]["draft_steps"]
    assert d["training"]["generated_windows"] > 0            # the self-distillation path ran
    est = d["training"]["eval_curve"][-1]
    assert len(est["position_accuracy"]) == d["block_size"] - 1
    assert math.isclose(est["estimated_al"], 1 + sum(est["prefix_acceptance"]), abs_tol=1e-3)
    m = report["measure"]
    for key in ("acceptance_length", "n_prompts", "all_identical_to_ar", "accepted_per_position_rate",
                "ar_decode_tok_s", "spec_decode_tok_s", "demo", "tokenizer_check"):
        assert key in m, key


def test_model_card_draft_is_written(run_dir, report):
    card = (run_dir / "MODEL_CARD.md").read_text()
    for needle in ("Held-out perplexity", "bigram", "Measured acceptance", "PSF", report["export"]["target_file"],
                   "Data and split", "Tokenizer", "Architecture"):
        assert needle in card, needle


def test_training_reduced_the_loss(report):
    curve = report["target"]["training"]["curve"]
    assert curve[-1]["train_loss"] < curve[0]["train_loss"] - 0.5     # an optimiser that does nothing fails
    d = report["draft"]["training"]["curve"]
    assert d[-1]["loss"] < d[0]["loss"]


def test_perplexities_are_finite(report):
    he = report["target"]["heldout_eval"]
    V = report["target"]["vocab_padded"]
    for key in ("target_ppl", "bigram_ppl"):
        assert math.isfinite(he[key]) and 1.0 < he[key] < V, (key, he[key])
    assert he["scored_tokens"] > 0


def test_split_is_by_file_without_overlap(run_dir):
    from models.recipe.corpus import split_of
    man = json.loads((run_dir / "corpus_manifest.json").read_text())
    train = {p for p, _ in man["train"]["files"]}
    held = {p for p, _ in man["heldout"]["files"]}
    assert train and held and not train & held
    frac = man["heldout_fraction"]
    assert all(split_of(p, frac) == "train" for p in train)
    assert all(split_of(p, frac) == "heldout" for p in held)
    assert man["python_version"] == sys.version.split()[0]


def test_split_depends_on_the_path_alone():
    """A file keeps its side whatever else the installation holds (3.11 here, 3.12 on the GPU machine)."""
    from models.recipe.corpus import split_of
    paths = [f"pkg{i}/mod{i}.py" for i in range(2000)]
    sides = [split_of(p, 0.05) for p in paths]
    assert sides == [split_of(p, 0.05) for p in paths]
    share = sides.count("heldout") / len(sides)
    assert 0.03 < share < 0.07


def test_documents_turn_docstrings_into_requests_and_files_into_continuations():
    from models.recipe.corpus import SourceFile, file_documents
    src = ('"""Tools for numbers."""\nimport math\n\n\ndef fib(n):\n    """Return the n-th Fibonacci number."""\n'
           '    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nclass Box:\n'
           '    def area(self):\n        """Compute the area."""\n        return 0\n')
    docs = file_documents(SourceFile("num.py", src, "train"))
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d.kind, []).append(d)
    f = by_kind["file"][0]
    assert f.user == '"""Tools for numbers."""' and f.assistant.startswith("import math")
    funcs = {d.assistant.split("(")[0]: d for d in by_kind["function"]}
    assert funcs["def fib"].assistant.startswith("def fib(n):\n    \"\"\"Return")
    assert funcs["def area"].assistant.startswith("def area(self):\n")        # a method comes out dedented
    for d in by_kind["function"]:
        assert d.user in ("Write a Python function that returns the n-th Fibonacci number.",
                          "Return the n-th Fibonacci number.", "Write a Python function that computes the area.",
                          "Compute the area."), d.user


def test_chat_template_renders_the_training_format(pair):
    """The template in the GGUF must render what the corpus trained on, or served prompts are unseen text."""
    from daemons.chat_template import ChatTemplate
    from models.recipe.corpus import chatml
    model, _ = pair
    tmpl = ChatTemplate.from_metadata(model.metadata)
    msgs = [("user", "def add(a, b):"), ("assistant", "    return a + b\n"), ("user", "Write a Python function.")]
    got = tmpl.render([{"role": r, "content": c} for r, c in msgs], add_generation_prompt=True)
    assert got == chatml(msgs, add_generation_prompt=True)
    assert got.endswith("<|im_start|>assistant\n")


def test_tokenizer_specials_and_serving_ids(pair, report, run_dir):
    from daemons.tokenizer import Tokenizer
    from models.recipe.tokenizer import SPECIAL_TOKENS, MASK_TOKEN, load_tokenizer
    model, draft = pair
    tok = Tokenizer.from_metadata(model.metadata)
    hf = load_tokenizer(run_dir / "hf_target")
    for t in SPECIAL_TOKENS:
        assert tok.token_id(t) == hf.token_to_id(t) is not None, t
    assert draft.mask_token_id == tok.token_id(MASK_TOKEN)
    assert tok.token_id("<|im_end|>") in tok.stop_ids
    assert report["measure"]["tokenizer_check"]["mismatched"] == 0
    text = "def parse(line):\n    return [int(x) for x in line.split(',')]  # ünïcode\n"
    assert tok.encode(text, add_special=False) == hf.encode(text).ids


def test_byte_estimate_bounds_the_files(report):
    plan, export = report["target"]["byte_plan"], report["export"]
    assert plan["target_bytes_estimate"] >= export["target_bytes"]
    assert plan["draft_bytes_estimate"] >= export["draft_bytes"]
    assert export["total_bytes"] <= 25_000_000


def test_full_size_pair_fits_the_budget():
    """The real run's sizes (computed, not trained): target + draft at q8_0 within 25 MB, with the
    target qwen35-shaped (>= 8 layers, full attention every 4th) and the draft 1-3 layers."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    from models.recipe.run import byte_plan
    from models.recipe.train_draft import DRAFT_SIZES
    from models.recipe.train_target import TARGET_SIZES, make_target_config
    size = TARGET_SIZES["full"]
    cfg = make_target_config(size, 8192, bos_id=8184, eos_id=8186, pad_id=8184)
    with torch.device("meta"):                           # shapes only: no 16M-parameter initialisation
        model = Qwen3_5ForCausalLM(cfg)
    assert cfg.num_hidden_layers >= 8 and cfg.layer_types[3] == "full_attention" and cfg.layer_types[2] == "linear_attention"
    assert 1 <= DRAFT_SIZES["full"].layers <= 3 and DRAFT_SIZES["full"].block_size in (8, 16)
    plan = byte_plan(model, DRAFT_SIZES["full"], "q8_0", 8192, 8184)
    assert plan["total_bytes_estimate"] <= 25_000_000
    assert plan["target_params"] > 10_000_000          # a real model, not a toy


def test_torch_draft_module_matches_the_loader(run_dir, report, pair):
    """The module the recipe trains must compute what daemons.dflash runs: load the exported z-lab
    directory with the loader, the same weights into the torch module, and compare block logits."""
    import torch

    from daemons.dflash import DFlashDraft
    from daemons.gguf_reader import GGUFFile
    from models.recipe.train_draft import DRAFT_SIZES, DFlashDraftTorch
    model, _ = pair
    zdir = run_dir / "draft_zlab"
    loaded = DFlashDraft.load(zdir, model)               # f32 weights, the target's q8_0 embedding/head
    d = report["draft"]
    size = DRAFT_SIZES["micro"]
    module = DFlashDraftTorch(model.hparams.n_embd, size, d["target_layer_ids"], d["mask_token_id"])
    from safetensors.torch import load_file
    module.load_state_dict(load_file(str(zdir / "model.safetensors")))
    module.eval()
    with GGUFFile(run_dir / report["export"]["target_file"]) as g:
        embd = torch.from_numpy(np.ascontiguousarray(g.tensors["token_embd.weight"].dequantize()))
    rng = np.random.default_rng(0)
    n, B = 13, size.block_size
    feats = rng.standard_normal((n, loaded.feature_width)).astype(np.float32)
    anchor = 7
    want = loaded.block_logits_direct(anchor, n, feats, np.arange(n))
    with torch.no_grad():
        tok = torch.tensor([[anchor] + [d["mask_token_id"]] * (B - 1)])
        ctx = module.context(torch.from_numpy(feats)[None])
        mask = torch.ones(1, B, n + B, dtype=torch.bool)
        h = module(torch.nn.functional.embedding(tok, embd), torch.arange(n, n + B)[None], ctx,
                   torch.arange(n)[None], mask)
        got = (h @ embd.t())[0, 1:].numpy()
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * float(np.abs(want).max()))
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_blocks_see_only_their_past_and_themselves():
    """The training mask: block j sees context positions < its anchor and its own rows, nothing else."""
    import torch

    from models.recipe.train_draft import make_blocks
    x = torch.arange(40)[None].repeat(2, 1)
    anchors, tok, pos, mask = make_blocks(x, 3, 4, 99, torch.Generator().manual_seed(0))
    T, B = 40, 4
    for n in range(2):
        for j, a in enumerate(anchors[n].tolist()):
            assert tok[n, j * B].item() == a and (tok[n, j * B + 1:(j + 1) * B] == 99).all()
            assert pos[n, j * B:(j + 1) * B].tolist() == list(range(a, a + B))
            for r in range(j * B, (j + 1) * B):
                ctx = mask[n, r, :T]
                assert ctx[:a].all() and not ctx[a:].any()
                blk = mask[n, r, T:]
                assert blk[j * B:(j + 1) * B].all() and blk.sum() == B


def test_loop_acceptance_length_counts_steps_not_anchors():
    """Guards the 2026-11-29 puzzle (training estimate 4.15, served AL 1.37): the uniform-anchor
    estimate weights a long-accepting position as much as a failing one, but the loop spends one step
    on a stretch it accepts whole. Here blocks at positions 0..7 (B = 4): position 0 accepts all 3
    rows, everything else none; the loop takes 1 + 4 steps for 8 tokens (AL 1.6), uniform says 1.375."""
    import torch

    from models.recipe.train_draft import acceptance_estimate, loop_acceptance_length
    B, V, A = 4, 5, 8
    anchors = torch.arange(A)[None]
    labels = torch.zeros(1, A + B, dtype=torch.long)          # every label is token 0
    logits = torch.zeros(1, A, B, V)
    logits[..., 1] = 1.0                                       # the draft says 1: wrong ...
    logits[0, 0, :, 0] = 2.0                                   # ... except the block at position 0
    assert acceptance_estimate(logits, labels, anchors)["estimated_al"] == 1.375
    assert loop_acceptance_length(logits, labels, anchors) == 1.6
    with pytest.raises(ValueError):
        loop_acceptance_length(logits[:, ::2], labels, anchors[:, ::2])


def test_speculative_decoding_of_the_pair_equals_greedy(pair, report, run_dir):
    """Checked here again with the loaded files (not only trusted from the report)."""
    from daemons.chat_template import ChatTemplate
    from daemons.dflash import DFlashDrafter
    from daemons.generate import GenerationRequest, generate_all
    from daemons.speculative import SpecParams, SpeculativeDecoder
    from daemons.tokenizer import Tokenizer
    m = report["measure"]
    assert m["all_identical_to_ar"] and m["n_identical"] == m["n_prompts"] >= 8
    assert m["steps"] > 0 and m["acceptance_length"] >= 1.0
    model, draft = pair
    tok = Tokenizer.from_metadata(model.metadata)
    tmpl = ChatTemplate.from_metadata(model.metadata)
    prompts = json.loads((run_dir / "prompts.json").read_text())["measure_prompts"][:3]
    for p in prompts:
        ids = tok.encode(tmpl.render([{"role": "user", "content": p["user"]}], add_generation_prompt=True),
                         add_special=False, parse_special=True)
        req = GenerationRequest(prompt_ids=tuple(ids), max_tokens=20, stop_ids=tok.stop_ids, max_ctx=len(ids) + 40)
        ar = generate_all(model, tok, req)
        sp = generate_all(model, tok, req, speculative=SpeculativeDecoder(model, DFlashDrafter(draft), SpecParams()))
        assert sp.token_ids == ar.token_ids and sp.stats.spec["steps"] > 0


def test_exported_names_are_the_ones_demo_picks(run_dir, report, monkeypatch):
    """`dflashd demo` / `serve` find the shipped pair in models/ by name (*target*.gguf, *draft*.gguf)."""
    import daemons.cli as cli
    monkeypatch.setattr(cli, "MODELS_DIR", run_dir)
    target, draft = cli.default_model_paths()
    assert target.name == report["export"]["target_file"]
    assert draft is not None and draft.name == report["export"]["draft_file"]


def test_bigram_baseline_is_add_k_counting():
    """The baseline in the model card: p(b|a) = (c(ab) + k) / (c(a) + kV) over the scored positions."""
    from models.recipe.train_target import bigram_nll
    train = np.array([0, 1, 0, 1, 0, 2, 2, 1])
    windows = np.array([[0, 1, 2], [2, 2, 0]])
    V, k = 3, 0.5
    c = {(0, 1): 2, (1, 0): 2, (0, 2): 1, (2, 2): 1, (2, 1): 1}
    first = {0: 3, 1: 2, 2: 2}
    pairs = [(0, 1), (1, 2), (2, 2), (2, 0)]
    want = -np.mean([math.log((c.get(p, 0) + k) / (first[p[0]] + k * V)) for p in pairs])
    got = bigram_nll(train, windows, V, k=k)
    assert got["k"] == k and math.isclose(got["nll"], want, rel_tol=1e-12)
