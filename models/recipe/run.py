"""The embedded default pair, end to end: corpus -> tokenizer -> target -> draft -> GGUF export ->
measurement on held-out prompts -> report.json and a model card draft.

    python3 models/recipe/run.py --out DIR [--device cuda] [--budget-minutes 22]   # the real pair
    python3 models/recipe/run.py --out DIR --micro                                 # CPU test scale
    python3 models/recipe/run.py --out DIR --skip-measure ...   # train + export only (GPU machine)
    python3 models/recipe/run.py --out DIR --measure-only       # measure an exported pair (CPU)

Stages leave their results in DIR, and a rerun with the same DIR resumes after the last finished
stage (`target.done.json`, `draft.done.json`, the GGUFs), so a run cut by a time limit can go on in a
second command. Seeds are fixed (`--seed`); on CUDA, kernels may still differ in the last bits.
See models/recipe/README.md for running it on the GPU machine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
if "models" not in sys.modules:
    # `models/` has no __init__.py (it holds the shipped GGUFs): pin the name to it, so that an installed
    # top-level package called `models` (some images have one) cannot shadow the recipe's modules.
    import types
    _models = types.ModuleType("models")
    _models.__path__ = [str(REPO_ROOT / "models")]
    sys.modules["models"] = _models

import numpy as np  # noqa: E402

from models.recipe import corpus as corpus_mod  # noqa: E402
from models.recipe import tokenizer as tok_mod  # noqa: E402

BYTE_BUDGET = 25_000_000                 # target + draft GGUFs together (the 25 MB)
TARGET_FILE = "dflashd-stdlib-target-{outtype}.gguf"
# daemons/cli.py default_model_paths: the target matches *target*.gguf, the draft *draft*.gguf
DRAFT_FILE = "dflashd-stdlib-draft-b{block}-{outtype}.gguf"
DEMO_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


class RecipeError(RuntimeError):
    """The recipe cannot go on (one line: what is wrong and what to do)."""


# ------------------------------------------------------------------------------------------------
# settings
# ------------------------------------------------------------------------------------------------

def settings(micro: bool) -> dict[str, Any]:
    """Every size and count the run uses (the report records them)."""
    if micro:
        return dict(size="micro", micro_bytes=300_000, heldout_fraction=0.2, vocab=512, seq_len=64,
                    target_batch=8, target_steps=16, target_lr=4e-3, eval_windows=4, heldout_max_windows=32,
                    prompt_len=20, gen_new=12, gen_prompts=16, eval_prompts=4, gen_batch=16,
                    draft_batch=8, draft_anchors=3, draft_steps=16, draft_lr=3e-3,
                    n_prompts=10, max_new=20, max_prompt_tokens=96, budget_minutes=30.0, amp="bf16")
    return dict(size="full", micro_bytes=None, heldout_fraction=0.05, vocab=8192, seq_len=512,
                target_batch=64, target_steps=200_000, target_lr=2e-3, eval_windows=64, heldout_max_windows=None,
                prompt_len=128, gen_new=384, gen_prompts=16384, eval_prompts=128, gen_batch=512,
                draft_batch=32, draft_anchors=48, draft_steps=200_000, draft_lr=1.5e-3,
                n_prompts=60, max_new=96, max_prompt_tokens=256, budget_minutes=22.0, amp="bf16")


class Log:
    def __init__(self, path: Path):
        self.fh = open(path, "a", encoding="utf-8")
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.fh.write(line + "\n")
        self.fh.flush()


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=float), encoding="utf-8")
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------------------
# stage 1: corpus, tokenizer, token streams, prompts
# ------------------------------------------------------------------------------------------------

def _shuffled(items: list, seed: int) -> list:
    order = np.random.default_rng(seed).permutation(len(items))
    return [items[i] for i in order]


def prepare_data(out: Path, cfg: dict, seed: int, log: Log, stdlib: str | None) -> dict:
    """Corpus + manifest, tokenizer (train split only), token streams, generation / evaluation /
    measurement prompts. Cached in out/tokens.npz and out/prompts.json."""
    hf_dir = out / "hf_target"
    if (out / "tokens.npz").is_file() and (out / "prompts.json").is_file() and (hf_dir / "tokenizer.json").is_file():
        log("[data] reusing tokens.npz, prompts.json and the tokenizer from an earlier run")
        z = np.load(out / "tokens.npz")
        return {"train": z["train"], "heldout": z["heldout"], "gen_prompt_ends": z["gen_prompt_ends"],
                "eval_prompt_ends": z["eval_prompt_ends"], **_read_json(out / "prompts.json")}
    t0 = time.perf_counter()
    corpus = corpus_mod.build_corpus(stdlib, heldout_fraction=cfg["heldout_fraction"], micro_bytes=cfg["micro_bytes"])
    train_files, heldout_files = corpus.split("train"), corpus.split("heldout")
    if not train_files or not heldout_files:
        raise RecipeError(f"the corpus at {corpus.stdlib_dir} gave {len(train_files)} train and "
                          f"{len(heldout_files)} held-out files; both must be non-empty")
    corpus.write_manifest(out / "corpus_manifest.json")
    train_docs = _shuffled(corpus.documents("train"), seed)
    heldout_docs = corpus.documents("heldout")
    log(f"[data] corpus {corpus.stdlib_dir}: {len(train_files)} train / {len(heldout_files)} held-out files, "
        f"{len(train_docs)} / {len(heldout_docs)} documents ({time.perf_counter() - t0:.1f}s)")

    t1 = time.perf_counter()
    texts = [f.text for f in train_files] + [d.user for d in train_docs if d.kind == "function"]
    hf_tok = tok_mod.train_tokenizer(texts, hf_dir, vocab_size=cfg["vocab"], chat_template=corpus_mod.CHAT_TEMPLATE)
    log(f"[data] tokenizer: {hf_tok.get_vocab_size(with_added_tokens=True)} tokens ({time.perf_counter() - t1:.1f}s)")

    t2 = time.perf_counter()
    train_ids = [np.asarray(e.ids, dtype=np.int32) for e in hf_tok.encode_batch([d.text() for d in train_docs])]
    heldout_ids = [np.asarray(e.ids, dtype=np.int32) for e in hf_tok.encode_batch([d.text() for d in heldout_docs])]
    train = np.concatenate(train_ids).astype(np.uint16)
    heldout = np.concatenate(heldout_ids).astype(np.uint16)
    log(f"[data] tokens: {len(train):,} train, {len(heldout):,} held-out "
        f"({sum(f.nbytes for f in train_files) / max(1, len(train)):.2f} source bytes/token, {time.perf_counter() - t2:.1f}s)")

    def prompt_ends(docs: list, ids: list, n: int, rng_seed: int) -> np.ndarray:
        """Stream offsets just past `<|im_start|>assistant\\n` of up to n documents (chosen at random)
        that have at least prompt_len tokens before that point: the generation prompts are the
        prompt_len tokens before each (the user's request and whatever document precedes it)."""
        P = cfg["prompt_len"]
        starts = np.concatenate([[0], np.cumsum([len(x) for x in ids])[:-1]]) if ids else np.zeros(0, dtype=np.int64)
        enc = hf_tok.encode_batch([d.prompt() for d in docs])
        ends = []
        for doc_ids, start, e in zip(ids, starts, enc):
            k = len(e.ids)
            if list(doc_ids[:k]) == e.ids and start + k >= P:
                ends.append(int(start + k))
        ends = np.asarray(ends, dtype=np.int64)
        if len(ends) > n:
            ends = np.sort(np.random.default_rng(rng_seed).choice(ends, size=n, replace=False))
        return ends

    gen_ends = prompt_ends(train_docs, train_ids, cfg["gen_prompts"], seed + 11)
    eval_ends = prompt_ends(heldout_docs, heldout_ids, cfg["eval_prompts"], seed + 12)

    # measurement prompts: held-out requests, two in three for functions, the rest file heads
    def key(d: corpus_mod.Document) -> float:
        return corpus_mod._fraction(f"measure:{d.source}:{d.user}")

    lens = {id(d): len(hf_tok.encode(d.prompt()).ids) for d in heldout_docs}
    ok = [d for d in heldout_docs if lens[id(d)] <= cfg["max_prompt_tokens"]]
    funcs = sorted((d for d in ok if d.kind == "function"), key=key)
    files = sorted((d for d in ok if d.kind == "file"), key=key)
    n = cfg["n_prompts"]
    n_files = min(len(files), n // 3)
    chosen = funcs[:n - n_files] + files[:n_files]
    if len(chosen) < n:
        chosen += files[n_files:n_files + n - len(chosen)]
    prompts = {"measure_prompts": [{"kind": d.kind, "source": d.source, "user": d.user} for d in chosen],
               "tokenizer_check_texts": [d.text() for d in heldout_docs[:200]]}
    np.savez(out / "tokens.npz", train=train, heldout=heldout, gen_prompt_ends=gen_ends, eval_prompt_ends=eval_ends)
    _write_json(out / "prompts.json", prompts)
    return {"train": train, "heldout": heldout, "gen_prompt_ends": gen_ends, "eval_prompt_ends": eval_ends, **prompts}


# ------------------------------------------------------------------------------------------------
# budget
# ------------------------------------------------------------------------------------------------

def byte_plan(target_model: Any, draft_size: Any, outtype: str, n_tokens: int, n_merges: int) -> dict:
    from models.recipe.train_draft import draft_named_shapes
    from models.recipe.train_target import gguf_nbytes, target_named_shapes

    d = target_model.config.hidden_size
    t_shapes = target_named_shapes(target_model)
    d_shapes = draft_named_shapes(d, draft_size)
    t_bytes = gguf_nbytes(t_shapes, outtype, n_tokens, n_merges)
    d_bytes = gguf_nbytes(d_shapes, outtype, n_tokens, n_merges)     # the draft carries the tokenizer too
    plan = {"outtype": outtype, "target_params": int(sum(math.prod(s) for _, s in t_shapes)),
            "draft_params": int(sum(math.prod(s) for _, s in d_shapes)),
            "target_bytes_estimate": t_bytes, "draft_bytes_estimate": d_bytes,
            "total_bytes_estimate": t_bytes + d_bytes, "budget_bytes": BYTE_BUDGET}
    if t_bytes + d_bytes > BYTE_BUDGET:
        raise RecipeError(f"target ({t_bytes:,} B) + draft ({d_bytes:,} B) at {outtype} exceed the "
                          f"{BYTE_BUDGET:,}-byte budget; choose smaller sizes")
    return plan


# ------------------------------------------------------------------------------------------------
# stages 2-4: target, draft, export
# ------------------------------------------------------------------------------------------------

def _special_ids(hf_tok: Any) -> dict[str, int]:
    return {t: hf_tok.token_to_id(t) for t in tok_mod.SPECIAL_TOKENS}


def stage_target(out: Path, cfg: dict, data: dict, device: str, seed: int, budget_s: float, log: Log) -> tuple[Any, dict]:
    import torch

    from models.recipe import train_target as tt
    hf_dir = out / "hf_target"
    done = out / "target.done.json"
    if done.is_file() and (hf_dir / "model.safetensors").is_file():
        from transformers import Qwen3_5ForCausalLM
        log("[target] reusing the trained target from an earlier run")
        model = Qwen3_5ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
        return model, _read_json(done)
    hf_tok = tok_mod.load_tokenizer(hf_dir)
    sp = _special_ids(hf_tok)
    n_tokens = hf_tok.get_vocab_size(with_added_tokens=True)
    vocab = tok_mod.padded_vocab_size(n_tokens)
    size = tt.TARGET_SIZES[cfg["size"]]
    config = tt.make_target_config(size, vocab, bos_id=sp["<|endoftext|>"], eos_id=sp["<|im_end|>"],
                                   pad_id=sp["<|endoftext|>"])
    model = tt.build_target(config, seed, device)
    from models.recipe.train_draft import DRAFT_SIZES
    merges = len(json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))["model"]["merges"])
    plan = byte_plan(model, DRAFT_SIZES[cfg["size"]], cfg["outtype"], vocab, merges)
    log(f"[target] {plan['target_params']:,} parameters; draft {plan['draft_params']:,}; estimated "
        f"{plan['total_bytes_estimate'] / 1e6:.2f} MB together at {cfg['outtype']} (budget {BYTE_BUDGET / 1e6:.0f} MB)")

    L = cfg["seq_len"]
    windows = tt.heldout_windows(data["heldout"], L, cfg["heldout_max_windows"])
    if len(windows) == 0:
        raise RecipeError(f"the held-out split has {len(data['heldout'])} tokens, less than one {L}-token window")
    eval_small = windows[np.random.default_rng(seed + 3).permutation(len(windows))[:cfg["eval_windows"]]]
    log(f"[target] training on {device} for at most {cfg['target_steps']} steps / {budget_s:.0f}s")
    train_log = tt.train_target(model, data["train"], eval_small, device=device, seq_len=L, batch_size=cfg["target_batch"],
                                max_steps=cfg["target_steps"], budget_s=budget_s, lr=cfg["target_lr"], seed=seed,
                                log_every=5 if cfg["size"] == "micro" else 10,
                                eval_every_steps=8 if cfg["size"] == "micro" else None, log=log)
    log(f"[target] {train_log.steps} steps, {train_log.tokens:,} tokens in {train_log.seconds:.0f}s "
        f"(stopped by {train_log.stopped_by})")
    t0 = time.perf_counter()
    nll = tt.model_nll(model, windows, device=device, batch_size=cfg["target_batch"])
    bigram = tt.bigram_nll(data["train"], windows, vocab)
    log(f"[target] held-out perplexity {math.exp(nll):.2f} vs bigram {math.exp(bigram['nll']):.2f} "
        f"(k={bigram['k']}) on {windows.size - len(windows):,} tokens ({time.perf_counter() - t0:.1f}s)")
    model.save_pretrained(hf_dir, safe_serialization=True)
    result = {"config": {k: v for k, v in json.loads((hf_dir / "config.json").read_text()).items()},
              "size": cfg["size"], "byte_plan": plan, "vocab_tokens": n_tokens, "vocab_padded": vocab,
              "train_tokens": int(len(data["train"])), "heldout_tokens": int(len(data["heldout"])),
              "training": train_log.to_dict(), "device": device,
              "heldout_eval": {"windows": int(len(windows)), "seq_len": L, "scored_tokens": int(windows.size - len(windows)),
                               "target_nll": nll, "target_ppl": math.exp(nll),
                               "bigram_nll": bigram["nll"], "bigram_ppl": math.exp(bigram["nll"]),
                               "bigram_k": bigram["k"], "bigram_validation_nll_by_k": bigram["validation_nll_by_k"]}}
    _write_json(done, result)
    return model.eval(), result


