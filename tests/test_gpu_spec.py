"""DFlash chain speculative decoding on the CUDA backend, and `--device cuda:N` through the CLI.

Skipped at collection without CuPy or a GPU (the dev/CI machines); run on the GPU machine. Guards:
- speculative output on the GPU drifting from GPU greedy decoding (verify logits that depend on the
  batch width, or a rollback of GPU-resident state that is not exact) — checked with an oracle
  proposer that makes every acceptance length occur, and with a real (random) DFlash draft;
- `dflashd generate --device cuda:0` (with and without `--draft`) not reaching the GPU backend, or
  giving other tokens than the CPU (the GPU logits match the CPU's within 1e-3: greedy agrees on
  these models, as tests/test_gpu_model.py shows).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.gpu_helpers import GPU_MARKS

ROOT = Path(__file__).resolve().parent.parent


pytestmark = GPU_MARKS


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from daemons.qwen35 import Qwen35Model
    from daemons.synthetic import write_synthetic_qwen35
    from kernels import get_backend
    from tests.dflash_fixtures import build_zlab_draft

    d = tmp_path_factory.mktemp("gpu_spec")
    target = d / "target.gguf"
    write_synthetic_qwen35(target, "tiny", seed=11)
    model = Qwen35Model.load(target, get_backend("cuda:0"))
    draft = build_zlab_draft(d, model.hparams, target_layer_ids=(1, 3), mask_token_id=260, block_size=8)
    return model, target, draft


def _run(model, prompt, n, speculative=None):
    from daemons.generate import GenerationRequest, generate_all
    from daemons.tokenizer import Tokenizer
    tok = Tokenizer.from_metadata(model.metadata)
    return generate_all(model, tok, GenerationRequest(prompt_ids=tuple(prompt), max_tokens=n),
                        speculative=speculative)


def test_oracle_spec_equals_gpu_greedy(pair):
    from daemons.speculative import OracleDrafter, SpeculativeDecoder
    model, _, _ = pair
    rng = np.random.default_rng(0)
    seen: set[int] = set()
    for i in range(12):
        prompt = rng.integers(0, 256, size=int(rng.integers(3, 40))).tolist()
        greedy = _run(model, prompt, 32)
        oracle = OracleDrafter(len(prompt), greedy.token_ids, 6, model.n_vocab, seed=i)
        spec = _run(model, prompt, 32, SpeculativeDecoder(model, oracle))
        assert spec.token_ids == greedy.token_ids, i
        seen.update(oracle.corrupted_at)
    assert seen == set(range(6))


def test_real_draft_spec_equals_gpu_greedy(pair):
    from daemons.dflash import DFlashDraft, DFlashDrafter
    from daemons.speculative import SpeculativeDecoder
    model, _, draft_dir = pair
    draft = DFlashDraft.load(draft_dir, model, model.backend)
    for seed in range(3):
        prompt = np.random.default_rng(seed).integers(0, 256, size=20).tolist()
        greedy = _run(model, prompt, 40)
        spec = _run(model, prompt, 40, SpeculativeDecoder(model, DFlashDrafter(draft)))
        assert spec.token_ids == greedy.token_ids
        assert spec.stats.spec["steps"] > 0


def _cli_generate(target, device, *extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "daemons.cli", "generate", "-m", str(target), "--tokens",
                        "72,101,108,108,111", "-n", "24", "--json", "--device", device, *extra],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_cli_generate_on_cuda_matches_cpu(pair):
    _, target, draft_dir = pair
    cpu = _cli_generate(target, "cpu")
    gpu = _cli_generate(target, "cuda:0")
    gpu_spec = _cli_generate(target, "cuda:0", "--draft", str(draft_dir))
    assert gpu["tokens"] == cpu["tokens"]
    assert gpu_spec["tokens"] == gpu["tokens"] and gpu_spec["spec"]["steps"] > 0
