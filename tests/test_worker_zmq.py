"""Live ``dflashd worker --connect`` processes driven from a ZeroMQ ROUTER socket in the test.

- >= 2,000 hostile frames: each answered by ERROR (or, for undecodable ERROR frames, dropped with a
  log line); the worker then still serves a valid GENERATE exactly; its RSS stays bounded.
- snapshot at a prefix -> restore -> generate equals the uninterrupted greedy run.
- CANCEL stops a running generation within one decode step; the next request runs normally.
- PARK lowers the worker's RSS by at least the weights' size; UNPARK restores service.
- a SIGKILLed worker is detected through missing heartbeats within the configured timeout.
"""
from __future__ import annotations

import os
import random
import re
import signal
import time

import msgpack
import numpy as np
import pytest

from protocol import framing
from protocol.liveness import HeartbeatMonitor
from protocol.messages import (
    PROTOCOL_VERSION,
    WORKER_ACCEPTS,
    Cancel,
    Done,
    ErrorCode,
    ErrorMessage,
    FinishReason,
    Generate,
    Heartbeat,
    Hello,
    Park,
    Parked,
    ProtocolError,
    Shutdown,
    SnapshotInstructions,
    Stats,
    StatsReply,
    Tokens,
    Unpark,
    Unparked,
    WorkerDead,
)
from tests.test_protocol import sample_messages
from tests.worker_helpers import Reference, RouterPeer, WorkerProcess, park_model, tiny_model, weight_bytes

N_FUZZ = 2100
MAX_FUZZ_RSS_GROWTH = 64 << 20


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("worker-zmq")


@pytest.fixture(scope="module")
def model(root):
    return tiny_model(root)


@pytest.fixture(scope="module")
def ref(model):
    return Reference.load(model)


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
def worker(root, model):
    router, proc = start_worker(root, model, "zmq-tiny")
    yield router, proc
    proc.stop()  # before the router closes, so its WORKER_DEAD is delivered instead of lingering
    router.close()


# ---- fuzzing ---------------------------------------------------------------------------------------

def _valid_worker_bodies() -> list[tuple[bytes, dict, list[bytes]]]:
    out = []
    for msg in sample_messages():
        if type(msg) in WORKER_ACCEPTS:
            frames = [bytes(f) for f in framing.encode(msg)]
            out.append((frames[0], msgpack.unpackb(frames[1], raw=False), frames[2:]))
    return out


VALID = _valid_worker_bodies()
FIELD_NAMES = sorted({k for _, body, _ in VALID for k in body} | {"__nd__", "dtype", "shape", "slot", "seed"})


