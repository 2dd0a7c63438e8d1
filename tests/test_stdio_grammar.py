"""The reference-compatible stdin/stream-fd grammar: every command form, the samp= tail, snap=,
prompt files, reply lines, the single -1 terminator, and bad input -> the documented codes.

Guards against: a script written for the reference daemon being misparsed (or hanging on a missing
or doubled -1), silent acceptance of malformed options, and a user error escaping as a traceback.
"""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from protocol.messages import ErrorCode, FinishReason, Generate, ParkTarget, SamplingParams
from protocol.stdio import (
    MAX_LINE_CHARS,
    REFERENCE_REPEAT_LAST_N,
    CancelCommand,
    CommandError,
    FreeSnapshotCommand,
    GenerateCommand,
    ListSlotsCommand,
    ParkCommand,
    QuitCommand,
    SnapshotCommand,
    TokenStream,
    UnparkCommand,
    format_cancel_ok,
    format_err,
    format_freed,
    format_generate_ok,
    format_ok,
    format_park_ok,
    format_slots,
    format_snapshot,
    format_unpark_ok,
    looks_like_path,
    parse_command,
    parse_samp,
    read_prompt_file,
)

# ---- command forms -------------------------------------------------------------------------------

GOOD = [
    ("/tmp/p.bin 16", GenerateCommand("/tmp/p.bin", 16)),
    ("./p.bin 1", GenerateCommand("./p.bin", 1)),
    ("prompts/p.bin 7", GenerateCommand("prompts/p.bin", 7)),
    (".hidden 3", GenerateCommand(".hidden", 3)),
    ("/tmp/p.bin 16 snap=100:3", GenerateCommand("/tmp/p.bin", 16, snap_at=100, snap_slot=3)),
    ("  /tmp/p.bin\t16  snap=1:0 \r\n", GenerateCommand("/tmp/p.bin", 16, snap_at=1, snap_slot=0)),
    ("RESTORE 5 /tmp/p.bin 32", GenerateCommand("/tmp/p.bin", 32, restore_slot=5)),
    ("RESTORE 0 ./a/b.bin 1 snap=64:63", GenerateCommand("./a/b.bin", 1, restore_slot=0, snap_at=64, snap_slot=63)),
    ("SNAPSHOT 12", SnapshotCommand(12)),
    ("SNAPSHOT 0", SnapshotCommand(0)),
    ("FREE_SNAPSHOT 63", FreeSnapshotCommand(63)),
    ("LIST_SLOTS", ListSlotsCommand()),
    ("LIST_SLOTS\n", ListSlotsCommand()),
    ("park", ParkCommand(ParkTarget.ALL)),
    ("park all", ParkCommand(ParkTarget.ALL)),
    ("park target", ParkCommand(ParkTarget.TARGET)),
    ("park draft", ParkCommand(ParkTarget.DRAFT)),
    ("unpark", UnparkCommand(ParkTarget.ALL)),
    ("unpark draft", UnparkCommand(ParkTarget.DRAFT)),
    ("cancel", CancelCommand()),
    ("quit", QuitCommand()),
    ("exit", QuitCommand()),
]


@pytest.mark.parametrize("line,expected", GOOD, ids=[g[0].strip() for g in GOOD])
def test_every_command_form(line, expected):
    assert parse_command(line) == expected


def test_blank_lines_are_ignored():
    for line in ("", "\n", "   \t \r\n"):
        assert parse_command(line) is None


def test_which_commands_write_the_terminator():
    # The reference's scripts read the stream to -1 after exactly these commands; a wrong flag here
    # hangs such a script (missing -1) or desynchronises it (extra -1).
    emits = {type(c): c.EMITS_TERMINATOR for _, c in GOOD}
    assert emits == {GenerateCommand: True, ParkCommand: True, UnparkCommand: True, SnapshotCommand: False,
                     FreeSnapshotCommand: False, ListSlotsCommand: False, CancelCommand: False,
                     QuitCommand: False}


def test_looks_like_path_matches_the_reference_rule():
    assert looks_like_path("/abs") and looks_like_path("./rel") and looks_like_path("a/b")
    assert looks_like_path(".x")
    assert not looks_like_path("prompt.bin") and not looks_like_path("RESTORE")


# ---- samp= ---------------------------------------------------------------------------------------

