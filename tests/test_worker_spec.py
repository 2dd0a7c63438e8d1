"""Speculative decoding through ``dflashd worker --draft`` (real worker processes, ZeroMQ and stdio).

Two target/draft pairs, both tiny:

- **random**: the synthetic tiny qwen35 (3 Gated DeltaNet + 1 attention layer) with a random DFlash
  draft from ``tests/dflash_fixtures.py`` (in its Luce GGUF and z-lab directory forms).  The draft
  predicts nothing, so nearly every step rejects its chain and rolls the target back: the test of
  exactness.
- **alternating**: a scripted qwen35 whose greedy continuation of a line break is ``abab...`` and a
  draft whose layers write nothing, so it always proposes ``a``: from anchor ``b`` the first draft
  token is accepted and the second rejected (AL = 2), from anchor ``a`` nothing is.  The test of
  the counters, of the worker's defaults and of the per-request options.

What must hold: the worker's output equals greedy autoregressive decoding of the same model
(``daemons.generate`` without a draft, which the existing worker tests hold equal to a worker without
a draft); DONE carries consistent SpecStats; ``draft_max = 0`` is autoregressive; snapshot -> restore
-> generate with a draft equals the uninterrupted run (SpecStats included); PARK of the draft or
target and UNPARK follow the documented policy; a bad draft stops the worker with exit 2 and one
line.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from daemons.sampling import SamplingParams
from protocol.messages import (
    Done,
    ErrorCode,
    ErrorMessage,
    FinishReason,
    Generate,
    Park,
    Parked,
    ParkTarget,
    Restore,
    Slots,
    Snapshot,
    SnapshotInstructions,
    SpeculativeOptions,
    Stats,
    StatsReply,
    Unpark,
    Unparked,
    WorkerDead,
)
from tests.dflash_fixtures import build_zlab_draft, draft_forms
from tests.test_worker_stdio import StdioDaemon, fields, prompt_file
from tests.worker_helpers import REPO, Reference, RouterPeer, WorkerProcess, tiny_model, worker_command

BLOCK = 6  # draft block size of both pairs: up to 5 draft tokens per step
NEWLINE, A, B, MASK = 10, 97, 98, 1  # byte tokens of the synthetic vocabulary (token id b = byte b)


# ---- the alternating pair ----------------------------------------------------------------------------

def write_alternating_pair(root: Path) -> tuple[Path, Path]:
    """(target GGUF, z-lab draft directory), see the module docstring.

    Target: every layer's output projection is zero, so the residual stream at a position is the
    embedding of its token; embeddings of "\\n", "a", "b" are one-hot and `output` maps them to "a",
    "b", "a".  The mask token's embedding equals "b"'s.  Draft: zero o_proj / down_proj, so each
    block row's hidden state is the embedding it starts from: rows 1.. hold the mask token's, which
    the target's head (shared) maps to "a" with top-1 probability ~0.51, top-1 - top-2 margin ~0.51."""
    from daemons.gguf_writer import TensorData, write_gguf
    from daemons.synthetic import PRESETS, byte_vocab, qwen35_metadata, qwen35_tensor_shapes

    target = root / "alternating-qwen35.gguf"
    shape = PRESETS["tiny"]
    tokens, types, merges = byte_vocab()
    n_vocab = len(tokens)
    if not target.exists():
        rng = np.random.default_rng(11)
        emb = 0.05 * rng.standard_normal((n_vocab, shape.n_embd))
        out = np.zeros((n_vocab, shape.n_embd))
        for k, (src, dst) in enumerate([(NEWLINE, A), (A, B), (B, A)]):
            emb[src] = 0.0
            emb[src, k] = 1.0
            out[dst, k] = 1.0
        emb[MASK] = emb[B]
        tensors = []
        for name, shp in qwen35_tensor_shapes(shape, n_vocab).items():
            if name == "token_embd.weight":
                x = emb
            elif name == "output.weight":
                x = out
            elif name.endswith(("attn_output.weight", "ssm_out.weight", "ffn_down.weight")):
                x = np.zeros(shp)
            elif name.endswith("ssm_a"):
                x = -np.exp(rng.uniform(-1.0, 1.0, shp))
            elif len(shp) == 1 and "norm" in name:
                x = np.ones(shp)
            elif len(shp) == 1:
                x = 0.5 * rng.standard_normal(shp)
            else:
                x = rng.standard_normal(shp) / np.sqrt(shp[-1])
            tensors.append(TensorData(name, np.asarray(x, dtype=np.float32), QT.F32))
        write_gguf(target, "qwen35", qwen35_metadata(shape, tokens, types, merges, name="alternating-qwen35"),
                   tensors)

    class TargetShape:
        n_embd, n_layer = shape.n_embd, shape.n_layer

    TargetShape.n_vocab = n_vocab
    n_layer, n_head, head_dim, n_ff = 2, 4, 16, 96
    silent = {"norm.weight": np.ones(shape.n_embd, np.float32)}
    for il in range(n_layer):
        silent[f"layers.{il}.self_attn.o_proj.weight"] = np.zeros((shape.n_embd, n_head * head_dim), np.float32)
        silent[f"layers.{il}.mlp.down_proj.weight"] = np.zeros((shape.n_embd, n_ff), np.float32)
    draft = build_zlab_draft(root, TargetShape, name="alternating-draft", n_layer=n_layer, n_head=n_head,
                             head_dim=head_dim, n_ff=n_ff, block_size=BLOCK, mask_token_id=MASK,
                             extra_tensors=silent)
    return target, draft


