"""The framed protocol: every message type through encode/decode, zero-copy arrays, strict
validation with the documented codes, the spec document agreeing with the code, and a live ZeroMQ
ROUTER/DEALER pair over tcp://127.0.0.1.
"""
from __future__ import annotations

import re
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from protocol import framing
from protocol.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ROUTER_ACCEPTS,
    WORKER_ACCEPTS,
    Cancel,
    Capacity,
    Done,
    DraftInfo,
    ErrorCode,
    ErrorMessage,
    FinishReason,
    FreeSnapshot,
    Generate,
    Heartbeat,
    Hello,
    ListSlots,
    Load,
    Message,
    Park,
    Parked,
    ParkTarget,
    ProtocolError,
    Restore,
    SamplingParams,
    Shutdown,
    SlotInfo,
    Slots,
    Snapshot,
    SnapshotInstructions,
    SpecStats,
    SpeculativeOptions,
    Stats,
    StatsReply,
    Timings,
    Tokens,
    Unpark,
    Unparked,
    Usage,
    WorkerDead,
)

PROTOCOL_MD = Path(__file__).resolve().parent.parent / "protocol" / "PROTOCOL.md"


def _hello(**over):
    kw = dict(worker_id="qwen35-cpu0", protocol_version=PROTOCOL_VERSION, architecture="qwen35",
              model_id="qwen3.5-0.8b", model_hash="ab" * 32, backend="cuda", device="cuda:1",
              capacity=Capacity(n_ctx=32768, n_slots=64, snapshot_bytes=8 << 30, memory_bytes=20 << 30),
              draft=DraftInfo(model_id="dflash-0.8b", model_hash="cd" * 32, architecture="dflash-draft",
                              block_size=16),
              pid=4242, hostname="boxA")
    kw.update(over)
    return Hello(**kw)


def _spec():
    return SpecStats(drafted=60, accepted=25, accepted_per_position=(10, 8, 5, 2), steps=12,
                     acceptance_length=3.08)