def _random_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth < 3 and r < 0.15:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if depth < 3 and r < 0.3:
        return {rng.choice(FIELD_NAMES + ["x", ""]): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return rng.choice([None, True, False, 0, 1, -1, 63, 64, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 1.5,
                       float("nan"), float("inf"), "", "x" * rng.randint(1, 3000), "a b", "\x00", "all",
                       "cuda:0", "<i4", "<f4", b"", b"\x00\x01", rng.randbytes(rng.randint(0, 40))])


def _mutate(rng: random.Random, body: dict) -> dict:
    body = msgpack.unpackb(msgpack.packb(body, use_bin_type=True), raw=False)  # deep copy
    containers = [body]
    stack = [body]
    while stack:
        c = stack.pop()
        for v in (c.values() if isinstance(c, dict) else c):
            if isinstance(v, (dict, list)):
                containers.append(v)
                stack.append(v)
    target = rng.choice(containers)
    if isinstance(target, dict) and target and rng.random() < 0.3:
        del target[rng.choice(list(target))]
    elif isinstance(target, dict) and target:
        target[rng.choice(list(target))] = _random_value(rng)
    elif isinstance(target, list) and target:
        target[rng.randrange(len(target))] = _random_value(rng)
    else:
        body[rng.choice(FIELD_NAMES)] = _random_value(rng)
    return body


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


_HEADERS = [b"\xdc", b"\xdd", b"\xde", b"\xdf", b"\xda", b"\xdb", b"\xc5", b"\xc6", b"\xc8", b"\xc9"]


def _candidate(rng: random.Random, family: int) -> list[bytes]:
    name, body, bufs = rng.choice(VALID)
    accepted = sorted(c.TYPE.encode() for c in WORKER_ACCEPTS)  # a frozenset: sort for a fixed sequence
    if family == 0:  # random frame lists
        head = rng.choice([rng.randbytes(rng.randint(0, 40)), b"", b"generate", b"X" * 33, b"GENERATE\x00",
                           b"\xff" * 8, rng.choice(accepted)])
        return [head] + [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(0, 20))]
    if family == 1:  # random bodies under real type names (and near misses)
        head = rng.choice(accepted + [b"HELLO2", b"NOPE"])
        obj = {rng.choice(FIELD_NAMES): _random_value(rng) for _ in range(rng.randint(0, 8))} \
            if rng.random() < 0.8 else _random_value(rng)
        return [head, _pack(obj)] + [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(0, 2))]
    if family == 2:  # one field of a valid message changed or removed
        return [name, _pack(_mutate(rng, body)), *bufs]
    if family == 3:  # msgpack headers claiming huge lengths
        claim = rng.choice([2**32 - 1, 2**31, 65535, 1025, 4097, rng.randint(0, 2**32 - 1)])
        hdr = rng.choice(_HEADERS)
        width = {b"\xdc": 2, b"\xde": 2, b"\xda": 2, b"\xc5": 2, b"\xc8": 2}.get(hdr, 4)
        prefix = rng.choice([b"", b"\x81\xaarequest_id", b"\x82\xaarequest_id\xa1r\xaaprompt_ids"])
        return [name, prefix + (hdr + (claim % (1 << (8 * width))).to_bytes(width, "big")) * rng.randint(1, 50)
                + rng.randbytes(rng.randint(0, 16))]
    if family == 4:  # corrupted valid bodies: flips, truncation, trailing bytes, ext types
        raw = bytearray(_pack(body))
        op = rng.randrange(4)
        if op == 0 and raw:
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        elif op == 1:
            raw = raw[: rng.randrange(len(raw))]
        elif op == 2:
            raw += rng.randbytes(rng.randint(1, 8))
        else:
            raw = bytearray(b"\x81\xaarequest_id\xd4\x01\x00")  # fixext: never accepted
        return [name, bytes(raw), *bufs]
    if family == 5:  # known types the worker does not accept, and unknown types
        head = rng.choice([b"TOKENS", b"DONE", b"HELLO", b"SLOTS", b"PARKED", b"STATS_REPLY", b"WORKER_DEAD",
                           b"FOO_BAR", b"PICKLE", b"GENERATE_V2"])
        return [head, _pack(body)]
    if family == 6:  # array-ref attacks on prompt_ids
        ref = {"__nd__": rng.choice([0, 1, 5, -1, "x", b"\x00" * rng.choice([3, 4, 7])]),
               "dtype": rng.choice(["<i4", "<f4", ">i4", "<i8", "O", "<U4", 7]),
               "shape": rng.choice([[4], [-1], [2**40], [2, 2], [1] * 9, "4", [1.5], [3]])}
        buffers = [rng.randbytes(rng.choice([0, 3, 12, 16, 17]))] if rng.random() < 0.8 else []
        return [b"GENERATE", _pack({"request_id": f"arr-{rng.randrange(10**6)}", "max_tokens": 4,
                                    "prompt_ids": ref}), *buffers]
    if family == 7:  # too many frames
        return [name, _pack(body)] + [b"x"] * rng.randint(17, 40)
    if family == 8:  # undecodable frames typed ERROR: dropped with a log line, never answered
        return [b"ERROR", rng.choice([rng.randbytes(rng.randint(0, 30)), _pack({"code": "nope"}),
                                      _pack({"code": 5, "request_id": "r"}), b"\xc1", _pack([1, 2])])]
    raise AssertionError(family)


def fuzz_cases(n: int, seed: int = 0) -> list[tuple[list[bytes], ErrorCode, str | None]]:
    """``n`` frame lists the worker must refuse, each with the (code, request_id) its ERROR carries.

    Candidates that happen to form a valid message are skipped (a random valid GENERATE would start
    work); the expectation comes from ``framing.decode``, the same function the worker runs."""
    rng = random.Random(seed)
    cases = [([b"GENERATE", b"\x80" + b"\x00" * (framing.MAX_BODY_BYTES + 1)], ErrorCode.TOO_LARGE, None)] * 3
    family = 0
    while len(cases) < n:
        frames = _candidate(rng, family % 9)
        family += 1
        try:
            framing.decode(frames, accept=WORKER_ACCEPTS)
        except ProtocolError as e:
            assert e.code != ErrorCode.INTERNAL, f"validation bug on {frames!r:.200}: {e}"
            cases.append((frames, e.code, e.request_id))
    return cases