def test_samp_tail_five_and_seven_values():
    cmd = parse_command("/tmp/p.bin 64 samp=0.7,0.9,40,1.1,42")
    assert cmd.sampling == SamplingParams(temperature=0.7, top_p=0.9, top_k=40, repeat_penalty=1.1, seed=42,
                                          repeat_last_n=REFERENCE_REPEAT_LAST_N)
    cmd = parse_command("RESTORE 2 /tmp/p.bin 8 snap=5:1 samp=1.0,0.95,0,1.0,7,0.5,-0.25")
    assert cmd.restore_slot == 2 and cmd.snap_at == 5 and cmd.snap_slot == 1
    assert cmd.sampling.frequency_penalty == 0.5 and cmd.sampling.presence_penalty == -0.25
    assert parse_command("/tmp/p.bin 4 samp=0.5,1,0,1,0,0.2").sampling.frequency_penalty == 0.2


def test_samp_is_stripped_wherever_it_stands():
    # The reference removes ` samp=...` from anywhere in the line before parsing the rest.
    a = parse_command("/tmp/p.bin samp=0.7,0.9,40,1.1,42 64 snap=9:2")
    b = parse_command("/tmp/p.bin 64 snap=9:2 samp=0.7,0.9,40,1.1,42")
    assert a == b and a.n_gen == 64 and a.snap_slot == 2


def test_samp_values_are_read_like_the_reference_sampler():
    p = parse_samp("-1,0,-5,0.5,-1")
    assert p.temperature == 0.0 and p.is_greedy  # temp <= 0 -> greedy
    assert p.top_p == 1.0  # top_p outside (0, 1) -> off
    assert p.top_k == 0  # top_k <= 0 -> off
    assert p.repeat_penalty == 1.0  # rep_pen <= 1 -> off (the reference applies it only when > 1)
    assert p.seed == 2**64 - 1  # %llu wraps -1
    assert parse_samp("0.8,1.5,10,1.2,3").top_p == 1.0
    assert parse_command("/tmp/p.bin 4").sampling is None  # no tail: greedy defaults downstream


@pytest.mark.parametrize("tail", [
    "samp=0.7,0.9,40,1.1",  # 4 values
    "samp=0.7,0.9,40,1.1,42,0,0,9",  # 8 values
    "samp=",
    "samp=abc,0.9,40,1.1,42",
    "samp=nan,0.9,40,1.1,42",
    "samp=inf,0.9,40,1.1,42",
    "samp=1e999,0.9,40,1.1,42",  # overflows to inf
    "samp=0.7,0.9,4.5,1.1,42",  # top_k not an integer
    "samp=0.7,0.9,40,1.1,4.2",  # seed not an integer
    "samp=0.7,0.9,40,1.1,99999999999999999999999",  # seed beyond 64 bits
    "samp=0.7,0.9,40,1.1,42 samp=0.7,0.9,40,1.1,42",  # twice
    "samp=0x1,0.9,40,1.1,42",
])
def test_bad_samp_is_bad_args(tail):
    with pytest.raises(CommandError) as info:
        parse_command(f"/tmp/p.bin 16 {tail}")
    assert info.value.code == ErrorCode.BAD_ARGS and info.value.emits_terminator


# ---- bad input -----------------------------------------------------------------------------------