def alternating(n: int) -> list[int]:
    """The alternating target's greedy continuation of a prompt ending in a line break."""
    return [A if i % 2 == 0 else B for i in range(n)]


# ---- fixtures ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("worker-spec")


@pytest.fixture(scope="module")
def model(root):
    return tiny_model(root)


@pytest.fixture(scope="module")
def ref(model):
    return Reference.load(model)


@pytest.fixture(scope="module")
def drafts(root, model, ref):
    """The random draft in its three forms; its mask token is the target's last vocabulary entry."""
    return draft_forms(root / "drafts", ref.model.hparams, target_gguf=model, block_size=BLOCK,
                       mask_token_id=ref.model.hparams.n_vocab - 1)


@pytest.fixture(scope="module")
def pair(root):
    return write_alternating_pair(root)


def start_worker(root, model, name, *extra):
    router = RouterPeer()
    proc = WorkerProcess(model, ["--connect", router.endpoint, "--worker-id", name, "--ctx-size", "512",
                                 "--batch-size", "16", "--snapshot-slots", "8", "--snapshot-budget", "8M", *extra],
                         root / f"{name}.log")
    try:
        router.wait_hello(60)
    except BaseException:
        proc.stop()
        print(proc.log_text())
        raise
    return router, proc


@pytest.fixture(scope="module")
def worker(root, model, drafts):
    """A ZeroMQ worker with the random draft (Luce GGUF form), default speculative settings."""
    router, proc = start_worker(root, model, "spec-random", "--draft", str(drafts["qwen35-dflash-draft"]))
    router.draft_path = drafts["qwen35-dflash-draft"]
    yield router
    proc.stop()
    router.close()


@pytest.fixture(scope="module")
def alt_worker(root, pair):
    """A ZeroMQ worker serving the alternating pair with --draft-max 4 as its default."""
    target, draft = pair
    router, proc = start_worker(root, target, "spec-alt", "--draft", str(draft), "--draft-max", "4")
    yield router
    proc.stop()
    router.close()


def gen(peer, rid, prompt, max_tokens, **kw):
    return peer.generate(Generate(request_id=rid, prompt_ids=np.asarray(prompt, dtype=np.int32),
                                  max_tokens=max_tokens, **kw))


def library_run(ref: Reference, draft_path: Path, prompt, max_tokens: int, params) -> tuple[list[int], dict]:
    """The same request through daemons.generate + SpeculativeDecoder in this process (no worker):
    (completion ids, spec counters)."""
    from daemons.dflash import DFlashDraft, DFlashDrafter
    from daemons.generate import GenerationRequest, generate_all
    from daemons.speculative import SpeculativeDecoder

    draft = DFlashDraft.load(draft_path, ref.model)
    decoder = SpeculativeDecoder(ref.model, DFlashDrafter(draft, context_window=512), params)
    req = GenerationRequest(prompt_ids=tuple(int(t) for t in prompt), max_tokens=max_tokens,
                            stop_ids=ref.tokenizer.stop_ids)
    r = generate_all(ref.model, ref.tokenizer, req, speculative=decoder)
    return list(r.token_ids) + ([r.stop_token] if r.stop_token is not None else []), r.stats.spec