def _rss_settled(proc: WorkerProcess) -> int:
    time.sleep(0.2)
    return proc.rss()


def test_hello_after_load(worker, model):
    # Guards: a HELLO that lies about what the worker serves, or comes before the model is usable.
    router, proc = worker
    h = router.hello
    assert isinstance(h, Hello) and h.protocol_version == PROTOCOL_VERSION
    assert h.worker_id == "zmq-tiny" and router.identity == b"zmq-tiny"
    assert h.architecture == "qwen35" and h.model_id == model.stem and h.model_hash.startswith("sha256:")
    assert h.backend == "cpu" and h.device == "cpu" and h.pid == proc.pid
    assert (h.capacity.n_ctx, h.capacity.n_slots, h.capacity.snapshot_bytes) == (512, 8, 8 << 20)
    assert h.capacity.memory_bytes >= weight_bytes(model)


def test_fuzzed_frames_get_errors_and_worker_keeps_serving(worker, ref):
    # Guards: a hostile frame killing the I/O thread, an unanswered frame (the router would wait
    # forever on a request id), an ERROR answered with an ERROR, memory growing with garbage input.
    router, proc = worker
    prompt = np.arange(3, 30, dtype=np.int32)
    want, _ = ref.run(prompt, 16)
    ids, done = router.generate(Generate(request_id="warm", prompt_ids=prompt, max_tokens=16))
    assert ids == want
    rss_before = _rss_settled(proc)

    cases = fuzz_cases(N_FUZZ)
    n_error_typed = sum(1 for f, _, _ in cases if f[0] == b"ERROR")
    assert len(cases) >= 2000 and n_error_typed >= 50
    codes = {}
    t0 = time.monotonic()
    batch = 50
    for start in range(0, len(cases), batch):
        chunk = cases[start:start + batch]
        for frames, _, _ in chunk:
            router.send_raw(frames)
        ping = Stats(request_id=f"ping-{start}")
        router.send(ping)
        replies = []
        while True:
            msg = router.recv(30)
            assert msg is not None, f"worker stopped answering after frame {start}; log:\n{proc.log_text()[-3000:]}"
            if isinstance(msg, StatsReply) and msg.request_id == ping.request_id:
                break
            replies.append(msg)
        expected = [(code, rid) for frames, code, rid in chunk if frames[0] != b"ERROR"]
        got = [(m.code, m.request_id) for m in replies if isinstance(m, ErrorMessage)]
        assert got == expected, f"frames {start}..{start + len(chunk)}: replies differ"
        assert len(replies) == len(got), f"unexpected non-ERROR replies: {replies[:3]}"
        for code, _ in got:
            codes[code.value] = codes.get(code.value, 0) + 1
    fuzz_s = time.monotonic() - t0
    assert proc.proc.poll() is None, "the worker died"

    ids, done = router.generate(Generate(request_id="after-fuzz", prompt_ids=prompt, max_tokens=16))
    assert isinstance(done, Done) and ids == want
    rss_after = _rss_settled(proc)
    log = proc.log_text()
    assert log.count("rejected frame") == len(cases) - n_error_typed
    assert log.count("dropped an undecodable ERROR frame") == n_error_typed
    assert "Traceback" not in log
    print(f"\nfuzz: {len(cases)} frames in {fuzz_s:.1f} s; ERROR replies by code {dict(sorted(codes.items()))}; "
          f"{n_error_typed} ERROR-typed frames dropped; worker RSS {rss_before / 2**20:.1f} -> "
          f"{rss_after / 2**20:.1f} MiB")
    assert rss_after - rss_before < MAX_FUZZ_RSS_GROWTH