BAD = [
    # line, code, writes -1
    ("hello", ErrorCode.UNKNOWN_COMMAND, True),
    ("prompt.bin 16", ErrorCode.UNKNOWN_COMMAND, True),  # no '/' and no leading '.': not a path
    ("generate /a 1 /b", ErrorCode.UNKNOWN_COMMAND, True),  # legacy form, not implemented
    ("parkx", ErrorCode.UNKNOWN_COMMAND, True),
    ("snapshot 3", ErrorCode.UNKNOWN_COMMAND, True),  # commands are case-sensitive, as in the reference
    ("/tmp/p.bin", ErrorCode.BAD_ARGS, True),
    ("/tmp/p.bin 0", ErrorCode.BAD_ARGS, True),
    ("/tmp/p.bin -3", ErrorCode.BAD_ARGS, True),
    ("/tmp/p.bin +5", ErrorCode.BAD_ARGS, True),
    ("/tmp/p.bin 5.0", ErrorCode.BAD_ARGS, True),
    ("/tmp/p.bin 0x10", ErrorCode.BAD_ARGS, True),
    ("/tmp/p.bin 99999999999999999999999", ErrorCode.BAD_ARGS, True),
    (f"/tmp/p.bin {2**24 + 1}", ErrorCode.BAD_ARGS, True),
    ("/tmp/p.bin 16 extra", ErrorCode.BAD_ARGS, True),
    ("/tmp/p.bin 16 snap=0:3", ErrorCode.BAD_ARGS, True),
    ("/tmp/p.bin 16 snap=10:64", ErrorCode.INVALID_SNAPSHOT_SLOT, True),
    ("/tmp/p.bin 16 snap=10", ErrorCode.BAD_ARGS, True),
    ("/tmp/p.bin 16 snap=a:b", ErrorCode.BAD_ARGS, True),
    ("/tmp/p.bin 16 snap=1:2 snap=3:4", ErrorCode.BAD_ARGS, True),
    ("/tmp/p.bin 16 seed=3", ErrorCode.BAD_ARGS, True),
    ("RESTORE", ErrorCode.BAD_ARGS, True),
    ("RESTORE 3 /tmp/p.bin", ErrorCode.BAD_ARGS, True),
    ("RESTORE x /tmp/p.bin 5", ErrorCode.BAD_ARGS, True),
    ("RESTORE -1 /tmp/p.bin 5", ErrorCode.BAD_ARGS, True),
    ("RESTORE 64 /tmp/p.bin 5", ErrorCode.INVALID_SNAPSHOT_SLOT, True),
    ("RESTORE 3 /tmp/p.bin 0", ErrorCode.BAD_ARGS, True),
    ("RESTORE 3 /tmp/p.bin 5 6", ErrorCode.BAD_ARGS, True),
    ("SNAPSHOT", ErrorCode.BAD_ARGS, False),
    ("SNAPSHOT x", ErrorCode.BAD_ARGS, False),
    ("SNAPSHOT -1", ErrorCode.BAD_ARGS, False),
    ("SNAPSHOT 64", ErrorCode.INVALID_SNAPSHOT_SLOT, False),
    ("SNAPSHOT 1 2", ErrorCode.BAD_ARGS, False),
    ("SNAPSHOT 1 samp=0.7,0.9,40,1.1,42", ErrorCode.BAD_ARGS, False),
    ("FREE_SNAPSHOT", ErrorCode.BAD_ARGS, False),
    ("FREE_SNAPSHOT 100", ErrorCode.INVALID_SNAPSHOT_SLOT, False),
    ("LIST_SLOTS 3", ErrorCode.BAD_ARGS, False),
    ("park everything", ErrorCode.BAD_ARGS, True),
    ("park target draft", ErrorCode.BAD_ARGS, True),
    ("unpark nope", ErrorCode.BAD_ARGS, True),
    ("park samp=0.7,0.9,40,1.1,42", ErrorCode.BAD_ARGS, True),
    ("cancel now", ErrorCode.BAD_ARGS, False),
    ("quit please", ErrorCode.BAD_ARGS, False),
    ("/tmp/p.bin 16 " + "x" * MAX_LINE_CHARS, ErrorCode.TOO_LARGE, True),
]


@pytest.mark.parametrize("line,code,terminator", BAD, ids=[b[0][:40] for b in BAD])
def test_bad_input_gets_the_documented_code(line, code, terminator):
    with pytest.raises(CommandError) as info:
        parse_command(line)
    assert info.value.code == code, info.value
    assert info.value.emits_terminator == terminator
    assert "\n" not in str(info.value)


# ---- GenerateCommand -> GENERATE -----------------------------------------------------------------

def test_generate_command_becomes_a_generate_message():
    ids = np.array([5, 6, 7], dtype=np.int32)
    msg = parse_command("RESTORE 4 /tmp/p.bin 9 snap=2:1 samp=0.5,0.9,0,1.0,11").to_message("stdio-1", ids)
    assert isinstance(msg, Generate)
    assert msg.max_tokens == 9 and msg.prompt_ids.tolist() == [5, 6, 7]
    assert (msg.snapshot.restore_slot, msg.snapshot.save_slot, msg.snapshot.save_at) == (4, 1, 2)
    assert msg.sampling.seed == 11 and msg.sampling.temperature == 0.5
    plain = parse_command("/tmp/p.bin 3").to_message("stdio-2", ids)
    assert plain.snapshot is None and plain.sampling == SamplingParams()


# ---- prompt files --------------------------------------------------------------------------------

def test_read_prompt_file_is_raw_little_endian_int32(tmp_path):
    p = tmp_path / "p.bin"
    p.write_bytes(struct.pack("<4i", 1, 151643, 0, 2**31 - 1))
    ids = read_prompt_file(p)
    assert ids.dtype == np.int32 and ids.tolist() == [1, 151643, 0, 2**31 - 1]


