"""The worker core in-process: snapshot/restore exactness, cancellation latency, the snapshot byte
budget, park/unpark, queueing and shutdown rules, error codes, and the heartbeat monitor's rules.

Each test names the bug it guards against.
"""
from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import pytest

from daemons.sampling import SamplingParams
from daemons.worker import WorkerConfig, WorkerConfigError, model_fingerprint
from protocol.liveness import HeartbeatMonitor
from protocol.messages import (
    Cancel,
    Done,
    ErrorCode,
    ErrorMessage,
    FinishReason,
    FreeSnapshot,
    Generate,
    ListSlots,
    Park,
    Parked,
    ParkTarget,
    Restore,
    Shutdown,
    Slots,
    Snapshot,
    SnapshotInstructions,
    Stats,
    StatsReply,
    Tokens,
    Unpark,
    Unparked,
)
from tests.worker_helpers import CoreHarness, Reference, tiny_model

CHUNK = 16  # small prefill chunks, so prompts of a few dozen tokens cross several chunk boundaries


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("worker-core"))


@pytest.fixture(scope="module")
def ref(model_path):
    return Reference.load(model_path)


@pytest.fixture(scope="module")
def harness(model_path):
    # Its own copy of the file, so that "is the file still mapped" sees only the worker's mapping
    # (the reference model maps the original).
    served = model_path.with_name("served-" + model_path.name)
    shutil.copyfile(model_path, served)
    h = CoreHarness(WorkerConfig(model_path=str(served), n_ctx=512, prefill_chunk=CHUNK,
                                 n_snapshot_slots=8, snapshot_budget_bytes=4 << 20, max_queued=4))
    yield h
    h.close()


@pytest.fixture(scope="module")
def prompt(ref):
    return ref.long_prompt(45, 40)


# ---- configuration ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, fragment", [
    (dict(device="gpu"), "device"),
    (dict(n_ctx=-1), "context size"),
    (dict(n_snapshot_slots=65), "snapshot slots"),
    (dict(snapshot_budget_bytes=-5), "snapshot budget"),
    (dict(worker_id="has space"), "worker id"),
    (dict(heartbeat_interval_s=0), "heartbeat interval"),
    (dict(heartbeat_liveness=0), "liveness"),
    (dict(prefill_chunk=0), "batch size"),
])
def test_config_rejects_bad_values_with_one_line(kwargs, fragment):
    # Guards: a bad flag surfacing as a traceback deep inside the worker instead of a typed error.
    with pytest.raises(WorkerConfigError) as e:
        WorkerConfig(model_path="m.gguf", **kwargs)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_fingerprint_changes_with_content(tmp_path):
    # Guards: a model hash that ignores the weights, letting caches mix two different models.
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"x" * 1000)
    b.write_bytes(b"x" * 999 + b"y")
    assert model_fingerprint(str(a)) != model_fingerprint(str(b))
    assert model_fingerprint(str(a)) == model_fingerprint(str(a))


# ---- generation and snapshots ----------------------------------------------------------------------

def test_plain_generation_matches_the_generation_loop(harness, ref, prompt):
    # Guards: the worker's chunked prefill schedule or its TOKENS bookkeeping changing the output.
    ids, done = harness.generate("plain", prompt, 40)
    want, reason = ref.run(prompt, 40)
    assert isinstance(done, Done), done
    assert ids == want and done.finish_reason.value == reason == "length"
    assert done.usage.prompt_tokens == 45 and done.usage.completion_tokens == 40 and done.usage.cached_tokens == 0
    assert done.timings.prompt_ms > 0 and done.timings.ttft_ms >= done.timings.prompt_ms * 0.99