def test_snapshot_restore_over_zmq(worker, ref):
    # Guards: snapshot instructions lost in framing, or a restore that does not continue exactly.
    router, _ = worker
    prompt = ref.long_prompt(50, 30)
    want, _ = ref.run(prompt, 30)
    ids, done = router.generate(Generate(request_id="z-save", prompt_ids=prompt, max_tokens=30,
                                         snapshot=SnapshotInstructions(save_slot=4, save_at=37)))
    assert ids == want and done.saved.slot == 4 and done.saved.n_tokens == 37
    router.generate(Generate(request_id="z-other", prompt_ids=prompt[:7].copy(), max_tokens=3))
    ids, done = router.generate(Generate(request_id="z-restore", prompt_ids=prompt, max_tokens=30,
                                         snapshot=SnapshotInstructions(restore_slot=4)))
    assert isinstance(done, Done) and done.usage.cached_tokens == 37
    assert ids == want


def test_errors_carry_request_ids(worker):
    # Guards: an ERROR the router cannot attribute to its request.
    router, _ = worker
    r = router.call(Generate(request_id="too-long", prompt_ids=np.arange(10, dtype=np.int32), max_tokens=600))
    assert isinstance(r, ErrorMessage) and r.code == ErrorCode.CONTEXT_OVERFLOW
    router.send_raw([b"GENERATE", _pack({"request_id": "half", "max_tokens": "many", "prompt_ids": [1]})])
    r = router.recv(10)
    assert isinstance(r, ErrorMessage) and r.code == ErrorCode.BAD_MESSAGE and r.request_id == "half"


# ---- a heavier model: cancel latency and park -------------------------------------------------------

@pytest.fixture(scope="module")
def big(root):
    path = park_model(root)
    router, proc = start_worker(root, path, "zmq-big")
    yield router, proc, path
    proc.stop()
    router.close()


def test_cancel_over_zmq_within_one_step(big):
    # Guards: CANCEL queued behind the generation it should stop (the I/O thread must act on it at
    # once), a cancelled request without DONE, the worker unusable afterwards.
    router, proc, path = big
    ref = Reference.load(path)
    prompt = np.arange(1, 21, dtype=np.int32)
    router.send(Generate(request_id="c-long", prompt_ids=prompt, max_tokens=450))
    received, at_cancel, stats_mid, done = [], None, None, None
    t_cancel = None
    while done is None:
        msg = router.recv(60)
        assert msg is not None
        if isinstance(msg, Tokens):
            received.extend(msg.ids.tolist())
            if at_cancel is None and len(received) >= 5:
                router.send(Stats(request_id="mid"))
                router.send(Cancel(request_id="c-long"))
                at_cancel, t_cancel = len(received), time.monotonic()
        elif isinstance(msg, StatsReply):
            stats_mid = msg
        elif isinstance(msg, (Done, ErrorMessage)):
            done = msg
    latency_ms = (time.monotonic() - t_cancel) * 1e3
    assert isinstance(done, Done) and done.finish_reason == FinishReason.CANCELLED
    assert done.usage.completion_tokens == len(received)
    after = len(received) - at_cancel
    m = re.search(r"request c-long cancelled: (\d+) tokens at CANCEL, (\d+) at the end, (\d+) model steps", proc.log_text())
    assert m, "the worker did not log its cancel report"
    at_w, end_w, steps_w = map(int, m.groups())
    step_ms = done.timings.predicted_ms / max(1, done.usage.completion_tokens - 1)
    print(f"\ncancel over ZeroMQ: {after} token(s) arrived after CANCEL was sent (DONE {latency_ms:.1f} ms later; "
          f"one decode step ~{step_ms:.1f} ms); worker: {end_w - at_w} token(s) and {steps_w} model steps after it")
    assert steps_w == 0 and end_w - at_w <= 1
    assert after <= 2  # the step running when CANCEL arrived, plus one possibly in flight on the wire
    assert stats_mid is not None and stats_mid.active == 1
    ids, done = router.generate(Generate(request_id="c-next", prompt_ids=prompt, max_tokens=12))
    assert isinstance(done, Done) and ids == ref.run(prompt, 12)[0]