def sample_messages() -> list[Message]:
    """At least one instance of every message type, optional fields filled, plus minimal forms."""
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(0, 250_000, size=5000, dtype=np.int32)
    return [
        _hello(),
        Hello(worker_id="w", protocol_version=PROTOCOL_VERSION, architecture="qwen35", model_id="m",
              model_hash="h", backend="cpu", device="cpu",
              capacity=Capacity(n_ctx=1, n_slots=0, snapshot_bytes=0, memory_bytes=0)),
        Heartbeat(worker_id="qwen35-cpu0", seq=17, time=1.7e9, load=Load(active=1, queued=3)),
        Heartbeat(worker_id="qwen35-cpu0", seq=0, time=0.0),
        Generate(request_id="req-1", prompt_ids=long_prompt, max_tokens=128,
                 sampling=SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                                         repeat_penalty=1.1, repeat_last_n=256, frequency_penalty=0.5,
                                         presence_penalty=-0.25, seed=2**64 - 1),
                 stop=("</s>", "\n\nUser:"), stop_ids=(151643, 151645),
                 snapshot=SnapshotInstructions(save_slot=3, save_at=4096, restore_slot=2),
                 speculative=SpeculativeOptions(draft_max=16, draft_min=2, draft_margin=0.35)),
        Generate(request_id="r", prompt_text="Hello, wörld ✓", max_tokens=0),
        Generate(request_id="r2", prompt_ids=np.array([7], dtype=np.int32), max_tokens=1),
        Tokens(request_id="req-1", offset=0, ids=np.array([1, 2, 3], dtype=np.int32), text="abc"),
        Tokens(request_id="req-1", offset=3, ids=np.zeros(0, dtype=np.int32), text="\u00e9"),
        Tokens(request_id="req-1", offset=3, ids=np.arange(100, 400, dtype=np.int32)),
        Done(request_id="req-1", finish_reason=FinishReason.LENGTH,
             usage=Usage(prompt_tokens=5000, completion_tokens=128, cached_tokens=4096),
             timings=Timings(prompt_ms=12.5, prompt_per_second=400000.0, predicted_ms=800.0,
                             predicted_per_second=160.0, ttft_ms=13.0),
             spec=_spec(), saved=SlotInfo(slot=3, n_tokens=4096, bytes=123456)),
        Done(request_id="r", finish_reason="cancelled", usage=Usage(prompt_tokens=0, completion_tokens=0),
             timings=Timings(prompt_ms=0, prompt_per_second=0, predicted_ms=0, predicted_per_second=0, ttft_ms=0)),
        ErrorMessage(code=ErrorCode.MODEL_PARKED, request_id="req-2", message="target is parked"),
        ErrorMessage(code="bad_frame"),
        Cancel(request_id="req-1"),
        Snapshot(slot=63, request_id="c1"),
        Snapshot(slot=0),
        Restore(slot=5, request_id="c2"),
        FreeSnapshot(slot=5),
        ListSlots(request_id="c3"),
        ListSlots(),
        Slots(slots=(SlotInfo(slot=0, n_tokens=10, bytes=100), SlotInfo(slot=3, n_tokens=20, bytes=200)),
              used_bytes=300, budget_bytes=1 << 30, current_tokens=57, request_id="c3"),
        Slots(slots=(), used_bytes=0, budget_bytes=0, current_tokens=0),
        Park(target=ParkTarget.DRAFT, request_id="p1"),
        Park(),
        Parked(target="all", released_bytes=15 << 30, request_id="p1"),
        Unpark(target="target"),
        Unparked(target=ParkTarget.TARGET, loaded_bytes=15 << 30, load_ms=5321.5),
        Stats(request_id="s1"),
        StatsReply(worker_id="qwen35-cpu0", uptime_s=3600.5, requests_completed=10, requests_failed=1,
                   active=1, queued=2, prompt_tokens_total=50000, completion_tokens_total=2000,
                   parked=(ParkTarget.DRAFT,), rss_bytes=3 << 30, device_bytes=20 << 30,
                   snapshot_bytes_used=1 << 20, spec=_spec(), request_id="s1"),
        StatsReply(worker_id="w", uptime_s=0.0, requests_completed=0, requests_failed=0, active=0, queued=0,
                   prompt_tokens_total=0, completion_tokens_total=0, rss_bytes=1),
        Shutdown(drain=False, request_id="x"),
        Shutdown(),
        WorkerDead(worker_id="qwen35-cpu0", code=ErrorCode.OUT_OF_MEMORY, reason="cudaMalloc failed"),
    ]


def _to_bytes(frames) -> list[bytes]:
    """What arrives after a real transfer: independent byte strings."""
    return [bytes(f) for f in frames]


# ---- round trips ---------------------------------------------------------------------------------

def test_samples_cover_every_message_type():
    # Guards against a message type added to the catalogue without a round-trip test.
    assert {type(m) for m in sample_messages()} == set(MESSAGE_TYPES.values())
    assert WORKER_ACCEPTS | ROUTER_ACCEPTS == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("msg", sample_messages(), ids=lambda m: m.TYPE)
def test_round_trip_every_message(msg):
    frames = framing.encode(msg)
    assert frames[0] == msg.TYPE.encode()
    decoded = framing.decode(_to_bytes(frames))
    assert type(decoded) is type(msg)
    assert decoded == msg  # field by field, arrays by value and dtype
    accept = WORKER_ACCEPTS if msg.SENDER in ("router", "both") else ROUTER_ACCEPTS
    assert framing.decode(frames, accept=accept) == msg
    # The body is plain msgpack: a non-Python peer can read it (no ext types, no pickle).
    body = msgpack.unpackb(frames[1], raw=False, strict_map_key=True)
    assert isinstance(body, dict)


def test_equality_detects_differences():
    # Guards the array-aware __eq__ the round-trip test relies on: it must not call everything equal.
    a = Tokens(request_id="r", offset=0, ids=np.array([1, 2], dtype=np.int32))
    assert a != Tokens(request_id="r", offset=0, ids=np.array([1, 3], dtype=np.int32))
    assert a != Tokens(request_id="r", offset=1, ids=np.array([1, 2], dtype=np.int32))
    assert a == Tokens(request_id="r", offset=0, ids=[1, 2])