@pytest.mark.parametrize("setup,code", [
    (lambda d: d / "missing.bin", ErrorCode.BAD_ARGS),
    (lambda d: d, ErrorCode.BAD_ARGS),  # a directory
    (lambda d: _write(d / "odd.bin", b"\x01\x00\x00\x00\x02\x00"), ErrorCode.BAD_ARGS),  # 6 bytes
    (lambda d: _write(d / "empty.bin", b""), ErrorCode.EMPTY_PROMPT),
    (lambda d: _write(d / "neg.bin", struct.pack("<2i", 5, -1)), ErrorCode.BAD_ARGS),
])
def test_bad_prompt_files(tmp_path, setup, code):
    with pytest.raises(CommandError) as info:
        read_prompt_file(setup(tmp_path))
    assert info.value.code == code and info.value.emits_terminator


def test_prompt_file_token_limit(tmp_path):
    p = _write(tmp_path / "big.bin", struct.pack("<5i", 1, 2, 3, 4, 5))
    with pytest.raises(CommandError) as info:
        read_prompt_file(p, max_tokens=4)
    assert info.value.code == ErrorCode.TOO_LARGE


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


# ---- reply lines ---------------------------------------------------------------------------------

def test_reply_lines():
    assert format_err(ErrorCode.EMPTY_SLOT) == "err empty_slot"
    assert format_err("model_parked") == "err model_parked"
    with pytest.raises(ValueError):
        format_err("not_a_code")
    assert format_ok("park", target=ParkTarget.DRAFT, released_bytes=5) == "ok park target=draft released_bytes=5"
    assert format_park_ok("all", 123) == "ok park target=all released_bytes=123"
    assert format_unpark_ok(ParkTarget.TARGET, 9) == "ok unpark target=target loaded_bytes=9"
    assert format_cancel_ok(True) == "ok cancel active=1" and format_cancel_ok(False) == "ok cancel active=0"
    assert format_slots([3, 0]) == "[snap] slots=0,3" and format_slots([]) == "[snap] slots="
    assert format_snapshot(4, 120) == "[snap] inline slot=4 cur_pos=120"
    assert format_snapshot(4, 0, ErrorCode.EMPTY_SLOT) == "[snap] inline slot=4 cur_pos=-1 err=empty_slot"
    assert format_freed(7) == "[snap] freed slot=7"


def test_generate_reply_lines_keep_the_reference_fields_first():
    bare = format_generate_ok(n_prompt=100, n_gen=32, prefill_s=0.25, decode_s=2.0,
                              finish_reason=FinishReason.LENGTH, stream_fd=5)
    assert bare == ("ok N=100 gen=32 prefill_s=0.250 decode_s=2.000 decode_tok_s=16.0 stream_fd=5 "
                    "finish=length")
    restored = format_generate_ok(n_prompt=100, n_gen=3, prefill_s=0.01, decode_s=0.1, finish_reason="stop",
                                  stream_fd=5, restore_slot=2, prefix_len=64, snap_slot=1, snap_pos=96)
    assert restored.startswith("ok N=100 gen=3 prefix_len=64 (RESTORE slot=2) stream_fd=5 ")
    assert restored.endswith(" finish=stop snap_slot=1 snap_pos=96")


# ---- token stream --------------------------------------------------------------------------------

def _read_all(fd) -> bytes:
    chunks = []
    while True:
        b = os.read(fd, 65536)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def test_stream_writes_int32_le_and_exactly_one_terminator():
    r, w = os.pipe()
    try:
        stream = TokenStream(w)
        with stream.request() as req:
            req.write([1, 2])
            req.write(np.array([151643], dtype=np.int64))
            req.write([])
            req.close()  # closing twice (explicitly, then by the with block) writes one -1
        with pytest.raises(RuntimeError):
            req.write([3])
        with pytest.raises(ZeroDivisionError):  # a failing command still gets its single -1
            with stream.request() as req2:
                req2.write([9])
                raise ZeroDivisionError
        stream.terminate()  # park/unpark/unknown: a lone -1
        os.close(w)
        w = -1
        data = _read_all(r)
    finally:
        os.close(r)
        if w != -1:
            os.close(w)
    assert data == struct.pack("<7i", 1, 2, 151643, -1, 9, -1, -1)
    assert req.count == 3


def test_stream_refuses_ids_that_could_fake_a_terminator():
    stream = TokenStream(None)  # no --stream-fd: writes go nowhere, the checks still apply
    req = stream.request()
    for bad in ([-1], [2**31], np.array([0.5]), np.array([[1, 2]])):
        with pytest.raises(ValueError):
            req.write(bad)
    req.write([1, 2, 3])
    req.close()
    assert req.count == 3 and req.closed