def test_park_releases_the_weights_rss(big):
    # Guards: PARK that only drops a Python name while the map (and its resident pages) stays, a
    # GENERATE served from parked weights, an UNPARK that does not restore service.
    router, proc, path = big
    ref = Reference.load(path)
    w_bytes = weight_bytes(path)
    prompt = np.arange(5, 25, dtype=np.int32)
    want, _ = ref.run(prompt, 8)
    ids, _ = router.generate(Generate(request_id="p-warm", prompt_ids=prompt, max_tokens=8))  # touch every page
    assert ids == want
    rss_loaded = _rss_settled(proc)
    parked = router.call(Park(request_id="p1"))
    rss_parked = _rss_settled(proc)
    assert isinstance(parked, Parked)
    drop = rss_loaded - rss_parked
    print(f"\npark: weights {w_bytes / 2**20:.1f} MiB; RSS {rss_loaded / 2**20:.1f} -> {rss_parked / 2**20:.1f} MiB "
          f"(drop {drop / 2**20:.1f} MiB, worker reports {parked.released_bytes / 2**20:.1f} MiB)")
    assert drop >= w_bytes
    assert parked.released_bytes >= w_bytes
    r = router.call(Generate(request_id="p-gen", prompt_ids=prompt, max_tokens=4))
    assert isinstance(r, ErrorMessage) and r.code == ErrorCode.MODEL_PARKED
    assert router.call(Stats(request_id="p-st")).parked == ("target",)
    un = router.call(Unpark(request_id="u1"))
    assert isinstance(un, Unparked) and un.loaded_bytes == w_bytes
    ids, done = router.generate(Generate(request_id="p-after", prompt_ids=prompt, max_tokens=8))
    assert isinstance(done, Done) and ids == want
    assert proc.rss() > rss_parked + w_bytes // 2  # serving maps the weights in again


# ---- liveness and lifecycle -------------------------------------------------------------------------