def test_large_array_is_zero_copy_both_ways():
    ids = np.arange(100_000, dtype=np.int32)
    frames = framing.encode(Generate(request_id="z", prompt_ids=ids, max_tokens=1))
    assert len(frames) == 3
    # Sender side: the buffer frame is the array's own memory, not a tobytes() copy.
    assert np.shares_memory(np.frombuffer(frames[2], dtype=np.uint8), ids)
    # Receiver side: the decoded array views the received frame.
    received = [bytes(frames[0]), bytes(frames[1]), bytearray(frames[2])]
    msg = framing.decode(received)
    assert np.shares_memory(msg.prompt_ids, np.frombuffer(received[2], dtype=np.uint8))
    assert not msg.prompt_ids.flags.writeable
    np.testing.assert_array_equal(msg.prompt_ids, ids)


def test_small_arrays_travel_inline_and_non_contiguous_arrays_are_copied_correctly():
    small = framing.encode(Tokens(request_id="r", offset=0, ids=np.array([5, 6, 7], dtype=np.int32)))
    assert len(small) == 2  # no buffer frame for 12 bytes
    strided = np.arange(20_000, dtype=np.int32)[::2]
    assert not strided.flags.c_contiguous
    out = framing.decode(_to_bytes(framing.encode(Generate(request_id="s", prompt_ids=strided, max_tokens=1))))
    np.testing.assert_array_equal(out.prompt_ids, strided)


def test_ids_are_normalised_to_int32():
    # int64 / big-endian / list input all arrive as native int32 (the one token-id wire dtype).
    for ids in (np.arange(300, dtype=np.int64), np.arange(300, dtype=">i4"), list(range(300))):
        msg = Generate(request_id="n", prompt_ids=ids, max_tokens=1)
        assert msg.prompt_ids.dtype == np.int32
        assert framing.decode(framing.encode(msg)).prompt_ids.dtype == np.int32


def test_plain_msgpack_list_of_ids_is_accepted():
    body = {"request_id": "l", "max_tokens": 4, "prompt_ids": [1, 2, 3]}
    msg = framing.decode([b"GENERATE", msgpack.packb(body)])
    assert msg.prompt_ids.dtype == np.int32 and msg.prompt_ids.tolist() == [1, 2, 3]


def test_unknown_fields_are_ignored():
    # Forward compatibility: a newer peer's extra fields (top-level and nested) do not break decoding.
    msg = sample_messages()[4]
    frames = framing.encode(msg)
    body = msgpack.unpackb(frames[1])
    body["future_field"] = {"x": [1, 2, 3]}
    body["sampling"]["mirostat"] = 2
    body["snapshot"]["evict"] = True
    frames[1] = msgpack.packb(body)
    assert framing.decode(frames) == msg


def test_repr_summarises_arrays():
    text = repr(Generate(request_id="r", prompt_ids=np.arange(100_000), max_tokens=1))
    assert "int32[100000]" in text and len(text) < 600


# ---- validation ----------------------------------------------------------------------------------

def _body(msg: Message) -> tuple[dict, list]:
    frames = framing.encode(msg)
    return msgpack.unpackb(frames[1]), [bytes(f) for f in frames[2:]]


def _decode_body(type_name: str, body: dict, buffers=()) -> Message:
    return framing.decode([type_name.encode(), msgpack.packb(body, use_bin_type=True), *buffers])


def _gen_body(**changes):
    body, bufs = _body(Generate(request_id="g1", prompt_ids=np.arange(1000, dtype=np.int32), max_tokens=8))
    for k, v in changes.items():
        if v is _DROP:
            del body[k]
        else:
            body[k] = v
    return body, bufs


_DROP = object()