def check_spec(done: Done, *, max_chain: int) -> None:
    """The invariants of one request's SpecStats (protocol DONE.spec)."""
    s = done.spec
    assert s is not None, "DONE without spec from a worker with a draft"
    assert s.steps >= 1 and s.drafted >= s.steps and s.drafted <= max_chain * s.steps
    assert 0 <= s.accepted <= s.drafted
    assert sum(s.accepted_per_position) == s.accepted and all(n <= s.steps for n in s.accepted_per_position)
    # every entry at depth i counts steps whose token i was accepted, which needs token i-1 accepted
    assert list(s.accepted_per_position) == sorted(s.accepted_per_position, reverse=True)
    assert s.acceptance_length == pytest.approx((s.accepted + s.steps) / s.steps)
    # the first token comes from the prefill; every later one from a step (verify or one-token)
    assert s.accepted + s.steps <= done.usage.completion_tokens - 1


# ---- ZeroMQ ----------------------------------------------------------------------------------------------

def test_zmq_output_equals_autoregressive_and_done_has_spec(worker, ref):
    # Guards: a draft changing the output (bad rollback of KV / conv / DeltaNet state, features taken
    # from the wrong layer or position), DONE without spec stats, and draft_max = 0 not meaning AR.
    h = worker.hello
    assert h.draft is not None and (h.draft.architecture, h.draft.block_size) == ("dflash", BLOCK)
    assert h.draft.model_id == "draft-luce" and h.draft.model_hash.startswith("sha256")
    specs = []
    for i, (n_prompt, n_gen) in enumerate([(40, 30), (7, 25), (150, 20)]):
        prompt = ref.long_prompt(n_prompt, n_gen)
        want, finish = ref.run(prompt, n_gen)
        ids, done = gen(worker, f"eq-{i}", prompt, n_gen)
        assert isinstance(done, Done), done
        assert ids == want and done.finish_reason.value == finish
        check_spec(done, max_chain=BLOCK - 1)
        specs.append(done.spec)
        ids, done = gen(worker, f"ar-{i}", prompt, n_gen, speculative=SpeculativeOptions(draft_max=0))
        assert ids == want and done.spec is None
    # T > 0: exact target sampling, so the seeded sample equals the autoregressive one
    sampling = SamplingParams(temperature=0.9, top_k=40, seed=1234)
    prompt = ref.long_prompt(30, 20)
    want, _ = ref.run(prompt, 20, sampling)
    ids, done = gen(worker, "sampled", prompt, 20, sampling=sampling)
    assert ids == want
    check_spec(done, max_chain=BLOCK - 1)
    specs.append(done.spec)
    # the counters are the library's for the same request: the draft saw the whole prompt (the worker
    # prefills it itself, in other chunks, and must hand the draft its features), and proposed the same
    # chains (with a margin cut at about the draft's median margin, so chain lengths follow its logits)
    from daemons.speculative import SpecParams
    prompt = ref.long_prompt(40, 30)
    want, lib_spec = library_run(ref, worker.draft_path, prompt, 30, SpecParams(draft_margin=0.01))
    ids, done = gen(worker, "as-library", prompt, 30, speculative=SpeculativeOptions(draft_margin=0.01))
    assert ids == want
    assert (done.spec.drafted, done.spec.steps) == (lib_spec["drafted"], lib_spec["steps"])
    assert 0 < done.spec.drafted < (BLOCK - 1) * done.spec.steps
    specs.append(done.spec)
    stats = worker.call(Stats(request_id="totals"))
    assert isinstance(stats, StatsReply) and stats.spec is not None
    assert (stats.spec.drafted, stats.spec.accepted, stats.spec.steps) == (
        sum(s.drafted for s in specs), sum(s.accepted for s in specs), sum(s.steps for s in specs))


