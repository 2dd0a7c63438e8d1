"""`dflashd bench` and its synthetic models, on the CPU (the GPU figures come from the device run).

What the tests guard:
- the synthetic Q4_K_M-like file must type every tensor the way llama.cpp's own Q4_K_M quantiser
  does (otherwise "bytes per step" and the comparison with llama.cpp measure a different model):
  checked against llama.cpp's quantiser on the same shape, including the K-quant fall-backs for
  rows that are not whole 256-weight super-blocks;
- the streamed file must be a valid GGUF the model loads (every tensor present, right shapes, the
  padded vocabulary), with random blocks that keep activations finite;
- the command prints every figure the issue asks for, writes them as JSON, and refuses a
  27B-sized synthetic model on the CPU with a one-line usage error.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from daemons.bench import BENCH_PRESETS, q4_k_m_type, write_synthetic_gguf
from daemons.cli import main
from daemons.qwen35 import Qwen35Model
from daemons.synthetic import Qwen35Shape

# 16 layers so that `use_more_bits` picks a non-trivial set (first/last 2, every third between);
# ssm_out / attn_output rows of 128 / 64 weights take the fall-back types.
MIX_SHAPE = Qwen35Shape(n_embd=256, n_layer=16, n_ff=512, n_head=2, n_head_kv=1, head_dim=32, n_k_heads=2,
                        n_v_heads=4, ssm_head_dim=32, n_rot=16)


def test_q4_k_m_mix_matches_llama_cpp_quantiser(tmp_path):
    llama_helpers = pytest.importorskip("tests.llama_helpers")
    src = tmp_path / "f32.gguf"
    write_synthetic_gguf(src, MIX_SHAPE, mix="f32", n_vocab=512, seed=1)
    theirs = llama_helpers.tensor_types(llama_helpers.quantize_with_llama(src, tmp_path / "llama.gguf", "Q4_K_M"))
    ours_path = tmp_path / "ours.gguf"
    write_synthetic_gguf(ours_path, MIX_SHAPE, mix="q4_k_m", n_vocab=512, seed=1)
    ours = llama_helpers.tensor_types(ours_path)
    assert set(ours) == set(theirs)
    diff = {k: (theirs[k], ours[k]) for k in theirs if theirs[k] != ours[k]}
    assert not diff, f"tensor types differ from llama.cpp's Q4_K_M (llama.cpp, ours): {diff}"
    # The mix really is mixed: Q6_K on the 'more bits' layers, fall-backs on short rows.
    assert {"Q4_K", "Q6_K", "Q5_0"} <= set(ours.values())


def test_q4_k_m_rules_for_the_27b_shape():
    assert q4_k_m_type("output.weight", 5120, 64) == "Q6_K"
    assert q4_k_m_type("token_embd.weight", 5120, 64) == "Q4_K"
    assert q4_k_m_type("blk.0.ffn_down.weight", 17408, 64) == "Q6_K"       # first eighth
    assert q4_k_m_type("blk.9.ffn_down.weight", 17408, 64) == "Q4_K"
    assert q4_k_m_type("blk.10.attn_qkv.weight", 5120, 64) == "Q6_K"      # (10 - 8) % 3 == 2
    assert q4_k_m_type("blk.63.attn_v.weight", 5120, 64) == "Q6_K"        # last eighth
    assert q4_k_m_type("blk.20.ffn_up.weight", 5120, 64) == "Q4_K"


def test_synthetic_q4_k_m_model_runs(tmp_path):
    path = tmp_path / "m.gguf"
    size = write_synthetic_gguf(path, MIX_SHAPE, mix="q4_k_m", n_vocab=700, seed=2)
    assert size == path.stat().st_size
    model = Qwen35Model.load(path)
    assert model.n_vocab == 700
    logits = model.forward(list(range(0, 700, 50)), model.new_state(32), logits="all")
    assert logits.shape == (14, 700) and np.isfinite(logits).all()
    assert 0.05 < float(np.std(logits)) < 100.0      # scales give O(1) activations, not 0 or blow-up


def test_bench_command_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["bench", "--synthetic", "tiny", "--tokens", "3", "--prefill", "20",
                                  "--widths", "1,4", "--json", str(out)])
    assert r.exit_code == 0, r.output
    for head in ("prefill", "decode", "verify", "bandwidth", "host", "per-op"):
        assert any(line.startswith(head) for line in r.output.splitlines()), f"no '{head}' line:\n{r.output}"
    data = json.loads(out.read_text())
    assert data["decode_tok_s"] > 0 and data["prefill_tok_s"] > 0
    assert set(data["verify_ms"]) == {"1", "4"}
    assert data["bytes_per_step"] > 0 and 0 < data["bound_fraction"]
    assert any(row["op"].startswith("matmul ffn_gate") for row in data["ops"])


def test_bench_refuses_27b_on_cpu_and_bad_widths():
    assert "qwen35-27b-q4km" in BENCH_PRESETS
    r = CliRunner().invoke(main, ["bench", "--synthetic", "qwen35-27b-q4km"])
    assert r.exit_code == 2 and "is for a GPU" in r.output
    r = CliRunner().invoke(main, ["bench", "--synthetic", "tiny", "--widths", "1,x"])
    assert r.exit_code == 2 and "--widths" in r.output
    r = CliRunner().invoke(main, ["bench"])
    assert r.exit_code == 2 and "exactly one of --model or --synthetic" in r.output


def _run_on_emulator(script: str, *args: str, timeout: float = 600):
    """tests/bench/<script> run with `args` in a fresh interpreter (its --device emu runs on the CPU
    emulator); skipped where the emulator cannot build."""
    import subprocess
    import sys
    from tests.emu import emu_unavailable_reason
    if emu_unavailable_reason() is not None:
        pytest.skip(f"emulator: {emu_unavailable_reason()}")
    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, str(root / "tests" / "bench" / script), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=root)


def test_gpu_profile_script_runs_on_the_emulator(tmp_path):
    """tests/bench/profile_gpu_step.py (the README's per-kernel figures) end to end on the CPU
    emulator: a step width's launches by kind, and a prefill past wide_batch_min by operation."""
    r = _run_on_emulator("profile_gpu_step.py", "--device", "emu", "--synthetic", "embedded", "--path",
                         str(tmp_path / "e.gguf"), "--widths", "2", "--prefill", "64")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert any(line.startswith("== step T=2 (verify)") for line in lines), r.stdout
    assert any(line.strip().startswith("mm ffn_gate|up") for line in lines), r.stdout
    assert any(line.startswith("== prefill 64 tokens:") and "tok/s" in line for line in lines), r.stdout
    assert any(line.strip().startswith("matmul ffn_gate") for line in lines), r.stdout   # the wide path's ops


def test_chain_step_check_script_runs_on_the_emulator(tmp_path):
    """tests/bench/chain_step_check_gpu.py (the chained decode step against the launch-per-op step, op by
    op and from graphs, with GreedyChain decoding; a failure hunt on the GPU machine) on the CPU emulator,
    on a narrow 4-layer model, its chains' waiters on flags (fused_gpu.MM_CHAIN_FLAG; the default boundary is
    test_gpu_step.py's): levels 1 and 3 report every step's logits and the greedy tokens the same."""
    r = _run_on_emulator("chain_step_check_gpu.py", "--device", "emu", "--narrow", "--layers", "4", "--levels", "1,3",
                         "--steps", "2", "--greedy", "3", "--vocab", "600", "--dir", str(tmp_path), "--flag")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if "bit-identical" in ln]
    assert len(lines) == 4 and all("logits of 3/3" in ln or "logits of 4/4" in ln for ln in lines), r.stdout
    assert sum("greedy tokens the same" in ln for ln in lines) == 2, r.stdout