def test_sigkilled_worker_is_detected_by_missing_heartbeats(root, model):
    # Guards: heartbeats sent from the compute loop (they would stop during long steps) or not at the
    # configured rate; a peer that never notices a worker that died without WORKER_DEAD.
    interval, liveness = 0.2, 3
    router, proc = start_worker(root, model, "zmq-kill", "--heartbeat-interval", str(interval),
                                "--heartbeat-liveness", str(liveness))
    monitor = HeartbeatMonitor(interval_s=interval, liveness=liveness)
    try:
        monitor.seen(router.identity)
        # A generation runs meanwhile: beats come from the I/O thread and must not pause for it.
        router.send(Generate(request_id="k-gen", prompt_ids=np.arange(1, 40, dtype=np.int32), max_tokens=400))
        beats, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 1.0:
            if router.sock.poll(50):
                identity, msg = framing.recv(router.sock)
                monitor.seen(identity)
                beats += isinstance(msg, Heartbeat)
        assert 3 <= beats <= 7, f"{beats} heartbeats in 1 s at a {interval} s interval"
        os.kill(proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        dead = []
        while not dead:
            assert time.monotonic() - t_kill < 5, "the killed worker was never declared dead"
            wait = monitor.next_deadline()
            if router.sock.poll(max(1, int((wait or 0.05) * 1000))):
                identity, _ = framing.recv(router.sock)
                monitor.seen(identity)
            dead = monitor.expired()
        detect = time.monotonic() - t_kill
        print(f"\nSIGKILL detected after {detect * 1e3:.0f} ms (interval {interval} s x liveness {liveness} "
              f"= timeout {monitor.timeout_s:.1f} s)")
        assert dead == [b"zmq-kill"]
        # The last beat left at most one interval before the kill; expiry is timeout after it.
        assert monitor.timeout_s - interval - 0.05 <= detect <= monitor.timeout_s + 0.25
    finally:
        proc.stop()
        router.close()


def test_silent_router_cancels_work_and_worker_rehellos_then_sigterm(root, model, ref):
    # Guards: a worker generating forever for a router that died (PROTOCOL.md §3: it cancels and
    # re-sends HELLO until the router speaks), and SIGTERM exiting without WORKER_DEAD(shutdown).
    interval = 0.2
    # 1000 tokens: twice the 0.6 s of silence the worker waits for even on an idle machine (the
    # tiny model decodes ~800 tok/s there: 450 tokens once finished before the cancel); the tiny
    # model has no prompt that runs much longer without an end-of-generation token
    n_gen = 1000
    router, proc = start_worker(root, model, "zmq-lost", "--heartbeat-interval", str(interval), "--ctx-size", "2048")
    try:
        router.send(Heartbeat(worker_id="zmq-lost", seq=1, time=time.time()))  # this router heartbeats...
        prompt = ref.long_prompt(20, n_gen)
        router.send(Generate(request_id="l-gen", prompt_ids=prompt, max_tokens=n_gen))
        t_silent = time.monotonic()  # ...and from here on says nothing
        hellos, done = 0, None
        while hellos < 2 or done is None:  # the DONE may follow the first HELLO by one (cold) step
            msg = router.recv(10)
            assert msg is not None, f"silent router: {hellos} HELLO(s), DONE {done}"
            if isinstance(msg, Done):
                done = msg
            hellos += isinstance(msg, Hello)
        assert done is not None and done.finish_reason == FinishReason.CANCELLED and done.usage.completion_tokens < n_gen
        assert time.monotonic() - t_silent >= 3 * interval
        # The router is back and heartbeats again: the HELLOs stop (after any already on the wire).
        t_back, late_hellos = time.monotonic(), 0
        for seq in range(2, 10):
            router.send(Heartbeat(worker_id="zmq-lost", seq=seq, time=time.time()))
            t_next = time.monotonic() + interval
            while (left := t_next - time.monotonic()) > 0:
                msg = router.recv(left)
                if isinstance(msg, Hello) and time.monotonic() - t_back > interval:
                    late_hellos += 1
        assert late_hellos == 0, "the worker kept re-sending HELLO after the router spoke"
        proc.proc.send_signal(signal.SIGTERM)
        msg = router.recv(10)
        while not isinstance(msg, WorkerDead):
            assert msg is not None
            msg = router.recv(10)
        assert msg.code == ErrorCode.SHUTDOWN
        assert proc.proc.wait(30) == 0
    finally:
        proc.stop()
        router.close()


def test_stalled_compute_loop_is_reported_and_exits(root):
    # Guards: a hung compute step hidden behind heartbeats from the I/O thread (the router would keep
    # routing to a worker that never answers).  A 50 ms stall timeout against one 480-token prefill
    # step of the 40 MB model (hundreds of ms).
    router, proc = start_worker(root, park_model(root), "zmq-stall", "--stall-timeout", "0.05", "--batch-size", "512")
    try:
        router.send(Generate(request_id="st", prompt_ids=np.arange(1, 481, dtype=np.int32) % 256, max_tokens=4))
        msg = router.recv(30)
        while msg is not None and not isinstance(msg, WorkerDead):
            msg = router.recv(30)
        assert isinstance(msg, WorkerDead) and msg.code == ErrorCode.INTERNAL and "stalled" in msg.reason
        assert proc.proc.wait(30) == 1
    finally:
        proc.stop()
        router.close()


def test_startup_failure_sends_worker_dead(root):
    # Guards: a worker that cannot load its model exiting silently (the router would wait for HELLO).
    bad = root / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 40)
    router = RouterPeer()
    proc = WorkerProcess(bad, ["--connect", router.endpoint, "--worker-id", "zmq-broken"], root / "broken.log")
    try:
        msg = router.recv(60)
        assert isinstance(msg, WorkerDead) and msg.code == ErrorCode.ADAPTER_UNAVAILABLE
        assert msg.worker_id == "zmq-broken" and "broken.gguf" in msg.reason
        assert proc.proc.wait(30) == 2
    finally:
        proc.stop()
        router.close()


def test_shutdown_sends_worker_dead_and_exits_zero(worker):
    # Guards: SHUTDOWN ignored, or a worker leaving without its final WORKER_DEAD frame.  (Runs last
    # in this module: it ends the shared worker.)
    router, proc = worker
    router.send(Generate(request_id="s-1", prompt_ids=np.arange(1, 10, dtype=np.int32), max_tokens=5))
    router.send(Shutdown(drain=True, request_id="bye"))
    seen_done = False
    while True:
        msg = router.recv(30)
        assert msg is not None
        if isinstance(msg, Done) and msg.request_id == "s-1":
            seen_done = True  # drained: the queued request finished first
        if isinstance(msg, WorkerDead):
            break
    assert seen_done and msg.code == ErrorCode.SHUTDOWN
    assert proc.proc.wait(30) == 0