BAD_GENERATE_CASES = [
    ("missing request_id", dict(request_id=_DROP), ErrorCode.BAD_MESSAGE),
    ("request_id with a space", dict(request_id="a b"), ErrorCode.BAD_MESSAGE),
    ("missing max_tokens", dict(max_tokens=_DROP), ErrorCode.BAD_MESSAGE),
    ("max_tokens bool", dict(max_tokens=True), ErrorCode.BAD_MESSAGE),
    ("max_tokens negative", dict(max_tokens=-1), ErrorCode.BAD_MESSAGE),
    ("max_tokens float", dict(max_tokens=8.0), ErrorCode.BAD_MESSAGE),
    ("no prompt", dict(prompt_ids=_DROP), ErrorCode.BAD_MESSAGE),
    ("two prompts", dict(prompt_text="hi"), ErrorCode.BAD_MESSAGE),
    ("empty id list", dict(prompt_ids=[]), ErrorCode.EMPTY_PROMPT),
    ("empty text", dict(prompt_ids=_DROP, prompt_text=""), ErrorCode.EMPTY_PROMPT),
    ("negative id", dict(prompt_ids=[1, -2]), ErrorCode.BAD_MESSAGE),
    ("id over int32", dict(prompt_ids=[2**31]), ErrorCode.BAD_MESSAGE),
    ("ids as string", dict(prompt_ids="1 2 3"), ErrorCode.BAD_MESSAGE),
    ("temperature negative", dict(sampling={"temperature": -0.5}), ErrorCode.BAD_MESSAGE),
    ("top_p zero", dict(sampling={"top_p": 0.0}), ErrorCode.BAD_MESSAGE),
    ("top_k string", dict(sampling={"top_k": "40"}), ErrorCode.BAD_MESSAGE),
    ("temperature NaN", dict(sampling={"temperature": float("nan")}), ErrorCode.BAD_MESSAGE),
    ("sampling not a map", dict(sampling=[0.7]), ErrorCode.BAD_MESSAGE),
    ("stop not a list", dict(stop="</s>"), ErrorCode.BAD_MESSAGE),
    ("empty stop string", dict(stop=[""]), ErrorCode.BAD_MESSAGE),
    ("too many stops", dict(stop=["x"] * 65), ErrorCode.TOO_LARGE),
    ("save slot 64", dict(snapshot={"save_slot": 64}), ErrorCode.INVALID_SNAPSHOT_SLOT),
    ("restore slot -1", dict(snapshot={"restore_slot": -1}), ErrorCode.INVALID_SNAPSHOT_SLOT),
    ("save_at without slot", dict(snapshot={"save_at": 5, "restore_slot": 1}), ErrorCode.BAD_MESSAGE),
    ("empty snapshot map", dict(snapshot={}), ErrorCode.BAD_MESSAGE),
    ("save_at zero", dict(snapshot={"save_slot": 1, "save_at": 0}), ErrorCode.BAD_MESSAGE),
    ("draft_min > draft_max", dict(speculative={"draft_max": 2, "draft_min": 5}), ErrorCode.BAD_MESSAGE),
    ("draft_margin inf", dict(speculative={"draft_margin": float("inf")}), ErrorCode.BAD_MESSAGE),
]


@pytest.mark.parametrize("name,changes,code", BAD_GENERATE_CASES, ids=[c[0] for c in BAD_GENERATE_CASES])
def test_bad_generate_fields_get_the_documented_code(name, changes, code):
    body, bufs = _gen_body(**changes)
    with pytest.raises(ProtocolError) as info:
        _decode_body("GENERATE", body, bufs)
    assert info.value.code == code, info.value
    if "request_id" not in changes:  # the error names the request so the ERROR reply can too
        assert info.value.request_id == "g1"


