"""Speculative vs autoregressive decoding on the CPU: decode tok/s and acceptance length (AL).

Run:  .venv/bin/python tests/bench/bench_spec_cpu.py [--size tiny|small] [--prompts 4] [--tokens 64]
                                                       [--block 16] [--threads N]
      .venv/bin/python tests/bench/bench_spec_cpu.py --target T.gguf --draft D.gguf   # a real pair

Without --target, a random qwen35 target is built with transformers (tiny: the test model, d=64,
4 layers; small: d=512, 8 layers, Q8_0) and a random DFlash draft for it (tests/dflash_fixtures.py).
Rows:
- AR: plain greedy decoding;
- dflash: the DFlash draft (random weights: it predicts nothing, AL ~ 1, so this row is the cost of
  drafting + verifying for no gain);
- oracle-corrupt: a proposer that knows the greedy continuation and corrupts each proposal at a
  random depth (AL ~ half the block);
- oracle: the same without corruption, the upper bound (AL = block size): what the loop delivers
  when every draft token is accepted, so the gap to AR x AL is the machinery's overhead.
Every speculative row is checked to produce exactly the AR tokens. Not collected by pytest.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numba
import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from daemons.dflash import DFlashDraft, DFlashDrafter  # noqa: E402
from daemons.generate import GenerationRequest, generate_all  # noqa: E402
from daemons.qwen35 import Qwen35Model  # noqa: E402
from daemons.speculative import OracleDrafter, SpecParams, SpeculativeDecoder  # noqa: E402

SIZES = {
    "tiny": dict(config={"num_hidden_layers": 4}, outtype="f32",
                 draft=dict(n_layer=2, n_head=4, n_head_kv=2, head_dim=16, n_ff=96)),
    "small": dict(config={"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
                          "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                          "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 64,
                          "linear_value_head_dim": 64},
                  outtype="q8_0", draft=dict(n_layer=2, n_head=8, n_head_kv=2, head_dim=64, n_ff=1536)),
}


class _Pieces:
    def __init__(self, tokenizer=None):
        pass

    def push(self, t):
        return ""

    def flush(self):
        return ""


def _run(model, prompt, n_tokens, speculative=None):
    req = GenerationRequest(prompt_ids=tuple(prompt), max_tokens=n_tokens)
    return generate_all(model, None, req, decoder_factory=_Pieces, speculative=speculative)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--target", default=None, help="a qwen35 GGUF (default: build a random one)")
    parser.add_argument("--draft", default=None, help="a DFlash draft for --target (default: a random one)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--block", type=int, default=16, help="block size of the random draft and the oracle")
    parser.add_argument("--margin", type=float, default=0.0, help="draft_margin for the dflash row")
    parser.add_argument("--threads", type=int, default=None, help="numba threads (default: all cores)")
    args = parser.parse_args()
    if args.threads:
        numba.set_num_threads(args.threads)

    tmp = tempfile.mkdtemp(prefix="bench-spec-")
    if args.target is None:
        from tests.dflash_fixtures import draft_forms
        from tests.qwen35_fixtures import build_tiny_qwen35
        size = SIZES[args.size]
        t0 = time.perf_counter()
        _, target_path, _ = build_tiny_qwen35(tmp, size["config"], outtype=size["outtype"])
        model = Qwen35Model.load(target_path)
        ids = tuple(model.hparams.n_layer // 4 * k + 1 for k in range(3))
        draft_path = draft_forms(tmp, model.hparams, block_size=args.block, target_layer_ids=ids,
                                 **size["draft"])["dflash"]
        print(f"built a random '{args.size}' target and draft in {time.perf_counter() - t0:.1f}s")
    else:
        model = Qwen35Model.load(args.target)
        draft_path = args.draft
    hp = model.hparams
    draft = DFlashDraft.load(draft_path, model) if draft_path else None
    block = draft.block_size if draft is not None else args.block
    print(f"target: d={hp.n_embd}, {hp.n_layer} layers, vocab {hp.n_vocab}; draft: "
          + (f"{draft.config.n_layer} layers, block {block}, features from layers {list(draft.target_layer_ids)}"
             if draft else "none"))
    print(f"numba threads {numba.get_num_threads()}; {args.prompts} prompts x {args.tokens} tokens, "
          f"prompt length {args.prompt_len}")

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, min(hp.n_vocab, 1000), size=args.prompt_len).tolist() for _ in range(args.prompts)]
    _run(model, prompts[0], 4)                                     # compile / warm
    rows: dict[str, list] = {}
    for i, prompt in enumerate(prompts):
        ar = _run(model, prompt, args.tokens)
        rows.setdefault("AR", []).append((ar.stats, None))
        makers = {"oracle": lambda: OracleDrafter(len(prompt), ar.token_ids, block, hp.n_vocab, corrupt=False),
                  "oracle-corrupt": lambda: OracleDrafter(len(prompt), ar.token_ids, block, hp.n_vocab, seed=i)}
        if draft is not None:
            makers["dflash"] = lambda: DFlashDrafter(draft)
        for name, make in makers.items():
            params = SpecParams(draft_margin=args.margin) if name == "dflash" else SpecParams()
            res = _run(model, prompt, args.tokens, SpeculativeDecoder(model, make(), params))
            if res.token_ids != ar.token_ids:
                raise SystemExit(f"BUG: {name} output differs from AR on prompt {i}")
            rows.setdefault(name, []).append((res.stats, res.stats.spec))

    print(f"\n{'mode':16s} {'tok/s':>8s} {'vs AR':>6s} {'AL':>6s} {'steps':>6s} {'drafted':>8s} {'accepted':>9s}")
    ar_rate = None
    for name in ("AR", "dflash", "oracle-corrupt", "oracle"):
        if name not in rows:
            continue
        stats = [s for s, _ in rows[name]]
        decoded = sum(s.generated_tokens - 1 for s in stats)
        rate = decoded / sum(s.decode_s for s in stats)
        ar_rate = ar_rate or rate
        specs = [sp for _, sp in rows[name] if sp is not None]
        if specs:
            steps = sum(sp["steps"] for sp in specs)
            acc = sum(sp["accepted"] for sp in specs)
            drafted = sum(sp["drafted"] for sp in specs)
            al = (acc + steps) / steps if steps else 0.0
            print(f"{name:16s} {rate:8.1f} {rate / ar_rate:6.2f} {al:6.2f} {steps:6d} {drafted:8d} {acc:9d}")
        else:
            print(f"{name:16s} {rate:8.1f} {1.0:6.2f} {'-':>6s} {'-':>6s} {'-':>8s} {'-':>9s}")


if __name__ == "__main__":
    main()