def test_zmq_snapshot_restore_with_draft_equals_uninterrupted(worker, ref):
    # Guards: a restore that leaves the draft's feature ring empty or stale (the run would still be
    # token-identical, but propose differently: SpecStats would differ), and a restored state that
    # does not continue exactly.
    prompt = ref.long_prompt(40, 40)
    full, _ = ref.run(prompt, 40)
    # The random draft's chains are all rejected, so only a margin cut makes the counters depend on
    # what the draft computes: at 0.01 (about its median top-1 - top-2 margin) the chain lengths
    # follow its context, and a restore without the saved features gives other counts.
    margin = SpeculativeOptions(draft_margin=0.01)
    ids, saved = gen(worker, "save", prompt, 30, snapshot=SnapshotInstructions(save_slot=4, save_at=27),
                     speculative=margin)
    assert ids == full[:30] and saved.saved is not None and saved.saved.n_tokens == 27
    gen(worker, "other", prompt[:9], 5)  # the working state now holds something else
    ids, restored = gen(worker, "restore", prompt, 30, snapshot=SnapshotInstructions(restore_slot=4),
                        speculative=margin)
    assert ids == full[:30] and restored.usage.cached_tokens == 27
    assert restored.spec == saved.spec  # the same proposals, step for step
    assert 0 < saved.spec.drafted < (BLOCK - 1) * saved.spec.steps  # the margin did cut chains
    # SNAPSHOT of the state a finished generation left (prompt + 29 generated tokens), RESTORE into the
    # current state, then continue through restore_slot: the uninterrupted run's tokens 30..39
    ids, _ = gen(worker, "cont-a", prompt, 30)
    reply = worker.call(Snapshot(slot=5, request_id="snap-5"))
    assert isinstance(reply, Slots) and reply.current_tokens == 40 + 29
    # each slot holds, per position, the target's KV rows, the token id and the draft's features
    # (2 target layers x n_embd float32) with their position
    hp = ref.model.hparams
    per_position = 2 * len(hp.attention_layers) * hp.n_head_kv * hp.head_dim * 4 + 4 + (2 * hp.n_embd * 4 + 8)
    by_slot = {s.slot: s.bytes for s in reply.slots}
    assert by_slot[5] - by_slot[4] == (69 - 27) * per_position
    gen(worker, "other-2", prompt[:5], 3)
    assert isinstance(worker.call(Restore(slot=5, request_id="restore-5")), Slots)
    longer = np.concatenate([prompt, np.asarray(full[:30], dtype=np.int32)])
    ids, done = gen(worker, "cont-b", longer, 10, snapshot=SnapshotInstructions(restore_slot=5))
    assert ids == full[30:40] and done.usage.cached_tokens == 69
    check_spec(done, max_chain=BLOCK - 1)


def test_zmq_park_draft_and_target(worker, ref):
    # Guards: park draft freeing nothing or breaking generation (it must go on autoregressively),
    # park target leaving the draft loaded on weights that are gone, unpark not bringing it back.
    prompt = ref.long_prompt(20, 12)
    want, _ = ref.run(prompt, 12)

    def parked():
        return set(worker.call(Stats(request_id="st")).parked)

    reply = worker.call(Park(target=ParkTarget.DRAFT, request_id="park-d"))
    assert isinstance(reply, Parked) and reply.target == ParkTarget.DRAFT
    assert parked() == {ParkTarget.DRAFT}
    ids, done = gen(worker, "while-draft-parked", prompt, 12)
    assert ids == want and done.spec is None
    # the draft was parked on purpose: bringing the target back (a no-op here) leaves it parked
    assert worker.call(Unpark(target=ParkTarget.TARGET, request_id="unpark-t0")).loaded_bytes == 0
    assert parked() == {ParkTarget.DRAFT}
    reply = worker.call(Unpark(target=ParkTarget.DRAFT, request_id="unpark-d"))
    assert isinstance(reply, Unparked) and reply.loaded_bytes > 0 and parked() == set()
    ids, done = gen(worker, "draft-back", prompt, 12)
    assert ids == want and done.spec is not None and done.spec.steps >= 1

    # parking the target takes the draft with it; unparking the target brings both back
    assert isinstance(worker.call(Park(target=ParkTarget.TARGET, request_id="park-t")), Parked)
    assert parked() == {ParkTarget.TARGET, ParkTarget.DRAFT}
    ids, err = gen(worker, "while-parked", prompt, 12)
    assert ids == [] and isinstance(err, ErrorMessage) and err.code == ErrorCode.MODEL_PARKED
    # UNPARK draft while the target is parked: nothing loads now
    assert worker.call(Unpark(target=ParkTarget.DRAFT, request_id="unpark-d2")).loaded_bytes == 0
    reply = worker.call(Unpark(target=ParkTarget.TARGET, request_id="unpark-t"))
    assert isinstance(reply, Unparked) and reply.loaded_bytes > 0 and parked() == set()
    ids, done = gen(worker, "all-back", prompt, 12)
    assert ids == want and done.spec is not None