def test_chain_bench_script_runs_on_the_emulator(tmp_path):
    """tests/bench/bench_chain_gpu.py (the decode step's products as launches and as one persistent
    mm_chain, timed on the GPU machine) on the CPU emulator: the embedded model's 33 products, then its FFN
    products, run in order and as the chain with a phase's counts on one line, on three, and with the flag
    the last arrival raises, every buffer they touch bit-identical."""
    r = _run_on_emulator("bench_chain_gpu.py", "--device", "emu", "--synthetic", "embedded", "--gguf",
                         str(tmp_path / "e.gguf"), "--spread", "1", "3", "flag")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("products in order and as mm_chain") == 6, r.stdout
    assert r.stdout.count("bit-identical") == 6 and "DIFFERENT" not in r.stdout, r.stdout


def test_gdn_bench_script_runs_on_the_emulator():
    """tests/bench/bench_gdn_gpu.py (gdn_conv / gdn_recur timings, run on the GPU machine) parses its
    arguments and runs every form once on the CPU emulator at the 27B shape."""
    r = _run_on_emulator("bench_gdn_gpu.py", "--modes", "bogus")
    assert r.returncode == 2 and "--modes" in r.stderr
    r = _run_on_emulator("bench_gdn_gpu.py", "--device", "emu", "--widths", "1,2", "--n", "1", "--modes",
                         "verify,advance,commit")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    for kernel, mode in (("gdn_conv", "verify"), ("gdn_conv", "advance"), ("gdn_recur", "verify"),
                         ("gdn_recur", "advance"), ("gdn_recur", "commit")):
        assert sum(line.split()[:2] == [kernel, mode] and " us" in line for line in lines) == 3, r.stdout