def stage_draft(out: Path, cfg: dict, data: dict, target: Any, device: str, seed: int, budget_s: float,
                log: Log) -> dict:
    import torch

    from models.recipe import train_draft as td
    zdir = out / "draft_zlab"
    done = out / "draft.done.json"
    if done.is_file() and (zdir / "model.safetensors").is_file():
        log("[draft] reusing the trained draft from an earlier run")
        return _read_json(done)
    size = td.DRAFT_SIZES[cfg["size"]]
    n_layer = target.config.num_hidden_layers
    ids = td.draft_layer_ids(n_layer, size.n_features)
    hf_tok = tok_mod.load_tokenizer(out / "hf_target")
    mask_id = hf_tok.token_to_id(tok_mod.MASK_TOKEN)
    torch.manual_seed(seed + 5)
    draft = td.DFlashDraftTorch(target.config.hidden_size, size, ids, mask_id).to(device)
    P, G = cfg["prompt_len"], cfg["gen_new"]
    T = P + G
    if G < size.block_size:
        raise RecipeError(f"gen_new {G} must be at least the block size {size.block_size} (anchors lie in the generated part)")
    stream = torch.from_numpy(data["train"].astype(np.int64)).to(device)
    held = torch.from_numpy(data["heldout"].astype(np.int64)).to(device)

    def prompts(src: Any, ends: np.ndarray) -> Any:
        e = torch.from_numpy(np.asarray(ends, dtype=np.int64)).to(device)
        return src[e[:, None] - P + torch.arange(P, device=device)[None]]

    gen_prompts = prompts(stream, data["gen_prompt_ends"])
    eval_prompts = prompts(held, data["eval_prompt_ends"])
    if len(eval_prompts) == 0 or len(gen_prompts) == 0:
        raise RecipeError("no chat prompts with enough preceding tokens for draft training / evaluation")
    offsets = torch.arange(T, device=device)

    def train_windows(rng: np.random.Generator, n: int) -> Any:
        starts = torch.from_numpy(rng.integers(0, len(data["train"]) - T, size=n)).to(device)
        return stream[starts[:, None] + offsets[None]]

    log(f"[draft] {size.layers} layer(s), block {size.block_size}, reads target layers {ids}; "
        f"{sum(p.numel() for p in draft.parameters()):,} parameters; budget {budget_s:.0f}s")
    gen_budget = 0.35 * budget_s
    dlog = td.train_draft(draft, target, train_windows=train_windows, gen_prompts=gen_prompts, eval_prompts=eval_prompts,
                          device=device, n_new=G, gen_budget_s=gen_budget, gen_batch=cfg["gen_batch"],
                          batch_size=cfg["draft_batch"], n_anchors=cfg["draft_anchors"], max_steps=cfg["draft_steps"],
                          budget_s=budget_s, lr=cfg["draft_lr"], seed=seed + 6,
                          log_every=5 if cfg["size"] == "micro" else 10,
                          eval_every_steps=8 if cfg["size"] == "micro" else None, log=log)
    td.save_zlab(draft, zdir, n_vocab=target.config.vocab_size, n_target_layers=n_layer)
    result = {"size": cfg["size"], "block_size": size.block_size, "layers": size.layers, "target_layer_ids": ids,
              "mask_token_id": mask_id, "params": int(sum(p.numel() for p in draft.parameters())),
              "training": dlog.to_dict(), "device": device}
    _write_json(done, result)
    return result