BAD_ARRAY_REFS = [
    ("index out of range", {"__nd__": 1}, ErrorCode.BAD_MESSAGE),
    ("negative index", {"__nd__": -1}, ErrorCode.BAD_MESSAGE),
    ("bool index", {"__nd__": True}, ErrorCode.BAD_MESSAGE),
    ("float dtype for ids", {"dtype": "<f4"}, ErrorCode.BAD_MESSAGE),
    ("big-endian dtype", {"dtype": ">i4"}, ErrorCode.BAD_MESSAGE),
    ("object dtype", {"dtype": "|O"}, ErrorCode.BAD_MESSAGE),
    ("shape/bytes mismatch", {"shape": [999]}, ErrorCode.BAD_MESSAGE),
    ("2-D ids", {"shape": [10, 100]}, ErrorCode.BAD_MESSAGE),
    ("negative dim", {"shape": [-1000]}, ErrorCode.BAD_MESSAGE),
    ("huge shape", {"shape": [2**40]}, ErrorCode.TOO_LARGE),
    ("shape not a list", {"shape": 1000}, ErrorCode.BAD_MESSAGE),
    ("nine dims", {"shape": [1] * 9}, ErrorCode.BAD_MESSAGE),
    ("inline data of the wrong size", {"__nd__": b"\x00" * 12}, ErrorCode.BAD_MESSAGE),
    ("missing __nd__", {"__nd__": _DROP}, ErrorCode.BAD_MESSAGE),
]


@pytest.mark.parametrize("name,changes,code", BAD_ARRAY_REFS, ids=[c[0] for c in BAD_ARRAY_REFS])
def test_bad_array_refs_are_refused(name, changes, code):
    body, bufs = _gen_body()
    ref = body["prompt_ids"]
    assert ref["__nd__"] == 0 and ref["shape"] == [1000]
    for k, v in changes.items():
        if v is _DROP:
            del ref[k]
        else:
            ref[k] = v
    with pytest.raises(ProtocolError) as info:
        _decode_body("GENERATE", body, bufs)
    assert info.value.code == code, info.value


def test_hello_version_is_checked_first():
    # A v2 HELLO may not even have v1's fields: the answer must still be unsupported_version.
    body, _ = _body(_hello())
    assert _decode_body("HELLO", body) == _hello()
    body["protocol_version"] = 2
    body["capacity"] = "a v2 structure"
    with pytest.raises(ProtocolError) as info:
        _decode_body("HELLO", body)
    assert info.value.code == ErrorCode.UNSUPPORTED_VERSION
    with pytest.raises(ProtocolError) as info:
        _hello(protocol_version=2)
    assert info.value.code == ErrorCode.UNSUPPORTED_VERSION


@pytest.mark.parametrize("build", [
    lambda: _hello(device="hip:0"),  # device of another backend
    lambda: _hello(worker_id="bad id"),
    lambda: _hello(backend="metal", device="cpu"),
    lambda: SpecStats(drafted=1, accepted=2, steps=1, acceptance_length=1.0),
    lambda: SpecStats(drafted=9, accepted=3, accepted_per_position=(2, 2), steps=4, acceptance_length=1.0),
    lambda: Usage(prompt_tokens=5, completion_tokens=1, cached_tokens=6),
    lambda: Slots(slots=(SlotInfo(slot=1, n_tokens=1, bytes=1),) * 2, used_bytes=2, budget_bytes=2,
                  current_tokens=0),
    lambda: Slots(slots=(SlotInfo(slot=2, n_tokens=1, bytes=1), SlotInfo(slot=1, n_tokens=1, bytes=1)),
                  used_bytes=2, budget_bytes=2, current_tokens=0),
    lambda: StatsReply(worker_id="w", uptime_s=1, requests_completed=0, requests_failed=0, active=0, queued=0,
                       prompt_tokens_total=0, completion_tokens_total=0, rss_bytes=0, parked=("all",)),
    lambda: Done(request_id="r", finish_reason="error", usage=Usage(prompt_tokens=0, completion_tokens=0),
                 timings=Timings(prompt_ms=0, prompt_per_second=0, predicted_ms=0, predicted_per_second=0,
                                 ttft_ms=0)),
    lambda: Park(target="everything"),
    lambda: ErrorMessage(code="no_such_code"),
    lambda: Heartbeat(worker_id="w", seq=-1, time=0.0),
    lambda: Timings(prompt_ms=-1, prompt_per_second=0, predicted_ms=0, predicted_per_second=0, ttft_ms=0),
    lambda: Generate(request_id="r", max_tokens=1),
    lambda: Tokens(request_id="r", offset=0, ids=np.array([[1, 2]], dtype=np.int32)),
    lambda: Tokens(request_id="r", offset=0, ids=np.array([1.5])),
])
def test_invalid_messages_cannot_be_built(build):
    # The sender validates with the same rules as the receiver, so it cannot emit what peers refuse.
    with pytest.raises(ProtocolError) as info:
        build()
    assert info.value.code in (ErrorCode.BAD_MESSAGE, ErrorCode.UNSUPPORTED_VERSION)


