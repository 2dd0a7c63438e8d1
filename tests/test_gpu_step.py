"""qwen35 through its GPU step (daemons/qwen35_gpu.py: fused kernels, one launch list per step)
against the CPU backend, on the CPU emulator (always) and on a real GPU (skipped without one; there
the launch lists run as captured CUDA graphs).

What the tests guard:
- the step's wiring (which buffer feeds which launch, the packed q|gate projection, the v heads in
  tiled order, the KV cache and conv/delta-rule state through the state table): prompt logits of
  every position close to the CPU's (within twice what rounding the matmul inputs to f16 alone
  costs the CPU model), and the same greedy tokens;
- batch invariance end to end: a verify block, and a prefill in chunks of 32, give bit-identical
  logits and states to one-token steps;
- wide forwards (prefill chunks of `wide_batch_min`+ tokens, 64 on the emulator: the backend operations, matmuls on f16-dequantised
  weights; on the GPU cuBLAS, on the emulator a float32 product of the same f16 units): close to
  the CPU, the state they leave written in place and decoding on from it;
- sampled speculative decoding with device top-k verify rows = the AR sample;
- rollback by replay: committing any prefix of a verified block (also twice, shorter second) leaves
  exactly the state the one-token steps reach; a stale record is refused;
- two states used alternately (the state table rebinds), and captured layers;
- greedy decoding with the next step queued before the host reads a token (GreedyChain): the same
  tokens, and closing it undoes the step queued ahead exactly.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.emu import emu_unavailable_reason
from tests.gpu_helpers import NO_GPU

KINDS = ["q8_0", "q4_k_m"]


def _write(path, kind: str) -> None:
    if kind == "q4_k_m":
        from daemons.bench import write_synthetic_gguf
        from daemons.synthetic import Qwen35Shape
        # every matrix a whole number of 256-column superblocks, so all of them are Q4_K / Q6_K
        shape = Qwen35Shape(n_embd=256, n_layer=4, n_ff=512, n_head=2, n_head_kv=1, head_dim=128, n_k_heads=2,
                            n_v_heads=4, ssm_head_dim=64, n_rot=32)
        write_synthetic_gguf(path, shape, mix="q4_k_m", n_vocab=600, seed=3)
    else:
        from gguf import GGMLQuantizationType as QT
        from daemons.synthetic import write_synthetic_qwen35
        write_synthetic_qwen35(path, "tiny", qtype=QT.Q8_0, seed=7)


def _devices():
    return [pytest.param("emu", marks=pytest.mark.skipif(emu_unavailable_reason() is not None,
                                                         reason=f"emulator: {emu_unavailable_reason()}")),
            pytest.param("cuda", marks=[pytest.mark.gpu,
                                        pytest.mark.skipif(NO_GPU is not None, reason=f"no GPU backend: {NO_GPU}")])]


@pytest.fixture(scope="module", params=_devices())
def device(request):
    if request.param == "emu":
        from tests.emu import EmuBackend
        return "emu", EmuBackend()
    from kernels.cuda_backend import CudaBackend
    return "cuda", CudaBackend()


@pytest.fixture(scope="module", params=KINDS)
def models(request, device, tmp_path_factory):
    from daemons.qwen35 import Qwen35Model
    from kernels.cpu_backend import CPUBackend
    name, backend = device
    path = tmp_path_factory.mktemp("step") / f"{request.param}.gguf"
    _write(path, request.param)
    cpu = Qwen35Model.load(path, CPUBackend())
    dev = Qwen35Model.load(path, backend)
    assert dev.gpu_step is not None, "every matrix of these files has a tensor-core layout"
    return name, request.param, cpu, dev


def _prompt(n_vocab, n, seed=0):
    return np.random.default_rng(seed).integers(0, n_vocab, size=n).tolist()


def _rel(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30))


def _same_state(a, b) -> bool:
    return (a.n_past == b.n_past
            and all(np.array_equal(a.backend.to_host(a.ssm[i]), b.backend.to_host(b.ssm[i])) for i in a.ssm)
            and all(np.array_equal(a.backend.to_host(a.conv[i]), b.backend.to_host(b.conv[i])) for i in a.conv)
            and all(np.array_equal(a.backend.to_host(a.k_cache[i])[:, :a.n_past],
                                   b.backend.to_host(b.k_cache[i])[:, :b.n_past]) for i in a.k_cache))


class _Round16(object):
    """The CPU backend with every matmul input rounded to f16: the error that rounding alone costs."""

    def __new__(cls):
        from kernels.cpu_backend import CPUBackend

        class R(CPUBackend):
            def matmul(self, x, w):
                return super().matmul(np.asarray(x, np.float32).astype(np.float16).astype(np.float32), w)
        return R()


def test_prompt_logits_close_to_cpu(models, tmp_path):
    """The step rounds matmul inputs to f16 (llama.cpp's CUDA path rounds them to 8 bits): on these
    small random nets that alone moves the logits by a few 1e-3. The step must stay within twice
    the deviation of the CPU model with exactly that rounding added."""
    from daemons.qwen35 import Qwen35Model
    name, kind, cpu, dev = models
    prompt = _prompt(cpu.n_vocab, 24)
    ref = cpu.forward(prompt, cpu.new_state(64), logits="all")
    got = dev.forward(prompt, dev.new_state(64), logits="all")
    r16 = Qwen35Model.load(cpu.path, _Round16())
    inherent = _rel(r16.forward(prompt, r16.new_state(64), logits="all"), ref)
    assert got.shape == ref.shape and np.isfinite(got).all()
    err = _rel(got, ref)
    assert err <= max(2.0 * inherent, 1e-4), f"{name} {kind}: {err:.3g} (f16 inputs alone: {inherent:.3g})"
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.9


@pytest.mark.skipif(emu_unavailable_reason() is not None, reason="needs the emulator")
def test_wide_swiglu_benchmark_variant_runs_and_keeps_the_arithmetic(tmp_path, monkeypatch):
    """qwen35_gpu.WIDE_SWIGLU_VARIANT (benchmarks only, set by `ab_bench.sh def:`) reaches the gate|up
    launches of 9..24 rows: with ("MM_GRID=3", "MM_STAGES=3") they take three pipeline stages (the
    emulator builds that configuration with the define). The stage count changes no arithmetic, and this
    small matrix gets the same grid (one stripe a block either way), so the logits keep their bits; on the
    27B the grid changes, and with it the stripes, which is why the knob is never a default."""
    from daemons import qwen35_gpu
    from daemons.qwen35 import Qwen35Model
    from kernels.fused_gpu import mm_smem_bytes
    from tests.emu import EmuBackend
    path = tmp_path / "q4k.gguf"
    _write(path, "q4_k_m")
    prompt = _prompt(600, 24, seed=5)
    base = Qwen35Model.load(path, EmuBackend())
    ref = base.forward(prompt, base.new_state(64), logits="all")
    grids = [o.grid for o in base.gpu_step.ops_for(24) if "gate|up" in o.label]
    monkeypatch.setattr(qwen35_gpu, "WIDE_SWIGLU_VARIANT", ("MM_GRID=3", "MM_STAGES=3"))
    dev = Qwen35Model.load(path, EmuBackend())
    got = dev.forward(prompt, dev.new_state(64), logits="all")
    wide = [o for o in dev.gpu_step.ops_for(24) if "gate|up" in o.label]
    assert wide and all(o.smem == mm_smem_bytes(12, 24, 3) for o in wide)
    assert [o.grid for o in wide] == grids
    assert all(o.smem == mm_smem_bytes(12, 1) for o in dev.gpu_step.ops_for(1) if "gate|up" in o.label)
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_chained_step_candidate_keeps_decode_bits(device, tmp_path, monkeypatch, level):
    """qwen35_gpu.CHAIN_STEP (an A/B candidate, off by default; `ab_bench.sh def:CHAIN_STEP=1`): a one-row
    step runs its runs of adjacent products (1), or of products and one-row norm preps (2: across the layer
    boundary, and the output norm with the output product), or also DeltaNet's conv, recurrence and gated norm
    (3: the DeltaNet layers whole), as persistent mm_chain launches. Decoding 8
    tokens gives the logits and states of the launch-per-op step bit for bit (on the GPU: from captured
    graphs with programmatic dependent launch, each chain between two dependent launches), and a verify
    block keeps its launches. Every chain is launched as a cooperative grid (fused_gpu.MM_CHAIN_COOPERATIVE: a
    chain beside its predecessor's blocks could stay one block short of its grid, forty-first session; the
    fortieth session's shared-memory carveout preference did not help and is gone, forty-second)."""
    from daemons import qwen35_gpu
    from daemons.qwen35 import Qwen35Model
    from kernels.fused_gpu import MM_CHAIN_PREP
    name, backend = device
    path = tmp_path / "q4k.gguf"
    _write(path, "q4_k_m")
    prompt = _prompt(600, 5, seed=9)
    runs = []
    for on in (0, level):
        monkeypatch.setattr(qwen35_gpu, "CHAIN_STEP", on)
        dev = Qwen35Model.load(path, backend)
        ops = dev.gpu_step.ops_for(1)
        chains = [o for o in ops if "chain of" in o.label]
        if on == 1:
            assert len(chains) == 4 and all("chain of 2" in o.label for o in chains), [o.label for o in ops]
        elif on >= 2:
            # 4 layers (3 DeltaNet, then attention). 2: the first layer's attn-norm prep and input products, the
            # mixer output to the next layer's input (3 times), the last layer's mixer output to the output
            # product; 3: the DeltaNet layers whole, from the first prep to the attention layer's q|k|v, then its
            # output product to the output product
            left = [o for o in ops if getattr(o, "chain_phase", {}) and (on == 3 or o.chain_phase["kind"] == MM_CHAIN_PREP)]
            assert len(chains) == (5 if on == 2 else 2) and not left, [o.label for o in ops]
            for kind in ("gdn_conv", "gdn_recur", "gdn_out_prep"):
                assert sum(o.label.endswith(kind) for o in ops) == (3 if on == 2 else 0)
        assert not any("chain of" in o.label for o in dev.gpu_step.ops_for(3, "verify", "all"))
        if on:
            assert all(o.cooperative for o in chains), "a chain launched as an ordinary grid"
        state = dev.new_state(64)
        rows = [np.asarray(backend.to_host(dev.forward(prompt, state)))]
        for _ in range(8):
            tok = int(np.argmax(rows[-1]))
            rows.append(np.asarray(backend.to_host(dev.forward([tok], state))))
        runs.append((rows, state))
    (ref, s0), (got, s1) = runs
    assert all(np.array_equal(a, b) for a, b in zip(got, ref)), "the chained step changed a decode step's logits"
    assert _same_state(s1, s0)


def test_float_matrices_of_a_quantised_file_join_the_step(device, tmp_path):
    """A quantised file with some float matrices (F32 gates, a BF16 output projection, an F16 FFN
    down) still runs as the fused step: the floats become F16 units (BF16 exactly, F32 rounded
    once); one that does not fit f16 keeps the plain layout, and gate and up of two types (one
    SwiGLU launch cannot pair them) keep the model off the step. Logits stay as close to the CPU
    as the all-quantised file's do."""
    from daemons.bench import write_synthetic_gguf
    from daemons.qwen35 import Qwen35Model
    from daemons.synthetic import Qwen35Shape
    from kernels.cpu_backend import CPUBackend
    from kernels.fused_gpu import QT_F16, TcWeight
    name, backend = device
    shape = Qwen35Shape(n_embd=256, n_layer=4, n_ff=512, n_head=2, n_head_kv=1, head_dim=128, n_k_heads=2,
                        n_v_heads=4, ssm_head_dim=64, n_rot=32)
    path = tmp_path / "mixed.gguf"
    write_synthetic_gguf(path, shape, mix="q4_k_m", n_vocab=600, seed=3,
                         tensor_types={"ssm_alpha.weight": "F32", "ssm_beta.weight": "F32", "attn_output.weight": "BF16",
                                "blk.0.ffn_down.weight": "F16"})
    cpu, dev = Qwen35Model.load(path, CPUBackend()), Qwen35Model.load(path, backend)
    assert dev.gpu_step is not None
    mx = dev.layers[0].mixer
    assert isinstance(mx.w_alpha, TcWeight) and mx.w_alpha.qtype == QT_F16
    # a projection of up to two weight types is one launch (mm_tc_parts), of three a launch per type:
    # here Q4_K qkv + F16 alpha / beta (layers 0, 1) and Q6_K qkv + Q4_K z + F16 (layer 2)
    labels = [op.label for op in dev.gpu_step.ops_for(1)]
    launches = {}
    for il, layer in enumerate(dev.layers):
        m = layer.mixer
        if hasattr(m, "w_qkv"):
            n_types = len({w.qtype for w in (m.w_qkv, m.w_gate, m.w_alpha, m.w_beta)})
            launches[n_types] = sum(lb.startswith(f"blk.{il}.mm qkv|z|a|b ") for lb in labels)
    assert launches == {2: 1, 3: 3}, launches
    prompt = _prompt(cpu.n_vocab, 24)
    ref = cpu.forward(prompt, cpu.new_state(64), logits="all")
    got = dev.forward(prompt, dev.new_state(64), logits="all")
    r16 = Qwen35Model.load(path, _Round16())
    inherent = _rel(r16.forward(prompt, r16.new_state(64), logits="all"), ref)
    err = _rel(got, ref)
    assert np.isfinite(got).all() and err <= max(2.0 * inherent, 1e-4), f"{name}: {err:.3g} (f16 inputs: {inherent:.3g})"
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.9

    class _T:                                              # a float matrix beyond f16's range
        name, qtype, ne = "big", 0, (256, 16)
        raw = np.full((16, 256), 1e5, dtype=np.float32).view(np.uint8)
    assert dev.gpu_step.fg.repack_tensor(_T()) is None
    write_synthetic_gguf(path, shape, mix="q4_k_m", n_vocab=600, seed=3, tensor_types={"blk.1.ffn_up.weight": "F16"})
    odd = Qwen35Model.load(path, backend)
    assert odd.gpu_step is None
    # off the step: the backend operations (on the emulator the CPU's around the emulated matmuls;
    # the CUDA backend's own operations are held to the CPU's by tests/test_gpu_model.py)
    lg_odd = odd.forward(prompt, odd.new_state(64), logits="all")
    assert np.isfinite(lg_odd).all()
    if name == "emu":
        cpu_odd, r16_odd = Qwen35Model.load(path, CPUBackend()), Qwen35Model.load(path, _Round16())
        ref_odd = cpu_odd.forward(prompt, cpu_odd.new_state(64), logits="all")
        inherent_odd = _rel(r16_odd.forward(prompt, r16_odd.new_state(64), logits="all"), ref_odd)
        assert _rel(lg_odd, ref_odd) <= max(2.0 * inherent_odd, 1e-4)


def test_greedy_tokens_match_cpu(models):
    name, kind, cpu, dev = models
    n = 16 if name == "emu" else 64
    prompt = _prompt(cpu.n_vocab, 8, seed=1)
    sc, sd = cpu.new_state(128), dev.new_state(128)
    tok_c = int(np.argmax(cpu.forward(prompt, sc)[-1]))
    tok_d = int(dev.forward(prompt, sd, logits="argmax_last")[0])
    got, ref = [], []
    for _ in range(n):
        ref.append(tok_c)
        got.append(tok_d)
        if tok_c != tok_d:
            break
        row_c = cpu.forward([tok_c], sc)[-1]
        tok_c = int(np.argmax(row_c))
        row_d = dev.forward([tok_d], sd, logits="last")[-1]
        tok_d = int(np.argmax(row_d))
        if tok_c != tok_d:
            # f16 inputs move logits by ~1e-3 relative: a flip is only acceptable at a near tie
            top2 = np.sort(row_c)[-2:]
            gap, diff = float(top2[1] - top2[0]), float(np.abs(row_d - row_c).max())
            assert gap <= 2.0 * diff, (f"{name} {kind}: step {len(got)}: {tok_d} vs CPU {tok_c} with a CPU top-2 gap "
                                       f"{gap:.3g} > twice the logit difference {diff:.3g}")
            return
    assert got == ref


def test_wide_forward_close_to_cpu_and_decoding_goes_on(models, monkeypatch):
    """A forward of `wide_batch_min` tokens or more (prefill chunks) leaves the step for the backend
    operations, whose products are cuBLAS GEMMs on f16-dequantised weights: its logits stay as
    close to the CPU's as the step's own (f16 inputs), every logits mode answers as on the step, and
    the state it leaves behind (KV rows, conv and delta-rule state, written into the arrays the
    step's state table already points at) carries greedy decoding on the step to the CPU's tokens."""
    from daemons.qwen35 import Qwen35Model
    name, kind, cpu, dev = models
    # the path from 64 tokens, whatever the speed-chosen switch (WIDE_MIN_T, 160 on a GPU): the error
    # grows with the prompt and the limit below was set for a ~77-token forward of these tiny models;
    # the backend's products then take cuBLAS from 64 rows too
    from kernels import cuda_backend
    monkeypatch.setattr(cuda_backend, "WIDE_MIN_T", 64)
    monkeypatch.setattr(dev.backend, "wide_batch_min", min(dev.backend.wide_batch_min, 64))
    wide = dev.backend.wide_batch_min
    head, body = _prompt(cpu.n_vocab, 3, seed=11), _prompt(cpu.n_vocab, wide + 13, seed=12)
    sc, sd = cpu.new_state(160), dev.new_state(160)
    cpu.forward(head, sc)
    dev.forward(head, sd)                                  # binds sd to the step first
    before = {il: a for il, a in sd.conv.items()}
    ref = cpu.forward(body, sc, logits="all")
    s_copy = sd.copy()
    got = dev.forward(body, sd, logits="all")
    assert all(sd.conv[il] is a for il, a in before.items()), "state arrays must be written in place"
    r16 = Qwen35Model.load(cpu.path, _Round16())
    sr = r16.new_state(160)
    r16.forward(head, sr)
    inherent = _rel(r16.forward(body, sr, logits="all"), ref)
    err = _rel(got, ref)
    assert np.isfinite(got).all() and err <= max(2.0 * inherent, 1e-4), f"{name} {kind}: {err:.3g} vs {inherent:.3g}"
    assert int(dev.forward(body, s_copy.copy(), logits="argmax_last")[0]) == int(np.argmax(got[-1]))
    ids, vals = dev.forward(body, s_copy.copy(), logits="topk_last", top_k=5)
    assert sorted(ids.tolist()) == sorted(np.argsort(got[-1])[-5:].tolist())
    tok_c = tok_d = int(np.argmax(ref[-1]))
    for i in range(16):
        row_c = cpu.forward([tok_c], sc)[-1]
        row_d = dev.forward([tok_d], sd, logits="last")[-1]
        tok_c, tok_d = int(np.argmax(row_c)), int(np.argmax(row_d))
        if tok_c != tok_d:
            top2 = np.sort(row_c)[-2:]
            gap, diff = float(top2[1] - top2[0]), float(np.abs(row_d - row_c).max())
            assert gap <= 2.0 * diff, f"{name} {kind}: step {i}: {tok_d} vs CPU {tok_c}, top-2 gap {gap:.3g}"
            return


def test_verify_and_chunked_prefill_equal_single_steps(models):
    name, kind, cpu, dev = models
    prompt = _prompt(dev.n_vocab, 70, seed=2)
    s_chunk = dev.new_state(128)
    lg_chunk = dev.prefill(prompt, s_chunk, chunk=32, logits="all")     # chunks of 32 on the step
    s_one = dev.new_state(128)
    lg_one = np.concatenate([dev.forward([t], s_one, logits="all") for t in prompt], axis=0)
    assert np.array_equal(lg_chunk, lg_one)
    assert _same_state(s_chunk, s_one)

    block = _prompt(dev.n_vocab, 9, seed=3)
    s_ver = s_chunk.copy()
    lg_ver, _, rec = dev.verify(block, s_ver)
    lg_dec = np.concatenate([dev.forward([t], s_one, logits="all") for t in block], axis=0)
    assert np.array_equal(lg_ver, lg_dec), "verify rows must be bit-identical to decode steps"
    ids, _, rec2 = dev.verify(block, s_chunk.copy(), logits="argmax")
    assert ids.tolist() == lg_dec.argmax(1).tolist()


def test_verify_equals_decode_where_the_attention_splits_grow(models):
    """A captured step launches as many attention key splits as its longest row needs, so decode
    moves to another graph as the context passes 2048 keys (16 -> 32 splits with tensor-core
    attention) and a verify block straddling it runs with 32 while its first rows' decode steps ran
    with 16: the rows must still be bit-identical. The long context is a state with 2040 positions
    of random K/V cache (the DeltaNet states as they are: attention is what changes here)."""
    name, kind, cpu, dev = models
    step = dev.gpu_step
    xp = dev.backend.xp
    rng = np.random.default_rng(9)
    base = dev.new_state(2100)
    dev.forward(_prompt(dev.n_vocab, 8, seed=10), base)
    for il in base.k_cache:
        shape = base.k_cache[il].shape
        for cache in (base.k_cache[il], base.v_cache[il]):
            cache[:, 8:2040] = xp.asarray(rng.standard_normal((shape[0], 2032, shape[2])).astype(np.float32))
    base.n_past = 2040
    block = _prompt(dev.n_vocab, 16, seed=11)                 # rows of 2041 .. 2056 keys
    s_dec = base.copy()
    lg_dec = np.concatenate([dev.forward([t], s_dec, logits="all") for t in block], axis=0)
    lg_ver, _, _ = dev.verify(block, base.copy())
    assert np.array_equal(lg_ver, lg_dec), "verify rows must be bit-identical to decode steps"
    if getattr(step, "att_tc", False):
        used = {k[4] for k in step._plans if len(k) == 5}
        assert {16, 32} <= used, f"plans by split count: {used}"


def test_rollback_replays_exactly(models):
    name, kind, cpu, dev = models
    prompt = _prompt(dev.n_vocab, 12, seed=4)
    block = _prompt(dev.n_vocab, 7, seed=5)
    base = dev.new_state(64)
    dev.forward(prompt, base)
    for keeps in ((7,), (4,), (0,), (5, 2)):
        s = base.copy()
        _, _, rec = dev.verify(block, s)
        for n in keeps:
            dev.rollback(s, rec, n)
        ref = base.copy()
        for t in block[:keeps[-1]]:
            dev.forward([t], ref)
        assert _same_state(s, ref), f"rollback {keeps}"
        nxt = _prompt(dev.n_vocab, 1, seed=6)
        assert np.array_equal(dev.forward(nxt, s, logits="all"), dev.forward(nxt, ref, logits="all"))
    s = base.copy()
    _, _, old = dev.verify(block, s)
    dev.rollback(s, old, 3)
    dev.verify(block[:2], s)
    from daemons.qwen35 import StateError
    with pytest.raises(StateError):
        dev.rollback(s, old, 1)


def test_greedy_chain_equals_single_steps_and_undoes_the_step_queued_ahead(models):
    """GreedyChain queues each decode step before the host has read the token of the step before
    (the graph writes the next step's params itself). Guards: its tokens are the greedy tokens of
    steps taken one at a time; closing it after 1-3 tokens, with a step queued ahead or
    not, leaves exactly the state those single steps leave (n_past, conv and delta-rule states, KV
    rows), whichever of its two delta-rule buffers the chain ended in, and decoding goes on from it
    alike; misuse is refused."""
    name, kind, cpu, dev = models
    prompt = _prompt(dev.n_vocab, 6, seed=11)
    base = dev.new_state(64)
    first = int(dev.forward(prompt, base, logits="argmax_last")[0])
    n = 3
    ref, toks, states = base.copy(), [], []
    tok = first
    for _ in range(n):
        tok = int(dev.forward([tok], ref, logits="argmax_last")[0])
        toks.append(tok)
        states.append(ref.copy())
    probe = _prompt(dev.n_vocab, 2, seed=12)
    for k in (1, 2, 3):                          # closing with the states in either buffer
        for last_ahead in ((True, False) if k > 1 else (True,)):
            s = base.copy()
            chain = dev.gpu_step.greedy_chain(s)
            got, tok = [], first
            for i in range(k):
                tok = chain.next(tok, ahead=i + 1 < k or last_ahead)
                got.append(tok)
            assert s.n_past == base.n_past + k + (1 if last_ahead else 0)
            chain.close()
            assert got == toks[:k], f"{name} {kind}: {k} tokens"
            assert _same_state(s, states[k - 1]), f"{name} {kind}: state after {k} tokens (ahead {last_ahead})"
            assert np.array_equal(dev.forward(probe, s, logits="all"), dev.forward(probe, states[k - 1].copy(), logits="all"))
    s = base.copy()
    with dev.gpu_step.greedy_chain(s) as chain:
        tok = chain.next(first)
        with pytest.raises(ValueError, match="consumes token"):
            chain.next(tok + 1 if tok + 1 < dev.n_vocab else 0)
        assert chain.next(tok) == toks[1]
        with pytest.raises(ValueError, match="vocabulary"):
            chain.next(dev.n_vocab)
    assert _same_state(s, states[1])
    with pytest.raises(RuntimeError, match="closed"):
        chain.next(toks[1])


def test_generation_hands_on_the_state_of_its_tokens(models):
    """generate() decodes greedily through GreedyChain on the GPU step, and its end event carries
    the state (a worker parks or snapshots it at once). Guards: whether generation ends on a stop
    token, on the length limit or on a cancel, the tokens are the single-step greedy tokens and the
    state holds exactly the tokens fed to the model, the step queued ahead undone before the end
    event is yielded."""
    from daemons.generate import GenerationRequest, generate
    from daemons.tokenizer import Tokenizer
    name, kind, cpu, dev = models
    tokenizer = Tokenizer.from_metadata(dev.metadata)
    prompt = _prompt(dev.n_vocab, 5, seed=13)
    base = dev.new_state(64)
    toks = [int(dev.forward(prompt, base, logits="argmax_last")[0])]
    ref = base.copy()
    for _ in range(5):
        toks.append(int(dev.forward([toks[-1]], ref, logits="argmax_last")[0]))

    def run(max_tokens, stop_ids=(), cancel_after=None):
        events, polls = [], [0]

        def should_stop():
            polls[0] += 1
            return cancel_after is not None and polls[0] > cancel_after

        for ev in generate(dev, tokenizer, GenerationRequest(prompt_ids=tuple(prompt), max_tokens=max_tokens,
                                                             stop_ids=frozenset(stop_ids), max_ctx=64),
                           should_stop=should_stop):
            events.append(ev)
            if ev.finish_reason is not None:
                held = ev.state.copy()       # as the receiver finds it, before the generator resumes
        got = [t for ev in events for t in ev.token_ids]
        return got, events[-1], held

    def fed(n):
        s = base.copy()
        for t in toks[:n]:
            dev.forward([t], s)
        return s

    k = next((i for i in range(2, 6) if toks[i] not in toks[:i]), None)
    if k is not None:
        got, end, held = run(20, stop_ids=(toks[k],))
        assert got == toks[:k] and end.finish_reason == "stop" and end.stop_token == toks[k]
        assert _same_state(held, fed(k)), f"{name} {kind}: state at the stop token"
    got, end, held = run(4)
    assert got == toks[:4] and end.finish_reason == "length"
    assert _same_state(held, fed(3)), f"{name} {kind}: state at the length limit"
    got, end, held = run(20, cancel_after=3)
    assert got == toks[:3] and end.finish_reason == "cancelled"
    assert _same_state(held, fed(2)), f"{name} {kind}: state after a cancel"


def test_two_states_alternate(models):
    name, kind, cpu, dev = models
    a, b = dev.new_state(64), dev.new_state(64)
    pa, pb = _prompt(dev.n_vocab, 5, seed=7), _prompt(dev.n_vocab, 6, seed=8)
    la = dev.forward(pa, a, logits="all")
    lb = dev.forward(pb, b, logits="all")
    la2 = dev.forward(pa[:2], a, logits="all")
    lb2 = dev.forward(pb[:2], b, logits="all")
    a1, b1 = dev.new_state(64), dev.new_state(64)
    assert np.array_equal(la, dev.forward(pa, a1, logits="all"))
    assert np.array_equal(la2, dev.forward(pa[:2], a1, logits="all"))
    assert np.array_equal(lb, dev.forward(pb, b1, logits="all"))
    assert np.array_equal(lb2, dev.forward(pb[:2], b1, logits="all"))


def test_captured_layers_close_to_cpu(models):
    name, kind, cpu, dev = models
    prompt = _prompt(cpu.n_vocab, 10, seed=9)
    layers = [0, 2]
    _, cap_ref = cpu.forward(prompt, cpu.new_state(32), logits="last", capture_layers=layers)
    _, cap = dev.forward(prompt, dev.new_state(32), logits="last", capture_layers=layers)
    for il in layers:
        assert cap[il].shape == cap_ref[il].shape
        assert _rel(cap[il], cap_ref[il]) <= 1e-2


def _generate(model, prompt, n, speculative=None):
    from daemons.generate import GenerationRequest, generate_all
    from daemons.tokenizer import Tokenizer
    tok = Tokenizer.from_metadata(model.metadata)
    return generate_all(model, tok, GenerationRequest(prompt_ids=tuple(prompt), max_tokens=n),
                        speculative=speculative)


def test_speculative_decoding_equals_greedy(models):
    """Oracle drafts corrupted at a random depth: every acceptance length and rollback occurs; the
    output must be the greedy output token for token (greedy verify reads only ids back)."""
    from daemons.speculative import OracleDrafter, SpeculativeDecoder
    name, kind, cpu, dev = models
    n = 20 if name == "emu" else 48
    for i in range(2 if name == "emu" else 4):
        prompt = _prompt(dev.n_vocab, 6 + i, seed=20 + i)
        greedy = _generate(dev, prompt, n)
        oracle = OracleDrafter(len(prompt), greedy.token_ids, 6, dev.n_vocab, seed=i)
        spec = SpeculativeDecoder(dev, oracle)
        got = _generate(dev, prompt, n, spec)
        assert got.token_ids == greedy.token_ids, f"prompt {i}"
        assert spec.stats.steps > 0


def test_sampled_generation_reads_only_candidates_and_equals_the_row(models, monkeypatch):
    """Sampled decoding on the step hands the host only the top_k (+ penalised) candidates
    (logits="topk_last", selected on the device); the tokens must be the ones sampling each whole
    row gives with the same seed."""
    from daemons.generate import GenerationRequest, generate_all
    from daemons.sampling import SamplingParams, top_candidates
    from daemons.tokenizer import Tokenizer
    name, kind, cpu, dev = models
    tok = Tokenizer.from_metadata(dev.metadata)
    prompt = _prompt(dev.n_vocab, 7, seed=3)
    n = 12 if name == "emu" else 40
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, repeat_penalty=1.2, repeat_last_n=32, seed=9)

    # the step's candidates are the largest logits of the row it computed
    st = dev.new_state(64)
    dev.forward(prompt, st, logits="none")
    ids, vals = dev.forward([prompt[-1]], st, logits="topk_last", top_k=25)
    st2 = dev.new_state(64)
    dev.forward(prompt, st2, logits="none")
    row = dev.forward([prompt[-1]], st2, logits="last")[0]
    ref_i, ref_v = top_candidates(row, 25)
    assert ids.tolist() == ref_i.tolist() and np.array_equal(vals, ref_v)
    st3 = cpu.new_state(64)                                # the same call without a GPU: from the host row
    cpu.forward(prompt, st3, logits="none")
    c_ids, c_vals = cpu.forward([prompt[-1]], st3, logits="topk_last", top_k=25)
    st4 = cpu.new_state(64)
    cpu.forward(prompt, st4, logits="none")
    c_ref = top_candidates(cpu.forward([prompt[-1]], st4, logits="last")[0], 25)
    assert c_ids.tolist() == c_ref[0].tolist() and np.array_equal(c_vals, c_ref[1])

    asked = []
    real_forward = dev.forward

    def spy(*a, **kw):
        asked.append(kw.get("logits", "last"))
        return real_forward(*a, **kw)

    monkeypatch.setattr(dev, "forward", spy)
    got = generate_all(dev, tok, GenerationRequest(prompt_ids=tuple(prompt), max_tokens=n, sampling=params))
    assert asked.count("topk_last") == n - 1, f"decode steps asked for {asked}"
    monkeypatch.setattr(type(dev), "device_topk_max", property(lambda self: 0))
    asked.clear()
    full = generate_all(dev, tok, GenerationRequest(prompt_ids=tuple(prompt), max_tokens=n, sampling=params))
    assert "topk_last" not in asked
    assert got.token_ids == full.token_ids


def test_sampled_speculative_decoding_verifies_with_device_top_k(models, monkeypatch):
    """Sampled speculative decoding on the step: each verify row's candidates are selected on the
    device (logits="topk": one launch over the block, T*(2k+1) words to the host) and equal the
    largest logits of the row an "all" verify returns; the output is the AR sample of the same
    seed (the exact-target-sampling rule of daemons/speculative.py)."""
    from daemons.generate import GenerationRequest, generate_all
    from daemons.sampling import SamplingParams, top_candidates
    from daemons.speculative import OracleDrafter, SpeculativeDecoder
    from daemons.tokenizer import Tokenizer
    name, kind, cpu, dev = models
    prompt = _prompt(dev.n_vocab, 9, seed=5)
    base = dev.new_state(96)
    dev.forward(prompt, base)
    block = _prompt(dev.n_vocab, 7, seed=6)
    rows, _, _ = dev.verify(block, base.copy(), logits="topk", top_k=30)
    full, _, _ = dev.verify(block, base.copy(), logits="all")
    assert len(rows) == len(block)
    for t, (ids, vals) in enumerate(rows):
        ref_i, ref_v = top_candidates(full[t], 30)
        assert ids.tolist() == ref_i.tolist() and np.array_equal(vals, ref_v), f"row {t}"

    tok = Tokenizer.from_metadata(dev.metadata)
    n = 16 if name == "emu" else 40
    params = SamplingParams(temperature=1.0, top_k=25, top_p=0.9, repeat_penalty=1.2, repeat_last_n=16, seed=21)
    req = GenerationRequest(prompt_ids=tuple(prompt), max_tokens=n, sampling=params)
    ar = generate_all(dev, tok, req)
    modes = []
    real_verify = dev.verify

    def spy(*a, **kw):
        modes.append(kw.get("logits"))
        return real_verify(*a, **kw)
    monkeypatch.setattr(dev, "verify", spy)
    oracle = OracleDrafter(len(prompt), list(ar.token_ids) + [0] * 8, 6, dev.n_vocab, seed=2)
    spec = SpeculativeDecoder(dev, oracle)
    got = generate_all(dev, tok, req, speculative=spec)
    assert got.token_ids == ar.token_ids
    assert modes and set(modes) == {"topk"} and got.stats.spec["accepted"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU is not None, reason=f"no GPU backend: {NO_GPU}")
def test_real_dflash_draft_on_the_step(tmp_path):
    """A (random) DFlash draft on a Q4_K_M-like target that runs through the GPU step: the draft
    reads the target's tensor-core LM head and raw embedding through the backend's operations,
    the target verifies through its graphs; output = greedy."""
    from daemons.dflash import DFlashDraft, DFlashDrafter
    from daemons.qwen35 import Qwen35Model
    from daemons.speculative import SpeculativeDecoder
    from kernels.cuda_backend import CudaBackend
    from tests.dflash_fixtures import build_zlab_draft
    path = tmp_path / "t.gguf"
    _write(path, "q4_k_m")
    model = Qwen35Model.load(path, CudaBackend())
    assert model.gpu_step is not None
    draft_dir = build_zlab_draft(tmp_path, model.hparams, target_layer_ids=(1, 2), mask_token_id=590, block_size=8)
    draft = DFlashDraft.load(draft_dir, model, model.backend)
    for seed in range(3):
        prompt = _prompt(model.n_vocab, 16, seed=40 + seed)
        greedy = _generate(model, prompt, 40)
        spec = SpeculativeDecoder(model, DFlashDrafter(draft))
        got = _generate(model, prompt, 40, spec)
        assert got.token_ids == greedy.token_ids
        assert spec.stats.steps > 0