@pytest.mark.parametrize("save_at", [CHUNK * 2, 21, 44, 1000])
def test_snapshot_restore_equals_uninterrupted(harness, ref, prompt, save_at):
    # Guards: a snapshot missing part of the state (conv rows, DeltaNet state, KV rows, n_past) or a
    # restore that re-prefills from the wrong position: the continuation would diverge.
    want, _ = ref.run(prompt, 40)
    ids, done = harness.generate(f"save-{save_at}", prompt, 40,
                                 snapshot=SnapshotInstructions(save_slot=2, save_at=save_at))
    assert isinstance(done, Done) and ids == want
    expected_pos = min(save_at, len(prompt) - 1)  # the last prompt token is prefilled by the decode loop
    assert done.saved.slot == 2 and done.saved.n_tokens == expected_pos
    listing = harness.call(ListSlots(request_id=f"ls-{save_at}"))
    assert [s.slot for s in listing.slots] == [2] and listing.slots[0].n_tokens == expected_pos
    # Something else runs in between and replaces the current state.
    harness.generate(f"other-{save_at}", prompt[::-1].copy(), 5)
    ids2, done2 = harness.generate(f"restore-{save_at}", prompt, 40, snapshot=SnapshotInstructions(restore_slot=2))
    assert isinstance(done2, Done), done2
    assert done2.usage.cached_tokens == expected_pos
    assert ids2 == want
    harness.call(FreeSnapshot(slot=2, request_id=f"free-{save_at}"))


def test_restore_with_a_slot_that_is_not_a_prefix_prefills_from_scratch(harness, ref, prompt):
    # Guards: restoring a slot whose tokens differ from the prompt (a wrong cache hit).
    harness.generate("s5", prompt, 3, snapshot=SnapshotInstructions(save_slot=5, save_at=30))
    other = prompt.copy()
    other[3] = (other[3] + 1) % 256
    ids, done = harness.generate("r5", other, 20, snapshot=SnapshotInstructions(restore_slot=5))
    assert done.usage.cached_tokens == 0
    assert ids == ref.run(other, 20)[0]


def test_snapshot_command_and_sampler_rng_continue_exactly(harness, ref, prompt):
    # Guards: a snapshot that forgets the sampler's RNG position: a seeded sampled continuation after
    # RESTORE would then repeat earlier draws instead of continuing the sequence.
    sampling = SamplingParams(temperature=0.9, top_k=50, seed=1234)
    full, reason = ref.run(prompt, 30, sampling)
    first, done = harness.generate("seeded-a", prompt, 10, sampling=sampling)
    assert first == full[:10] and isinstance(done, Done)
    snap = harness.call(Snapshot(slot=1, request_id="snap1"))
    assert isinstance(snap, Slots)
    # The current state covers the prompt and every generated token but the last.
    assert snap.current_tokens == len(prompt) + 9
    assert {s.slot: s.n_tokens for s in snap.slots}[1] == len(prompt) + 9
    harness.generate("in-between", prompt[:20], 4)
    cont_prompt = np.concatenate([prompt, np.asarray(first, dtype=np.int32)])
    rest, done2 = harness.generate("seeded-b", cont_prompt, 20, sampling=sampling,
                                   snapshot=SnapshotInstructions(restore_slot=1))
    assert done2.usage.cached_tokens == len(prompt) + 9
    assert rest == full[10:30]


def test_restore_command_makes_a_slot_current(harness, prompt):
    # Guards: RESTORE leaving the old current state in place (a later SNAPSHOT would save the wrong one).
    harness.generate("r-a", prompt, 2, snapshot=SnapshotInstructions(save_slot=6, save_at=20))
    harness.generate("r-b", prompt[:10], 2)
    restored = harness.call(Restore(slot=6, request_id="rest"))
    assert isinstance(restored, Slots) and restored.current_tokens == 20
    again = harness.call(Snapshot(slot=7, request_id="snap7"))
    assert {s.slot: s.n_tokens for s in again.slots}[7] == 20
    for s in (6, 7):
        harness.call(FreeSnapshot(slot=s, request_id=f"f{s}"))


def test_prefill_only_request_saves_the_whole_prompt(harness, prompt):
    # Guards: max_tokens=0 (prefill for a snapshot) being rejected or saving short of the prompt.
    ids, done = harness.generate("prefill", prompt, 0, snapshot=SnapshotInstructions(save_slot=0))
    assert ids == [] and done.finish_reason == FinishReason.LENGTH
    assert done.saved.n_tokens == len(prompt) and done.usage.completion_tokens == 0
    harness.call(FreeSnapshot(slot=0, request_id="f0"))