def test_frame_level_errors():
    good = framing.encode(Cancel(request_id="c"))
    cases = [
        ([], ErrorCode.BAD_FRAME),
        ([b"CANCEL"], ErrorCode.BAD_FRAME),
        ([b"CANCEL", good[1]] + [b""] * 17, ErrorCode.TOO_LARGE),
        ([b"", good[1]], ErrorCode.BAD_FRAME),
        ([b"cancel", good[1]], ErrorCode.BAD_FRAME),
        ([b"X" * 33, good[1]], ErrorCode.BAD_FRAME),
        ([b"NOPE", good[1]], ErrorCode.UNKNOWN_MESSAGE_TYPE),
        ([b"CANCEL", b"\xc1"], ErrorCode.BAD_FRAME),  # never-used msgpack byte
        ([b"CANCEL", good[1] + b"\x00"], ErrorCode.BAD_FRAME),  # trailing bytes
        ([b"CANCEL", msgpack.packb([1, 2])], ErrorCode.BAD_MESSAGE),
        ([b"CANCEL", msgpack.packb({1: 2})], ErrorCode.BAD_FRAME),  # non-string key
        ([b"CANCEL", b"\x81\xa1a\xd6\xff\x00\x00\x00\x01"], ErrorCode.BAD_FRAME),  # timestamp ext
        ([b"CANCEL", b"\x81\xa1a\xc7\x03\x01abc"], ErrorCode.BAD_FRAME),  # ext type (e.g. pickle smuggling)
        ([b"CANCEL", b"\x00" * (framing.MAX_BODY_BYTES + 1)], ErrorCode.TOO_LARGE),
        ("CANCEL", ErrorCode.BAD_FRAME),
        ([b"CANCEL", 12345], ErrorCode.BAD_FRAME),
        (None, ErrorCode.BAD_FRAME),
    ]
    for frames, code in cases:
        with pytest.raises(ProtocolError) as info:
            framing.decode(frames)
        assert info.value.code == code, (frames if not isinstance(frames, list) else frames[:1], info.value)


def test_accept_filter_rejects_wrong_direction():
    frames = framing.encode(Tokens(request_id="r", offset=0, ids=[1]))
    with pytest.raises(ProtocolError) as info:
        framing.decode(frames, accept=WORKER_ACCEPTS)
    assert info.value.code == ErrorCode.UNKNOWN_MESSAGE_TYPE
    assert isinstance(framing.decode(frames, accept=ROUTER_ACCEPTS), Tokens)


def test_error_message_make_flattens_and_truncates():
    e = ErrorMessage.make(ErrorCode.INTERNAL, "line1\nline2\r\t" + "x" * 10_000, request_id="r")
    assert "\n" not in e.message and "\r" not in e.message and len(e.message) <= 4096
    exc = ProtocolError(ErrorCode.BAD_ARGS, "a\nb", request_id="q")
    back = ErrorMessage.from_exception(exc)
    assert back.code == ErrorCode.BAD_ARGS and back.request_id == "q" and back.message == "a b"


# ---- the document matches the code ---------------------------------------------------------------

def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    nxt = text.find("\n## ", start + 1)
    return text[start: nxt if nxt != -1 else len(text)]


def test_protocol_md_lists_exactly_the_error_codes():
    # Guards against the enum and the spec drifting apart (a code added in one place only).
    text = PROTOCOL_MD.read_text()
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", _section(text, "## 5. Error codes"), re.M))
    assert documented == {c.value for c in ErrorCode}


def test_protocol_md_describes_every_message_type():
    text = PROTOCOL_MD.read_text()
    section = _section(text, "## 4. Messages")
    for name in MESSAGE_TYPES:
        assert re.search(rf"\b{name}\b", section), f"{name} is not documented in PROTOCOL.md"
    assert f"PROTOCOL_VERSION = {PROTOCOL_VERSION}" in text