def test_zmq_acceptance_defaults_and_per_request_options(alt_worker):
    # Guards: SpecStats not reflecting what was accepted, the worker's --draft-max default not
    # applied, and per-request options (draft_max, draft_min, draft_margin) not overriding it.
    prompt = [ord(c) for c in "hi\n"]
    want = alternating(21)

    def run(rid, **kw):
        ids, done = gen(alt_worker, rid, prompt, 21, **kw)
        assert isinstance(done, Done), done
        assert ids == want
        return done.spec

    s = run("default")  # --draft-max 4: chains of 4 (shorter only where max_tokens is near)
    assert s.drafted <= 4 * s.steps and s.drafted > 3 * s.steps
    # from anchor "b" the first draft token is accepted and the second rejected; from "a" none is
    assert s.accepted >= 9 and s.accepted_per_position == (s.accepted,)
    assert s.acceptance_length == pytest.approx((s.accepted + s.steps) / s.steps) and s.acceptance_length > 1.8
    s = run("max-1", speculative=SpeculativeOptions(draft_max=1))
    assert s.drafted == s.steps and s.accepted_per_position == (s.accepted,)
    s = run("max-5", speculative=SpeculativeOptions(draft_max=5))  # above the worker's default
    assert s.drafted > 4 * s.steps - 4
    # the draft's top-1 - top-2 margin is ~0.51: 0.6 cuts every chain to nothing, 0.3 none
    s = run("margin-high", speculative=SpeculativeOptions(draft_margin=0.6))
    assert (s.steps, s.drafted, s.accepted) == (0, 0, 0)
    assert run("margin-low", speculative=SpeculativeOptions(draft_margin=0.3)).steps >= 9
    # draft_min 4 (with the default draft_max 4): the shorter chains near max_tokens are not verified
    s = run("min-cut", speculative=SpeculativeOptions(draft_min=4, draft_margin=0.3))
    assert s.steps >= 5 and s.drafted == 4 * s.steps
    assert run("ar", speculative=SpeculativeOptions(draft_max=0)) is None
    # a stop string completed by the first token of a step ([a, b] from anchor "b"): the worker keeps
    # the state autoregressive decoding would hold (prompt + a, b), not the whole step
    ids, done = gen(alt_worker, "stop", prompt, 20, stop=["ba"])
    assert ids == [A, B, A] and done.finish_reason == FinishReason.STOP and done.spec.accepted == 1
    assert alt_worker.call(Snapshot(slot=1, request_id="after-stop")).current_tokens == len(prompt) + 2
    # draft_min 5 against the worker's draft_max 4: an invalid combination, refused per request
    ids, err = gen(alt_worker, "bad-min", prompt, 5, speculative=SpeculativeOptions(draft_min=5))
    assert ids == [] and isinstance(err, ErrorMessage) and err.code == ErrorCode.BAD_MESSAGE
    assert "draft_min" in err.message


# ---- stdio -------------------------------------------------------------------------------------------