def test_snapshot_errors(harness, prompt):
    # Guards: slot misuse crashing the loop or succeeding silently.
    assert harness.call(Restore(slot=3, request_id="e1")).code == ErrorCode.EMPTY_SLOT
    r = harness.call(Generate(request_id="e2", prompt_ids=prompt, max_tokens=2,
                              snapshot=SnapshotInstructions(restore_slot=4)))
    assert r.code == ErrorCode.EMPTY_SLOT
    # The worker offers 8 slots: 8..63 are valid on the wire but not here.
    assert harness.call(Snapshot(slot=8, request_id="e3")).code == ErrorCode.INVALID_SNAPSHOT_SLOT
    r = harness.call(Generate(request_id="e4", prompt_ids=prompt, max_tokens=2,
                              snapshot=SnapshotInstructions(save_slot=9)))
    assert r.code == ErrorCode.INVALID_SNAPSHOT_SLOT
    # After an ERROR there is no current state to snapshot.
    assert harness.call(Snapshot(slot=0, request_id="e5")).code == ErrorCode.EMPTY_SLOT


def test_snapshot_budget_is_enforced_before_any_token(model_path, prompt):
    # Guards: snapshots growing past the host-memory budget, or a failed save after tokens were sent.
    from daemons.worker import create_runtime
    per = create_runtime(WorkerConfig(model_path=str(model_path)))
    per.load()
    size_30 = per.snapshot_nbytes(30) + 4 * 30
    h = CoreHarness(WorkerConfig(model_path=str(model_path), n_ctx=256, prefill_chunk=CHUNK, n_snapshot_slots=4,
                                 snapshot_budget_bytes=size_30 + size_30 // 2))
    try:
        _, done = h.generate("b1", prompt, 3, snapshot=SnapshotInstructions(save_slot=0, save_at=30))
        assert done.saved.bytes == size_30  # the estimate used for the budget is the real size
        msgs_before = len(h.sink.messages)
        r = h.call(Generate(request_id="b2", prompt_ids=prompt, max_tokens=3,
                            snapshot=SnapshotInstructions(save_slot=1, save_at=30)))
        assert r.code == ErrorCode.OUT_OF_MEMORY
        assert not [m for m in h.sink.messages[msgs_before:] if isinstance(m, Tokens)]
        # Replacing the same slot only counts the new size.
        _, done = h.generate("b3", prompt, 3, snapshot=SnapshotInstructions(save_slot=0, save_at=30))
        assert isinstance(done, Done)
        assert h.call(Snapshot(slot=1, request_id="b4")).code == ErrorCode.OUT_OF_MEMORY
        listing = h.call(ListSlots(request_id="b5"))
        assert listing.used_bytes == size_30 and listing.used_bytes <= listing.budget_bytes
    finally:
        h.close()


# ---- cancellation ----------------------------------------------------------------------------------

def test_cancel_stops_within_one_decode_step(harness, ref, prompt):
    # Guards: CANCEL only being noticed at the end of the request (or not at all) and a cancelled
    # request leaving the worker unable to serve the next one.
    long_prompt = ref.long_prompt(20, 300)
    seen = threading.Event()

    def on_message(msg):
        if isinstance(msg, Tokens) and msg.request_id == "long" and msg.offset + len(msg.ids) >= 5:
            seen.set()

    harness.sink.hooks.append(on_message)
    try:
        harness.core.submit(Generate(request_id="long", prompt_ids=long_prompt, max_tokens=300))
        assert seen.wait(30)
        harness.core.submit(Cancel(request_id="long"))  # from another thread, mid-generation
        done = harness.sink.wait_final("long")
    finally:
        harness.sink.hooks.remove(on_message)
    assert isinstance(done, Done) and done.finish_reason == FinishReason.CANCELLED
    report = harness.core.last_cancel
    print(f"\ncancel: {report.tokens_at_cancel} tokens at CANCEL, {report.tokens_final} at the end, "
          f"{report.steps_after_cancel} model steps begun after it")
    assert report.steps_after_cancel == 0  # the step running when CANCEL came finishes; none starts
    assert report.tokens_final - report.tokens_at_cancel <= 1
    assert done.usage.completion_tokens == report.tokens_final < 300
    assert len(harness.sink.tokens("long")) == done.usage.completion_tokens
    # The next request runs normally.
    ids, done = harness.generate("after-cancel", prompt, 40)
    assert ids == ref.run(prompt, 40)[0] and done.finish_reason == FinishReason.LENGTH


def test_cancel_of_a_queued_request_and_unknown_ids(harness, ref, prompt):
    # Guards: a queued request that was cancelled still running later, or never getting its DONE.
    long_prompt = ref.long_prompt(20, 200)
    harness.core.submit(Generate(request_id="q-run", prompt_ids=long_prompt, max_tokens=200))
    harness.core.submit(Generate(request_id="q-wait", prompt_ids=prompt, max_tokens=5))
    harness.core.submit(Cancel(request_id="q-wait"))
    harness.core.submit(Cancel(request_id="never-seen"))  # ignored
    done_wait = harness.sink.wait_final("q-wait")
    assert done_wait.finish_reason == FinishReason.CANCELLED and done_wait.usage.completion_tokens == 0
    harness.core.submit(Cancel(request_id="q-run"))
    assert harness.sink.wait_final("q-run").finish_reason == FinishReason.CANCELLED
    assert harness.sink.tokens("q-wait") == []


def test_busy_queue_duplicate_ids_and_context_overflow(harness, ref, prompt):
    # Guards: an unbounded queue, a duplicate id corrupting the reply stream, a prompt past n_ctx.
    release = threading.Event()
    paused = threading.Event()

    def hold(msg):  # runs on the compute thread: parks the running generation at its first token
        if isinstance(msg, Tokens) and msg.request_id == "busy-0" and msg.offset == 0:
            paused.set()
            release.wait(30)

    harness.sink.hooks.append(hold)
    try:
        harness.core.submit(Generate(request_id="busy-0", prompt_ids=prompt, max_tokens=20))
        assert paused.wait(30)
        for i in range(1, 5):  # max_queued = 4 wait behind it
            harness.core.submit(Generate(request_id=f"busy-{i}", prompt_ids=prompt, max_tokens=1))
        harness.core.submit(Generate(request_id="busy-5", prompt_ids=prompt, max_tokens=1))
        assert harness.sink.wait_final("busy-5").code == ErrorCode.BUSY
        harness.core.submit(Generate(request_id="busy-1", prompt_ids=prompt, max_tokens=1))
        harness.core.submit(Generate(request_id="busy-0", prompt_ids=prompt, max_tokens=1))
        dup = [m for m in harness.sink.messages if isinstance(m, ErrorMessage) and m.request_id is None
               and m.code == ErrorCode.BAD_MESSAGE and ("busy-1" in m.message or "busy-0" in m.message)]
        assert len(dup) == 2
        stats = harness.call(Stats(request_id="st"))  # answered at once, mid-generation
        assert isinstance(stats, StatsReply) and stats.active == 1 and stats.queued == 4
    finally:
        release.set()
        harness.sink.hooks.remove(hold)
    assert harness.sink.wait_final("busy-0").finish_reason == FinishReason.LENGTH
    for i in range(1, 5):
        assert isinstance(harness.sink.wait_final(f"busy-{i}"), Done)
    r = harness.call(Generate(request_id="ovf", prompt_ids=prompt, max_tokens=512))
    assert r.code == ErrorCode.CONTEXT_OVERFLOW
    r = harness.call(Generate(request_id="vocab", prompt_ids=np.array([1, 10**6], dtype=np.int32), max_tokens=1))
    assert r.code == ErrorCode.BAD_MESSAGE


def test_stop_token_is_sent_and_counted(harness, ref):
    # Guards: the token that ends generation missing from TOKENS / usage (PROTOCOL.md "TOKENS").
    for seed in range(40):
        p = np.random.default_rng(seed).integers(0, 256, 8).astype(np.int32)
        want, reason = ref.run(p, 60)
        if reason == "stop":
            break
    else:
        pytest.skip("no prompt of this model reaches an end-of-generation token")
    ids, done = harness.generate("eog", p, 60)
    assert ids == want and ids[-1] in ref.tokenizer.stop_ids
    assert done.finish_reason == FinishReason.STOP and done.usage.completion_tokens == len(want)


def test_prompt_text_is_tokenized(harness, ref):
    # Guards: prompt_text ignored or tokenized differently from the model's tokenizer.
    text = "the cat sat on the mat"
    ids = ref.tokenizer.encode(text, add_special=True, parse_special=True)
    harness.core.submit(Generate(request_id="text", prompt_text=text, max_tokens=6))
    done = harness.sink.wait_final("text")
    assert done.usage.prompt_tokens == len(ids)
    assert harness.sink.tokens("text") == ref.run(ids, 6)[0]


# ---- park ------------------------------------------------------------------------------------------

def test_park_unpark_in_process(harness, ref, prompt):
    # Guards: GENERATE running on freed weights, a park that keeps the map, unpark not restoring service,
    # snapshots lost by parking.
    harness.generate("pk-save", prompt, 2, snapshot=SnapshotInstructions(save_slot=3, save_at=32))
    parked = harness.call(Park(request_id="pk"))
    assert isinstance(parked, Parked) and parked.target == ParkTarget.ALL
    assert harness.core.runtime.model is None
    from daemons.memory import mapped_file_bytes
    assert mapped_file_bytes(harness.core.runtime.path) == 0, "the weights file is still mapped after PARK"
    assert harness.call(Park(request_id="pk2")).released_bytes == 0  # already parked
    assert harness.call(Stats(request_id="pk-st")).parked == (ParkTarget.TARGET,)
    r = harness.call(Generate(request_id="pk-gen", prompt_ids=prompt, max_tokens=3))
    assert r.code == ErrorCode.MODEL_PARKED
    assert harness.call(Park(target=ParkTarget.DRAFT, request_id="pk-d")).released_bytes == 0
    un = harness.call(Unpark(request_id="un"))
    assert isinstance(un, Unparked) and un.loaded_bytes == harness.core.runtime.weight_bytes > 0
    assert harness.call(Unpark(request_id="un2")).loaded_bytes == 0
    ids, done = harness.generate("pk-after", prompt, 40, snapshot=SnapshotInstructions(restore_slot=3))
    assert done.usage.cached_tokens == 32 and ids == ref.run(prompt, 40)[0]
    harness.call(FreeSnapshot(slot=3, request_id="pk-f"))


# ---- shutdown --------------------------------------------------------------------------------------

def test_shutdown_without_drain_cancels_everything(model_path, ref, prompt):
    # Guards: SHUTDOWN(drain=false) leaving requests without their DONE, or commands that never answer.
    h = CoreHarness(WorkerConfig(model_path=str(model_path), n_ctx=512, prefill_chunk=CHUNK))
    long_prompt = ref.long_prompt(20, 300)
    h.core.submit(Generate(request_id="s-run", prompt_ids=long_prompt, max_tokens=300))
    h.core.submit(Generate(request_id="s-wait", prompt_ids=prompt, max_tokens=3))
    h.core.submit(ListSlots(request_id="s-ls"))
    while not h.sink.tokens("s-run"):
        time.sleep(0.005)
    h.core.submit(Shutdown(drain=False))
    assert h.sink.wait_final("s-run").finish_reason == FinishReason.CANCELLED
    assert h.sink.wait_final("s-wait").finish_reason == FinishReason.CANCELLED
    assert h.sink.wait_final("s-ls").code == ErrorCode.CANCELLED
    h.thread.join(10)
    assert not h.thread.is_alive()
    h.core.submit(Generate(request_id="late", prompt_ids=prompt, max_tokens=1))
    assert h.sink.wait_final("late").code == ErrorCode.BUSY


# ---- heartbeat monitor -----------------------------------------------------------------------------

def test_heartbeat_monitor_rules():
    # Guards: a monitor declaring live peers dead (or never declaring dead ones), or reporting one twice.
    m = HeartbeatMonitor(interval_s=1.0, liveness=3, clock=lambda: 0.0)
    assert m.timeout_s == 3.0 and m.next_deadline(0.0) is None
    m.seen(b"a", now=0.0)
    m.seen(b"b", now=1.0)
    assert m.due(now=0.5) == [] and m.due(now=1.0) == [b"a"]
    m.sent(b"a", now=1.0)
    assert m.next_deadline(now=1.5) == pytest.approx(0.5)  # b is due at 2.0
    assert m.expired(now=2.9) == []
    m.seen(b"a", now=2.5)
    assert m.expired(now=3.9) == []
    assert m.expired(now=4.0) == [b"b"] and b"b" not in m
    assert m.expired(now=4.1) == []  # reported once
    assert m.expired(now=5.5) == [b"a"] and len(m) == 0
    with pytest.raises(ValueError):
        HeartbeatMonitor(interval_s=0)