# ---- live ZeroMQ ---------------------------------------------------------------------------------

def _recv(sock, timeout_ms=5000, **kw):
    assert sock.poll(timeout_ms), "nothing arrived within the timeout"
    return framing.recv(sock, **kw)


def test_live_router_dealer_exchange():
    ctx = zmq.Context()
    router = framing.router_socket(ctx, "tcp://127.0.0.1:*")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    worker = framing.dealer_socket(ctx, endpoint, "qwen35-cpu0", linger_ms=0)
    try:
        framing.send(worker, _hello(worker_id="qwen35-cpu0"))
        identity, hello = _recv(router, accept=ROUTER_ACCEPTS)
        assert identity == b"qwen35-cpu0" and hello == _hello(worker_id="qwen35-cpu0")

        prompt = np.arange(200_000, dtype=np.int32) % 151_000
        framing.send(router, Generate(request_id="live-1", prompt_ids=prompt, max_tokens=4), identity=identity)
        assert worker.poll(5000)
        frames = worker.recv_multipart(copy=False)
        gen = framing.decode(frames, accept=WORKER_ACCEPTS)
        np.testing.assert_array_equal(gen.prompt_ids, prompt)
        # Zero-copy receive: the prompt views the ZeroMQ frame, no copy was made.
        assert np.shares_memory(gen.prompt_ids, np.frombuffer(frames[2].buffer, dtype=np.uint8))

        for i in range(4):
            framing.send(worker, Tokens(request_id="live-1", offset=i, ids=[100 + i], text=f"t{i}"))
        framing.send(worker, Done(request_id="live-1", finish_reason="length",
                                  usage=Usage(prompt_tokens=200_000, completion_tokens=4),
                                  timings=Timings(prompt_ms=1, prompt_per_second=2, predicted_ms=3,
                                                  predicted_per_second=4, ttft_ms=5)))
        got = [_recv(router, accept=ROUTER_ACCEPTS)[1] for _ in range(5)]
        assert [m.TYPE for m in got] == ["TOKENS"] * 4 + ["DONE"]
        assert [int(m.ids[0]) for m in got[:4]] == [100, 101, 102, 103]

        # Bad frames from a worker raise ProtocolError naming the sender; the link keeps working.
        bad_frames = [[b"GENERATE", b"\xc1"], [b"NOPE", b"\x80"], [b"TOKENS"], [b"X" * 40, b""],
                      [b"TOKENS", msgpack.packb({"request_id": "live-1"})]]
        for frames in bad_frames:
            worker.send_multipart(frames)
            with pytest.raises(ProtocolError) as info:
                _recv(router, accept=ROUTER_ACCEPTS)
            assert info.value.identity == b"qwen35-cpu0"
        assert info.value.request_id == "live-1"
        framing.send(router, ErrorMessage.make(info.value.code, info.value.message, info.value.request_id),
                     identity=identity)
        _, err = _recv(worker, accept=WORKER_ACCEPTS)
        assert err.code == ErrorCode.BAD_MESSAGE and err.request_id == "live-1"
        framing.send(worker, Heartbeat(worker_id="qwen35-cpu0", seq=1, time=1.0, load=Load(active=0, queued=0)))
        assert isinstance(_recv(router)[1], Heartbeat)

        # A ROUTER send without an identity would turn the type frame into an address.
        with pytest.raises(ValueError):
            framing.send(router, Cancel(request_id="x"))
        with pytest.raises(ValueError):
            framing.send(worker, Cancel(request_id="x"), identity=b"qwen35-cpu0")
        # ROUTER_MANDATORY: a message to a worker that is not connected fails loudly.
        with pytest.raises(zmq.ZMQError):
            framing.send(router, Cancel(request_id="x"), identity=b"nobody")
    finally:
        worker.close(0)
        router.close(0)
        ctx.term()


def test_dealer_socket_rejects_bad_worker_id():
    ctx = zmq.Context()
    try:
        with pytest.raises(ProtocolError):
            framing.dealer_socket(ctx, "tcp://127.0.0.1:1", "has space")
    finally:
        ctx.term()