def test_stdio_speculative_by_default(root, model, drafts, ref):
    # Guards: the stdio transport ignoring the draft (the reference daemon speculates whenever a
    # draft is loaded), its counters missing from the reply line, and park/unpark draft over stdio.
    # --draft-margin 0.01 makes the counters depend on the draft's context (see the ZeroMQ restore test)
    d = StdioDaemon(model, root / "stdio-spec.log", "--draft", str(drafts["z-lab"]), "--draft-margin", "0.01")
    try:
        assert d.line(60) == "[daemon] ready"
        prompt = ref.long_prompt(33, 24)
        want, _ = ref.run(prompt, 24)
        path = prompt_file(root, "spec.bin", prompt)
        f = fields(d.cmd(f"{path} 24"))
        assert d.take_request() == want
        assert (int(f["N"]), int(f["gen"]), f["finish"]) == (33, 24, "length")
        drafted, accepted, steps = int(f["draft_n"]), int(f["draft_n_accepted"]), int(f["spec_steps"])
        assert steps >= 1 and steps <= drafted < (BLOCK - 1) * steps and 0 <= accepted <= drafted
        assert float(f["accept_len"]) == pytest.approx((accepted + steps) / steps, abs=1e-3)
        # snap= during prefill, then RESTORE: same tokens and the same draft counters
        f_save = fields(d.cmd(f"{path} 24 snap=20:3"))
        assert d.take_request() == want and f_save["snap_pos"] == "20"
        f_rest = fields(d.cmd(f"RESTORE 3 {path} 24"))
        assert d.take_request() == want and f_rest["prefix_len"] == "20"
        assert [f_rest[k] for k in ("draft_n", "draft_n_accepted", "spec_steps")] == \
            [f_save[k] for k in ("draft_n", "draft_n_accepted", "spec_steps")]
        # park the draft: plain decoding, no counters; unpark: speculative again
        assert d.cmd("park draft").startswith("ok park target=draft released_bytes=")
        assert d.take_request() == []
        f = fields(d.cmd(f"{path} 24"))
        assert d.take_request() == want and "draft_n" not in f
        assert d.cmd("unpark draft").startswith("ok unpark target=draft loaded_bytes=")
        assert d.take_request() == []
        f = fields(d.cmd(f"{path} 24"))
        assert d.take_request() == want and int(f["spec_steps"]) >= 1
    finally:
        assert d.close() == 0


# ---- bad drafts ------------------------------------------------------------------------------------------

def one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_bad_draft_exits_2_with_one_line(root, model, ref):
    # Guards: a draft that does not fit the target being accepted (and failing mid-request), or
    # refused with a traceback instead of one line.
    def run(*args):
        return subprocess.run(worker_command(model, *args, "--stdio"), cwd=REPO, capture_output=True, text=True,
                              timeout=60, stdin=subprocess.DEVNULL)

    line = one_error_line(run("--draft", str(model)))  # a target is not a draft
    assert "not a DFlash draft" in line and str(model) in line
    wrong_mask = build_zlab_draft(root / "bad", ref.model.hparams, name="wrong-mask", mask_token_id=5000)
    line = one_error_line(run("--draft", str(wrong_mask)))
    assert "mask token id 5000" in line
    wrong_layer = build_zlab_draft(root / "bad", ref.model.hparams, name="wrong-layer", target_layer_ids=(1, 9),
                                   mask_token_id=3)
    assert "target layer id 9" in one_error_line(run("--draft", str(wrong_layer)))
    assert "no such file" in one_error_line(run("--draft", str(root / "missing.gguf")))
    assert "need --draft" in one_error_line(run("--draft-max", "3"))
    assert "exceeds" in one_error_line(run("--draft", str(wrong_mask), "--draft-max", "2", "--draft-min", "3"))
    # over ZeroMQ the router hears why before the process exits
    router = RouterPeer()
    proc = WorkerProcess(model, ["--connect", router.endpoint, "--worker-id", "spec-bad", "--draft", str(wrong_mask)],
                         root / "spec-bad.log")
    try:
        msg = router.recv(60)
        assert isinstance(msg, WorkerDead) and msg.code == ErrorCode.ADAPTER_UNAVAILABLE
        assert "mask token id 5000" in msg.reason
        assert proc.proc.wait(30) == 2
    finally:
        proc.stop()
        router.close()