def test_drop_ops_script_leaves_out_only_the_named_kinds():
    """tests/bench/bench_drop_ops.py times the step without some launches: its plan filter must drop
    every layer's launches of the named kinds (matched without the layer prefix) and nothing else."""
    import importlib.util
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("bench_drop_ops", root / "tests" / "bench" / "bench_drop_ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    class Op:
        def __init__(self, label):
            self.label = label

    class Step:
        def _plan(self, T, mode):
            return [Op("embed")] + [Op(f"blk.{i}.{k}") for i in range(3) for k in ("gdn_conv", "gdn_recur",
                                                                                  "mm ssm_out Q4_K")]

    seen = mod.drop_from_plans(Step, {"gdn_recur", "mm ssm_out Q4_K", "attn_partial"})
    labels = [op.label for op in Step()._plan(1, "advance")]
    assert labels == ["embed", "blk.0.gdn_conv", "blk.1.gdn_conv", "blk.2.gdn_conv"]
    assert seen == {"gdn_recur", "mm ssm_out Q4_K"}


def test_persist_probe_models_the_27b_steps_products():
    """tests/bench/persist_probe.py (GPU only) models a persistent decode step from the 27B step's product
    launches: their bytes must be the step's weights (every matrix but the embedding and the conv taps, in
    the file's types), one launch a projection as the step groups them (or one a weight type, as before
    the twenty-ninth session), and a chain of small launches where the step has one (an RMSNorm before a
    layer's first product and before gate|up, the DeltaNet or attention chain before the output projection,
    the output norm)."""
    import importlib.util
    from pathlib import Path

    from gguf import GGMLQuantizationType as QT

    from daemons.synthetic import PRESETS, qwen35_tensor_shapes
    from kernels import ggml_quants
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("persist_probe", root / "tests" / "bench" / "persist_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    prep, dn, att = 2.0, 11.0, 7.0
    kinds: list = []
    prods = mod.step_products(prep, dn, att, kinds=kinds)
    per_type = mod.step_products(prep, dn, att, launch_per_type=True)
    # each launch's chain by kind (--chain / --phases replace a chain by its small launches)
    assert [{"prep": prep, "dn": dn, "att": att, None: 0.0}[k] for k in kinds] == [d for _, d in prods]
    assert sum(b for b, _ in per_type) == sum(b for b, _ in prods)
    assert (len(prods), len(per_type)) == (257, 289)       # the step's launches now / in the 28th session
    shape = PRESETS["qwen35-27b"]
    want = 0
    for name, shp in qwen35_tensor_shapes(shape, 248320).items():
        if len(shp) == 2 and name not in ("token_embd.weight",) and not name.endswith("ssm_conv1d.weight"):
            q = ggml_quants.quant_spec(QT[q4_k_m_type(name, shp[1], shape.n_layer)])
            want += shp[0] * shp[1] // q.block_size * q.block_bytes
    assert sum(b for b, _ in prods) == want
    n_dn, n_att = 48, 16
    chains = sorted(d for _, d in prods if d)
    assert chains == sorted([prep] * (2 * (n_dn + n_att) + 1) + [dn] * n_dn + [att] * n_att)
    assert sorted(d for _, d in per_type if d) == chains
    # no chain before ffn_down (nor, launched per type, before the second launch of a two-type projection)
    assert sum(1 for _, d in prods if not d) == n_dn + n_att
    assert sum(1 for _, d in per_type if not d) == (n_dn + n_att) + sum(
        len({q4_k_m_type(f"blk.{i}.{t}", 5120, 64) for t in (("attn_q.weight", "attn_k.weight", "attn_v.weight")
                                                           if (i + 1) % 4 == 0 else
                                                           ("attn_qkv.weight", "attn_gate.weight", "ssm_alpha.weight",
                                                            "ssm_beta.weight"))}) - 1 for i in range(64))


def test_host_probe_times_what_the_step_calls():
    """tests/bench/host_probe_gpu.py (GPU only) times a decode step's host-side pieces by wrapping the
    step's own methods and reads its decode graph from the plan cache: a rename there would leave the
    probe timing nothing, so the names it wraps must exist, and its wrapper must keep results."""
    import importlib.util
    from pathlib import Path
    from daemons.qwen35_gpu import Qwen35GpuStep
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("host_probe_gpu", root / "tests" / "bench" / "host_probe_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name in ("_bind", "_upload", "_launch", "_to_host", "_runner"):
        assert callable(getattr(Qwen35GpuStep, name, None)), name

    class Obj:
        def f(self, x):
            return 2 * x
    o, samples = Obj(), {}
    mod._timed(samples, "f", o, "f")
    assert o.f(4) == 8 and o.f(5) == 10 and len(samples["f"]) == 2


def test_timeline_breakdown_sums_to_the_step():
    """tests/bench/timeline_gpu_step.py attributes a graph's time to its launches from their recorded
    start / release / end: the "adds" column must sum to the step's span, a launch that ends under
    an earlier one adds nothing, and a launch without a dependency wait (released = -1) is taken as
    released at its start."""
    import importlib.util
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("timeline_gpu_step", root / "tests" / "bench" / "timeline_gpu_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # grid id, start, released first, released last, end, blocks (ns)
    r = np.array([[10, 0, -1, -1, 5, 1],            # embed: no wait, released at its start
                  [11, 2, 6, 7, 20, 4],             # waits 1 past the embed's end
                  [12, 15, 21, 21, 26, 4],
                  [13, 16, 27, 28, 40, 4],
                  [14, 30, -1, -1, 35, 1]], dtype=np.int64)   # runs under the one before: adds nothing
    adds, lag, run, early, step = mod.breakdown(r)
    assert step == 40 and int(adds.sum()) == step
    assert adds.tolist() == [5, 15, 6, 14, 0]
    assert lag.tolist() == [0, 1, 1, 1, -10]
    assert run.tolist() == [5, 14, 5, 13, 5]
    assert early.tolist() == [0, 4, 6, 11, 0]

def test_stage_trace_table_reads_waits_holds_and_the_time_between_stages(capsys):
    """tests/bench/stage_trace_gpu.py turns a block's recorded clocks into a stage's wait, hold and
    the time from its release to the next stage's wait (at T > 8 the block barrier and the issue of
    the next copy sit there): one device call of a wide trace must not be lost to a slip in the
    arithmetic. A record at 1 GHz (the clock count equals the %globaltimer span): stage i issued at
    1000 i + 700, waited for from 1000 i + 1000, passed 100 cycles later, released 500 after that."""
    import importlib.util
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("stage_trace_gpu", root / "tests" / "bench" / "stage_trace_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    n = 5
    rec = np.zeros(mod.ST_REC + 1, dtype=np.uint32)          # + the block index _records appends
    rec[:mod.ST_HEAD] = [7, 0, 500, 7000, n, 2, 0, 7000, 6500, 3]
    for i in range(n):
        b = 1000 + 1000 * i
        rec[mod.ST_HEAD + 4 * i:mod.ST_HEAD + 4 * i + 4] = [b - 300, b, b + 100, b + 600]
    mod.summarise("synthetic", rec[None, :])
    out = capsys.readouterr().out
    sums = re.search(r"sums: wait ([\d.]+) us, hold ([\d.]+) us, between ([\d.]+) us over (\d+) stages", out)
    assert sums, out
    assert [float(x) for x in sums.groups()] == [0.5, 2.5, 1.6, 5.0]       # 4 gaps of 0.4 us between 5 stages
    assert "stripes of 5 stages, 2 in flight, clock 1.00 GHz" in out
    # issue to pass 400 cycles; release of stage i (1000 i + 1600) to the issue of i + 2 (1000 i + 2700)
    assert re.search(r"mean issue->pass 0\.40 us, refill 1\.10 us", out), out


def test_short_prompts_time_both_paths_and_restore_the_switch(tmp_path):
    """`--short-prompts` (GPU): each prompt runs as steps and as one wide forward by moving the
    model's switch (`backend.wide_batch_min`); the switch must be back where it was afterwards, also
    when a run fails, or every later prompt of the process would take the forced path. On the CPU
    emulator (the GPU step's Python and kernels), with a tiny Q8_0 model."""
    from gguf import GGMLQuantizationType as QT
    from daemons.bench import BenchResult, _short_prompts
    from daemons.synthetic import write_synthetic_qwen35
    from tests.emu import EmuBackend, emu_unavailable_reason
    if emu_unavailable_reason() is not None:
        pytest.skip(f"emulator: {emu_unavailable_reason()}")
    path = tmp_path / "tiny.gguf"
    write_synthetic_qwen35(path, "tiny", qtype=QT.Q8_0, seed=7)
    backend = EmuBackend()
    model = Qwen35Model.load(path, backend)
    assert model.gpu_step is not None
    backend.wide_batch_min = 6
    seen = []
    real_forward = model.forward

    def forward(ids, state, **kw):
        seen.append((len(ids), backend.wide_batch_min))
        return real_forward(ids, state, **kw)

    model.forward = forward
    res = _short_prompts(model, (4, 8), np.random.default_rng(0), log=lambda m: None)
    assert backend.wide_batch_min == 6
    assert set(res) == {4, 8} and res[4]["used"] == "steps" and res[8]["used"] == "wide"
    assert all(v["steps_ms"] > 0 and v["wide_ms"] > 0 for v in res.values())
    assert {(n, t) for n, t in seen} == {(4, float("inf")), (4, 1), (8, float("inf")), (8, 1)}
    line = [l for l in BenchResult({"short_prompts": res, **_FAKE_FIGURES}).lines() if l.startswith("prompt 8")]
    assert line and "(the model runs it as wide)" in line[0]
    # the attention line names the kernels the step runs and their key splits at the bench's context
    from daemons.bench import _attention_kernels
    att = _attention_kernels(model.gpu_step, 3000)
    assert att.startswith("tensor cores" if model.gpu_step.att_tc else "FMA")
    assert f"{32 if model.gpu_step.att_tc else 16} key splits at 3000 keys" in att
    assert [l for l in BenchResult({"attention": att, **_FAKE_FIGURES}).lines() if l.startswith("attention ")]

    def broken(ids, state, **kw):
        raise RuntimeError("device lost")

    model.forward = broken
    with pytest.raises(RuntimeError):
        _short_prompts(model, (4,), np.random.default_rng(0), log=lambda m: None)
    assert backend.wide_batch_min == 6


_FAKE_FIGURES = {"model": "m", "weights_gb": 1.0, "device": "cuda:0", "copy_GBps": 1.0, "prefill_tokens": 1,
                 "prefill_ms": 1.0, "prefill_tok_s": 1.0, "decode_tok_s": 1.0, "decode_ms": 1.0, "decode_steps": 1,
                 "context": 1, "verify_ms": {}, "bytes_per_step": 1, "bound_ms": 1.0, "bound_fraction": 1.0,
                 "host_overhead_ms": 0.0, "ops": []}


AB_LOG = """\
== /work/main
host         0.160 ms/step of host overhead (decode step 6.783 ms - 6.622 ms device time of its CUDA graph, programmatic dependent launch)
verify graph W=1: 6.64 ms, W=16: 9.42 ms, W=23: 10.90 ms  (device time of each verify step's CUDA graph)
== tests/bench/tmp_ab/ds
decode 144.78 tok/s
host         0.215 ms/step of host overhead (decode step 6.930 ms - 6.715 ms device time of its CUDA graph, programmatic dependent launch)
verify graph W=1: 6.66 ms, W=16: 9.29 ms, W=23: 10.97 ms  (device time of each verify step's CUDA graph)
== /work/main
host         0.093 ms/step of host overhead (decode step 6.718 ms - 6.626 ms device time of its CUDA graph, programmatic dependent launch)
verify graph W=1: 6.65 ms, W=16: 9.28 ms, W=23: 10.96 ms  (device time of each verify step's CUDA graph)
== tests/bench/tmp_ab/ds
host         0.085 ms/step of host overhead (decode step 6.807 ms - 6.723 ms device time of its CUDA graph, programmatic dependent launch)
== /work/main
verify graph W=1: 6.63 ms, W=16: 9.26 ms, W=23: 10.78 ms  (device time of each verify step's CUDA graph)
"""


def test_ab_summary_reads_graph_times_per_build():
    """tests/bench/ab_summary.py: the graph times of each `== TREE` section go to that build, in round
    order (a build's later sections add rounds, a section missing a line adds nothing), and the table
    reads every build against the first (the checkout)."""
    from tests.bench.ab_summary import parse, table
    builds = parse(AB_LOG.splitlines(True))
    assert list(builds) == ["/work/main", "tests/bench/tmp_ab/ds"]
    assert builds["/work/main"] == {"decode": [6.622, 6.626], "W=1": [6.64, 6.65, 6.63],
                                    "W=16": [9.42, 9.28, 9.26], "W=23": [10.90, 10.96, 10.78]}
    assert builds["tests/bench/tmp_ab/ds"] == {"decode": [6.715, 6.723], "W=1": [6.66], "W=16": [9.29],
                                               "W=23": [10.97]}
    lines = table(builds).splitlines()
    assert lines[0].split() == ["build", "rounds", "decode", "ms", "W=1", "ms", "W=16", "ms", "W=23", "ms"]
    assert lines[1].split()[:3] == ["/work/main", "3", "6.624"]
    ds = lines[2].split()
    # decode median 6.719 against 6.624; W=23 10.97 against the checkout's median 10.90
    assert ds[:5] == ["tests/bench/tmp_ab/ds", "2", "6.719", "(6.715-6.723)", "+0.095"]
    assert ds[-2:] == ["(10.970-10.970)", "+0.070"]
    assert "no `== TREE`" in table(parse(["decode 140 tok/s\n"]))


def _ab_bench_builds(tmp_path, *args):
    """Runs tests/bench/ab_bench.sh with ROUNDS=0 (its builds are made, nothing is benched): (the process,
    {argument: build tree} from its `build ARG: TREE` lines)."""
    import re
    import subprocess
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("ROUNDS", "CONTROL")}
    env.update(ROUNDS="0", TMPDIR=str(tmp_path))
    proc = subprocess.run(["bash", str(root / "tests" / "bench" / "ab_bench.sh"), *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc, {m.group(1): Path(m.group(2)) for m in re.finditer(r"^build (.*): (\S+)$", proc.stdout, re.M)}


def _changed_lines(tree, rel: str, pattern: str) -> list:
    """(file, checkout's line, tree's line) for every line of the checkout's rel/pattern files that tree changed."""
    root = Path(__file__).resolve().parents[1]
    changed = []
    for src in sorted((root / rel).glob(pattern)):
        a, b = src.read_text().splitlines(), (tree / rel / src.name).read_text().splitlines()
        assert len(a) == len(b), src.name
        changed += [(src.name, x, y) for x, y in zip(a, b) if x != y]
    return changed


def test_ab_bench_def_builds_change_one_define_only(tmp_path):
    """tests/bench/ab_bench.sh def:NAME=VALUE: a copy of the checkout whose kernels differ from it in that
    define's line alone (an A/B of a knob needs no branch); a name not defined exactly once is refused
    before anything runs."""
    bad, _ = _ab_bench_builds(tmp_path, "def:NO_SUCH_DEFINE=1")
    assert bad.returncode == 2 and "NO_SUCH_DEFINE is not defined exactly once" in bad.stderr
    proc, builds = _ab_bench_builds(tmp_path, "def:MM_BARRIER_PIPE=0")
    tree = builds.get("def:MM_BARRIER_PIPE=0")
    assert tree, proc.stdout + proc.stderr
    assert _changed_lines(tree, "kernels", "*.cu*") == [
        ("mma_matmul.cu", "#define MM_BARRIER_PIPE 1", "#define MM_BARRIER_PIPE 0")]


def test_ab_bench_def_builds_set_module_constants(tmp_path):
    """def:NAME=VALUE also sets a module constant of kernels/ or daemons/ (the step's benchmark-only knobs,
    e.g. qwen35_gpu.WIDE_SWIGLU_VARIANT), its value taken literally (quotes, parentheses, commas)."""
    value = '("MM_GRID=3", "MM_STAGES=3")'
    proc, builds = _ab_bench_builds(tmp_path, f"def:WIDE_SWIGLU_VARIANT={value}")
    tree = builds.get(f"def:WIDE_SWIGLU_VARIANT={value}")
    assert tree, proc.stdout + proc.stderr
    assert _changed_lines(tree, "daemons", "*.py") == [
        ("qwen35_gpu.py", "WIDE_SWIGLU_VARIANT: tuple[str, ...] = ()", f"WIDE_SWIGLU_VARIANT: tuple[str, ...] = {value}")]



def test_ab_bench_def_builds_change_a_mirrored_constant_in_both(tmp_path):
    """A constant fused.cu and fused_gpu.py both define ("the same names", e.g. ATT_SPLIT_KEYS: the key
    splits the kernels walk and the host sizes grids by) changes in both, or the build would launch grids
    its kernels disagree with."""
    proc, builds = _ab_bench_builds(tmp_path, "def:ATT_SPLIT_KEYS=64")
    tree = builds.get("def:ATT_SPLIT_KEYS=64")
    assert tree, proc.stdout + proc.stderr
    assert _changed_lines(tree, "kernels", "*.cu") == [("fused.cu", "#define ATT_SPLIT_KEYS 128",
                                                        "#define ATT_SPLIT_KEYS 64")]
    assert _changed_lines(tree, "kernels", "*.py") == [("fused_gpu.py", "ATT_SPLIT_KEYS = 128",
                                                        "ATT_SPLIT_KEYS = 64")]

_FAKE_CUPY = '''
"""A stand-in for cupy with which persist_probe.py's host code runs to its end (nothing is timed)."""
import types
import numpy as np
launches = []
zeros = lambda n, dtype=np.uint8: np.zeros(n, dtype=dtype)
asarray = np.asarray
uint8, uint32, uint64, int64, int32 = np.uint8, np.uint32, np.uint64, np.int64, np.int32
class _Fn:
    def __init__(self, name):
        self.name, self.kernel, self.max_dynamic_shared_size_bytes = name, types.SimpleNamespace(ptr=1), 0
    def __call__(self, grid, block, args, shared_mem=0):
        launches.append((self.name, grid[0], block[0], shared_mem))
class RawModule:
    def __init__(self, code, options=()):
        self.code = code
    def get_function(self, name):
        assert ("void __launch_bounds__(160) " + name) in self.code or ("void " + name) in self.code, name
        return _Fn(name)
class _Dev:
    attributes = {"MultiProcessorCount": 132, "ClockRate": 1980000, "MaxSharedMemoryPerMultiprocessor": 233472}
class _Event:
    record = synchronize = lambda self: None
cuda = types.SimpleNamespace(Device=_Dev, Event=_Event, get_elapsed_time=lambda a, b: 1.0)
'''

_FAKE_RUN = '''
import ctypes, runpy, sys
class _Occupancy:     # what fits a multiprocessor: 2048 threads, 228 KB of shared memory (+1 KB a block)
    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, out, fn, threads, smem):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = min(2048 // threads.value,
                                                                233472 // (smem.value + 512 + 1024))
        return 0
_cdll = ctypes.CDLL
ctypes.CDLL = lambda name, *a, **k: _Occupancy() if name == "libcuda.so.1" else _cdll(name, *a, **k)
import kernels.cuda_backend as cb
class _Backend:
    pdl_used, pdl_error = True, None
    capture_graph = lambda self, ops: ops
    launch_graph = lambda self, ops: [op.kernel(op.grid, op.block, op.args, shared_mem=op.smem) for op in ops]
    busy_wait = lambda self, s: None
cb.CudaBackend = _Backend
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
import cupy
print("LAUNCHES", sorted({(n, g, b, s) for n, g, b, s in cupy.launches}))
'''


@pytest.mark.parametrize("argv", [
    "--stages 3 --chain --hold-cycles 0 1340 --phase-blocks 1 0",
    "--stages 2 --act-bytes 12512 --trig -1 --chain --phases prep=3.6;dn=9.4,11.0,6.2;att=10.6,17.9,7.9 --phase-blocks 0",
])
def test_persist_probe_host_code_runs_to_its_end(tmp_path, argv):
    """tests/bench/persist_probe.py runs only on a GPU, where a Python slip costs a device call: its host code
    is run here against a stand-in for cupy, the driver's occupancy call and the graph backend. The launches
    it makes: the chain's product blocks and the padded persistent kernel hold exactly four blocks a
    multiprocessor (their shared memory fills it), and a phase's launch has the grid --phase-blocks asks."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(_FAKE_CUPY)
    (tmp_path / "run.py").write_text(_FAKE_RUN)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{root}")
    proc = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(root / "tests" / "bench" / "persist_probe.py"),
                           *argv.split(), "--reps", "1"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    import ast
    launches = ast.literal_eval(proc.stdout.split("LAUNCHES", 1)[1].strip())
    prod = {s for n, g, b, s in launches if n == "chain_prod"}
    padded = {s for n, g, b, s in launches if n == "persist" and s in prod}
    assert len(prod) == 1 and padded == prod and 233472 // (prod.pop() + 512 + 1024) == 4
    assert {g for n, g, b, s in launches if n in ("chain_prod", "persist")} == {528}
    want = {1, 132} if "--phase-blocks 1 0" in argv else {132}
    assert {g for n, g, b, s in launches if n == "chain_small"} == want