def _cli_convert(src: Path, dst: Path, outtype: str, target_gguf: Path | None, log: Log) -> None:
    """`dflashd convert` (the CLI itself, as a user would run it)."""
    args = [sys.executable, "-m", "daemons.cli", "convert", str(src), str(dst), "--outtype", outtype]
    if target_gguf is not None:
        args += ["--target", str(target_gguf)]
    r = subprocess.run(args, cwd=str(REPO_ROOT), capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")))
    if r.returncode != 0:
        raise RecipeError(f"dflashd convert {src.name} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    log(f"[export] {r.stdout.strip()}")


def stage_export(out: Path, cfg: dict, block: int, log: Log) -> dict:
    outtype = cfg["outtype"]
    tpath = out / TARGET_FILE.format(outtype=outtype)
    dpath = out / DRAFT_FILE.format(block=block, outtype=outtype)
    if not tpath.is_file():
        _cli_convert(out / "hf_target", tpath, outtype, None, log)
    if not dpath.is_file():
        _cli_convert(out / "draft_zlab", dpath, outtype, tpath, log)
    sizes = {"target_file": tpath.name, "draft_file": dpath.name, "target_bytes": tpath.stat().st_size,
             "draft_bytes": dpath.stat().st_size}
    sizes["total_bytes"] = sizes["target_bytes"] + sizes["draft_bytes"]
    if sizes["total_bytes"] > BYTE_BUDGET:
        raise RecipeError(f"the exported pair is {sizes['total_bytes']:,} bytes, over the {BYTE_BUDGET:,}-byte budget")
    log(f"[export] {tpath.name} {sizes['target_bytes'] / 1e6:.2f} MB + {dpath.name} {sizes['draft_bytes'] / 1e6:.2f} MB "
        f"= {sizes['total_bytes'] / 1e6:.2f} MB")
    return sizes


# ------------------------------------------------------------------------------------------------
# stage 5: measurement (the serving code on the CPU)
# ------------------------------------------------------------------------------------------------

def measure(out: Path, cfg: dict, prompts: dict, export: dict, log: Log, device: str = "cpu") -> dict:
    """Greedy AR vs DFlash chain decoding of the held-out prompts with the exported pair, through
    daemons.generate / daemons.speculative / daemons.dflash: token identity, AL, speeds."""
    from daemons.chat_template import ChatTemplate
    from daemons.dflash import DFlashDraft, DFlashDrafter
    from daemons.generate import GenerationRequest, generate_all
    from daemons.qwen35 import Qwen35Model
    from daemons.speculative import SpecParams, SpeculativeDecoder
    from daemons.tokenizer import Tokenizer
    from kernels import get_backend

    if cfg["size"] == "micro":
        import numba
        numba.set_num_threads(1)          # a tiny model is latency-bound: the thread pool only adds wake-ups
    backend = get_backend(device)
    model = Qwen35Model.load(out / export["target_file"], backend)
    draft = DFlashDraft.load(out / export["draft_file"], model)
    tok = Tokenizer.from_metadata(model.metadata, source=export["target_file"])
    template = ChatTemplate.from_metadata(model.metadata)
    tok_check = tok_mod.check_against_runtime(tok_mod.load_tokenizer(out / "hf_target"), tok,
                                              prompts["tokenizer_check_texts"])
    log(f"[measure] tokenizer check: {tok_check['mismatched']} of {tok_check['texts']} held-out documents "
        f"tokenize differently at serving time")
    max_new = cfg["max_new"]

    def run_one(user: str) -> dict:
        text = template.render([{"role": "user", "content": user}], add_generation_prompt=True)
        ids = tok.encode(text, add_special=False, parse_special=True)
        req = GenerationRequest(prompt_ids=tuple(ids), max_tokens=max_new, stop_ids=tok.stop_ids,
                                max_ctx=len(ids) + max_new + draft.block_size + 1)
        ar = generate_all(model, tok, req)
        spec = SpeculativeDecoder(model, DFlashDrafter(draft), SpecParams())
        sp = generate_all(model, tok, req, speculative=spec)
        return {"prompt_tokens": len(ids), "ar": ar, "spec": sp}

    rows = []
    agg = {"drafted": 0, "accepted": 0, "steps": 0, "accepted_per_position": [0] * (draft.block_size - 1)}
    ar_tokens = ar_s = sp_tokens = sp_s = 0.0
    t0 = time.perf_counter()
    for i, p in enumerate(prompts["measure_prompts"]):
        r = run_one(p["user"])
        ar, sp = r["ar"], r["spec"]
        st = sp.stats.spec
        identical = ar.token_ids == sp.token_ids and ar.finish_reason == sp.finish_reason
        for k in ("drafted", "accepted", "steps"):
            agg[k] += st[k]
        for j, a in enumerate(st["accepted_per_position"]):
            agg["accepted_per_position"][j] += a
        ar_tokens += max(0, ar.stats.generated_tokens - 1)
        ar_s += ar.stats.decode_s
        sp_tokens += max(0, sp.stats.generated_tokens - 1)
        sp_s += sp.stats.decode_s
        rows.append({"kind": p["kind"], "source": p["source"], "prompt_tokens": r["prompt_tokens"],
                     "generated": len(ar.token_ids), "finish": ar.finish_reason, "identical": identical,
                     "acceptance_length": round(st["acceptance_length"], 3), "steps": st["steps"]})
        if not identical:
            log(f"[measure] MISMATCH on prompt {i} ({p['source']}): AR {list(ar.token_ids)[:12]}... "
                f"spec {list(sp.token_ids)[:12]}...")
    steps = max(1, agg["steps"])
    als = [r["acceptance_length"] for r in rows if r["steps"]]
    demo = run_one(DEMO_PROMPT)
    result = {
        "device": f"{device} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "n_prompts": len(rows), "max_new_tokens": max_new, "block_size": draft.block_size,
        "draft_max": draft.block_size - 1, "all_identical_to_ar": all(r["identical"] for r in rows),
        "n_identical": sum(r["identical"] for r in rows),
        "acceptance_length": (agg["accepted"] + agg["steps"]) / steps,
        "mean_prompt_acceptance_length": float(np.mean(als)) if als else 0.0,
        "acceptance_rate": agg["accepted"] / max(1, agg["drafted"]),
        "accepted_per_position_rate": [a / steps for a in agg["accepted_per_position"]],
        **agg,
        "ar_decode_tok_s": ar_tokens / ar_s if ar_s else 0.0,
        "spec_decode_tok_s": sp_tokens / sp_s if sp_s else 0.0,
        "seconds": round(time.perf_counter() - t0, 1),
        "tokenizer_check": tok_check,
        "demo": {"prompt": DEMO_PROMPT, "text": demo["spec"].text, "identical": demo["ar"].token_ids == demo["spec"].token_ids,
                 "acceptance_length": demo["spec"].stats.spec["acceptance_length"]},
        "prompts": rows,
    }
    log(f"[measure] {len(rows)} held-out prompts: AL {result['acceptance_length']:.2f} "
        f"(per-prompt mean {result['mean_prompt_acceptance_length']:.2f}), identical to AR: "
        f"{result['n_identical']}/{len(rows)}; AR {result['ar_decode_tok_s']:.1f} tok/s, spec "
        f"{result['spec_decode_tok_s']:.1f} tok/s ({result['seconds']:.0f}s)")
    log(f"[measure] demo answer: {demo['spec'].text[:200]!r}")
    return result


# ------------------------------------------------------------------------------------------------
# report and model card
# ------------------------------------------------------------------------------------------------

def _curve_rows(curve: list[dict], key: str, n: int = 8) -> list[dict]:
    if len(curve) <= n:
        return curve
    idx = sorted({int(round(i * (len(curve) - 1) / (n - 1))) for i in range(n)})
    return [curve[i] for i in idx]


def model_card(report: dict) -> str:
    t, d, m, e = report["target"], report["draft"], report.get("measure"), report["export"]
    c = t["config"]
    he = t["heldout_eval"]
    man = report["corpus"]
    skipped = ", ".join(f"{k}: {v}" for k, v in man["skipped"].items()) or "none"
    lines = [
        "# The embedded default pair: dflashd-stdlib target + DFlash draft",
        "",
        "A tiny `qwen35` model (Gated DeltaNet + gated attention) trained from scratch on the Python standard "
        "library, and a DFlash block-diffusion draft trained against it, so that `dflashd demo` and `dflashd serve` "
        "run a real model with real speculative decoding on a CPU. It writes Python-looking code; it is not a "
        "useful assistant. Recipe: `models/recipe/` (one command, fixed seeds).",
        "",
        "## Files",
        "",
        f"| file | bytes |",
        f"| --- | --- |",
        f"| `{e['target_file']}` | {e['target_bytes']:,} |",
        f"| `{e['draft_file']}` | {e['draft_bytes']:,} |",
        f"| together | {e['total_bytes']:,} (budget {BYTE_BUDGET:,}) |",
        "",
        "## Data and split",
        "",
        f"The `.py` sources and text docs (`.txt`, `.rst`, `.md`) of the standard library of Python "
        f"{man['python_version']} (`{man['stdlib_dir']}`), files over 1 MiB, non-UTF-8, with a line over 1000 "
        f"characters or containing `<|...|>` skipped ({skipped}). Split **by file**: `{man['split_rule']}`; "
        f"held-out files are never seen in training (nor by the tokenizer). Train: {man['train']['n_files']} files, "
        f"{man['train']['bytes']:,} bytes, {t['train_tokens']:,} tokens; held-out: {man['heldout']['n_files']} files, "
        f"{man['heldout']['bytes']:,} bytes, {t['heldout_tokens']:,} tokens. Manifest: `corpus_manifest.json` of the run.",
        "",
        "Documents are chat exchanges (ChatML): per file, the user message is the file's head (comments and module "
        "docstring, or its first lines) and the assistant continues the file; per documented function or class, "
        "the user message is a request made from the docstring's first sentence (\"Write a Python function that "
        "returns ...\") and the assistant writes the definition. So a chat request is answered with code.",
        "",
        "**Licence of the data:** the Python standard library is distributed under the Python Software Foundation "
        "License (PSF-2.0); the weights are a derivative of it.",
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE (HF `tokenizers`), Qwen's `qwen35` pre-tokenizer split, {t['vocab_tokens']} tokens "
        f"(embedding padded to {t['vocab_padded']}), trained on the train split. Special tokens: "
        f"{', '.join('`' + s + '`' for s in tok_mod.SPECIAL_TOKENS)} (`{tok_mod.MASK_TOKEN}` is the DFlash mask). "
        f"Chat template: ChatML (`<|im_start|>role\\n...<|im_end|>`), generation prompt `<|im_start|>assistant\\n`.",
        "",
        "## Architecture",
        "",
        f"Target: `Qwen3_5ForCausalLM`, {c['num_hidden_layers']} layers (full attention every "
        f"{c.get('full_attention_interval', 4)}th, Gated DeltaNet otherwise), hidden {c['hidden_size']}, FFN "
        f"{c['intermediate_size']}, {c['num_attention_heads']} query / {c['num_key_value_heads']} KV heads of "
        f"{c['head_dim']}, DeltaNet {c['linear_num_key_heads']} key / {c['linear_num_value_heads']} value heads of "
        f"{c['linear_key_head_dim']}, tied embeddings; **{t['byte_plan']['target_params']:,} parameters**.",
        "",
        f"Draft: z-lab `DFlashDraftModel` layout, {d['layers']} layer(s), block size {d['block_size']}, mask token "
        f"id {d['mask_token_id']}, reads target layers {d['target_layer_ids']} (outputs after the FFN residual); "
        f"uses the target's embedding and head; **{d['params']:,} parameters**. Both exported with "
        f"`dflashd convert --outtype {e['outtype']}`.",
        "",
        "## Training",
        "",
        f"Device: {report['device_name']}. Target: {t['training']['steps']} steps of {report['settings']['target_batch']} × "
        f"{report['settings']['seq_len']} tokens ({t['training']['tokens']:,} tokens) in {t['training']['seconds']:.0f} s, "
        f"AdamW + cosine, peak lr {report['settings']['target_lr']}, stopped by {t['training']['stopped_by']}. "
        f"Draft: {d['training']['steps']} steps in {d['training']['seconds']:.0f} s (of which "
        f"{d['training']['generation_seconds']:.0f} s generating {d['training']['generated_windows']} greedy "
        f"continuations with the target), random anchors, masked blocks, same-position cross-entropy against the "
        f"target's greedy tokens, target embedding and head frozen. The command that finished the run took "
        f"{report['seconds']:.0f} s in all (data, both trainings, export).",
        "",
        "Target loss (train, nats/token):",
        "",
        "| step | tokens | train loss |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {r['step']} | {r['tokens']:,} | {r['train_loss']:.3f} |" for r in _curve_rows(t["training"]["curve"], "train_loss")]
    lines += ["", "Target held-out loss during training:", "", "| step | held-out loss |", "| --- | --- |"]
    lines += [f"| {r['step']} | {r['heldout_loss']:.3f} |" for r in _curve_rows(t["training"]["eval_curve"], "heldout_loss")]
    lines += ["", "Draft (held-out greedy continuations): loss and estimated acceptance length:", "",
              "| step | loss | estimated AL | row-1 accuracy |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['step']} | {r['loss']:.3f} | {r['estimated_al']:.2f} | {r['position_accuracy'][0]:.3f} |"
              for r in _curve_rows(d["training"]["eval_curve"], "loss")]
    lines += ["", "## Held-out perplexity", "",
              f"On {he['scored_tokens']:,} held-out tokens ({he['windows']} windows of {he['seq_len']}):", "",
              "| model | perplexity |", "| --- | --- |",
              f"| target | {he['target_ppl']:.2f} |",
              f"| add-k bigram (k = {he['bigram_k']}, train split) | {he['bigram_ppl']:.2f} |", ""]
    if m is not None:
        lines += ["## Measured acceptance", "",
                  f"DFlash chain decoding through `daemons.speculative` on {m['n_prompts']} held-out chat prompts, "
                  f"{m['max_new_tokens']} new tokens at most, greedy, block size {m['block_size']}, on {m['device']}: "
                  f"**acceptance length {m['acceptance_length']:.2f}** (tokens per verify step, bonus included; "
                  f"per-prompt mean {m['mean_prompt_acceptance_length']:.2f}), {m['accepted']} of {m['drafted']} "
                  f"drafted tokens accepted; output token-identical to greedy AR on {m['n_identical']}/{m['n_prompts']} "
                  f"prompts. Decode speed: AR {m['ar_decode_tok_s']:.1f} tok/s, speculative {m['spec_decode_tok_s']:.1f} tok/s.",
                  "", "Acceptance by draft position (fraction of verify steps that accepted position k):", "",
                  "| k | " + " | ".join(str(i + 1) for i in range(len(m["accepted_per_position_rate"]))) + " |",
                  "| --- " * (len(m["accepted_per_position_rate"]) + 1) + "|",
                  "| rate | " + " | ".join(f"{r:.2f}" for r in m["accepted_per_position_rate"]) + " |", "",
                  f"`dflashd demo`'s prompt ({m['demo']['prompt']!r}) is answered with:", "", "```",
                  m["demo"]["text"].rstrip(), "```", ""]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------

def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="output directory (created; an earlier run there is resumed)")
    ap.add_argument("--device", default=None, help="torch device for training (default: cuda if available, else cpu)")
    ap.add_argument("--budget-minutes", type=float, default=None,
                    help="wall-clock budget for the whole run, measurement excluded (default 22; micro: step limits)")
    ap.add_argument("--micro", action="store_true", help="tiny corpus subset and models (the CPU test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--outtype", default="q8_0", choices=["f16", "q8_0"])
    ap.add_argument("--stdlib", default=None, help="standard library directory (default: this interpreter's)")
    ap.add_argument("--skip-measure", action="store_true", help="stop after the export (measure later with --measure-only)")
    ap.add_argument("--measure-only", action="store_true", help="measure the pair already exported in --out")
    ap.add_argument("--n-prompts", type=int, default=None, help="held-out prompts to measure (default 60; micro 10)")
    ap.add_argument("--stop-after", choices=["data", "target", "draft"], default=None,
                    help="end after this stage (a later run with the same --out resumes); the stage then gets "
                         "the whole remaining budget")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override one of the settings (see settings() in run.py), e.g. --set gen_prompts=4096")
    args = ap.parse_args(argv)

    cfg = settings(args.micro)
    cfg["outtype"] = args.outtype
    if args.n_prompts is not None:
        cfg["n_prompts"] = args.n_prompts
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in cfg:
            ap.error(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(cfg))}")
        try:
            cfg[key] = json.loads(value)
        except ValueError:
            cfg[key] = value
    budget_min = args.budget_minutes if args.budget_minutes is not None else cfg["budget_minutes"]
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "run.log")
    t_start = time.perf_counter()
    try:
        if args.measure_only:
            report = _read_json(out / "report.json")
            prompts = _read_json(out / "prompts.json")
            if args.n_prompts is not None:
                report["settings"]["n_prompts"] = args.n_prompts
                prompts["measure_prompts"] = prompts["measure_prompts"][:args.n_prompts]
            report["measure"] = measure(out, report["settings"], prompts, report["export"], log)
            _finish(out, report)
            return 0
        import torch

        from models.recipe import train_target
        if cfg["amp"] not in ("bf16", "fp32"):
            raise RecipeError(f"amp must be bf16 or fp32, got {cfg['amp']!r}")
        train_target.AMP = cfg["amp"]
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RecipeError("--device cuda: torch sees no CUDA device")
        torch.manual_seed(args.seed)
        np.random.seed(args.seed)
        budget_s = budget_min * 60.0
        log(f"recipe: {'micro' if args.micro else 'full'} run on {device} into {out}, budget {budget_min:.1f} min")
        data = prepare_data(out, cfg, args.seed, log, args.stdlib)
        if args.stop_after == "data":
            return 0
        # reserve: the target's final evaluation and saving, and the export (seconds)
        remaining = budget_s - (time.perf_counter() - t_start) - (5 if args.micro else 45)
        share = 1.0 if args.stop_after == "target" or (out / "draft.done.json").is_file() else 0.62
        target, tres = stage_target(out, cfg, data, device, args.seed, share * remaining, log)
        if args.stop_after == "target":
            return 0
        remaining = budget_s - (time.perf_counter() - t_start) - (5 if args.micro else 25)
        dres = stage_draft(out, cfg, data, target, device, args.seed, max(30.0, remaining), log)
        if args.stop_after == "draft":
            return 0
        del target
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        export = stage_export(out, cfg, dres["block_size"], log)
        export["outtype"] = cfg["outtype"]
        report = {"recipe": "models/recipe/run.py", "argv": sys.argv[1:] if argv is None else argv, "seed": args.seed,
                  "settings": cfg, "device": device, "device_name": _device_name(device),
                  "python": sys.version.split()[0], "torch": torch.__version__,
                  "transformers": __import__("transformers").__version__,
                  "corpus": {k: v for k, v in _read_json(out / "corpus_manifest.json").items() if k not in ("train", "heldout")}
                  | {s: {k: v for k, v in _read_json(out / "corpus_manifest.json")[s].items() if k != "files"}
                     for s in ("train", "heldout")},
                  "target": tres, "draft": dres, "export": export,
                  "seconds": round(time.perf_counter() - t_start, 1)}
        if not args.skip_measure:
            report["measure"] = measure(out, cfg, data, export, log)
        _finish(out, report)
        return 0
    except RecipeError as e:
        log(f"recipe: error: {e}")
        print(f"run.py: error: {e}", file=sys.stderr)
        return 2


def _finish(out: Path, report: dict) -> None:
    _write_json(out / "report.json", report)
    (out / "MODEL_CARD.md").write_text(model_card(report), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
