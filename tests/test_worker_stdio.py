"""``dflashd worker --stdio --stream-fd N`` driven from a subprocess exactly as the reference's
scripts drive its daemon: commands on stdin, one reply line each on stdout, int32 token ids and one
``-1`` per generation / park / unpark / unrecognised line on the stream fd.
"""
from __future__ import annotations

import os
import queue
import subprocess
import threading
import time

import numpy as np
import pytest

from tests.worker_helpers import REPO, Reference, tiny_model, worker_command


class StdioDaemon:
    """A worker subprocess with readers for its stdout lines and its token stream."""

    def __init__(self, model, log_path, *extra: str, stream: bool = True) -> None:
        self.read_fd = write_fd = None
        args = ["--stdio", "--ctx-size", "512", "--batch-size", "16", "--snapshot-slots", "8", *extra]
        if stream:
            self.read_fd, write_fd = os.pipe()
            args += ["--stream-fd", str(write_fd)]
        self._log = open(log_path, "wb")
        self.log_path = log_path
        self.proc = subprocess.Popen(worker_command(model, *args), cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
                                     pass_fds=(write_fd,) if stream else ())
        if write_fd is not None:
            os.close(write_fd)  # the child holds its copy; EOF on read_fd then means the child exited
        self.lines: queue.Queue = queue.Queue()
        self.values: list[int] = []  # every int32 read from the stream, -1 terminators included
        self.cond = threading.Condition()
        self.pos = 0  # values consumed by take_request
        threading.Thread(target=self._read_stdout, daemon=True).start()
        if stream:
            threading.Thread(target=self._read_stream, daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _read_stream(self) -> None:
        buf = b""
        while True:
            data = os.read(self.read_fd, 65536)
            if not data:
                return
            buf += data
            n = len(buf) // 4
            vals = np.frombuffer(buf[:4 * n], dtype="<i4").tolist()
            buf = buf[4 * n:]
            with self.cond:
                self.values.extend(vals)
                self.cond.notify_all()

    def line(self, timeout: float = 60.0) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no stdout line within {timeout} s; log:\n{self.log_path.read_text()[-2000:]}")
        assert line is not None, f"worker exited; log:\n{self.log_path.read_text()[-2000:]}"
        return line

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def cmd(self, command: str, timeout: float = 60.0) -> str:
        self.send(command)
        return self.line(timeout)

    def take_request(self, timeout: float = 30.0) -> list[int]:
        """The ids of the next request on the stream, up to and consuming its -1."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while -1 not in self.values[self.pos:]:
                left = deadline - time.monotonic()
                assert left > 0, "no -1 terminator on the stream"
                self.cond.wait(left)
            end = self.values.index(-1, self.pos)
            ids, self.pos = self.values[self.pos:end], end + 1
            return ids

    def stream_count(self) -> int:
        with self.cond:
            return len(self.values) - self.pos

    def close(self) -> int:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.read_fd is not None:
            os.close(self.read_fd)
            self.read_fd = None
        self._log.close()
        return self.proc.returncode


def fields(line: str) -> dict[str, str]:
    return dict(w.split("=", 1) for w in line.split() if "=" in w)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("worker-stdio")


@pytest.fixture(scope="module")
def model(root):
    return tiny_model(root)


@pytest.fixture(scope="module")
def ref(model):
    return Reference.load(model)


@pytest.fixture(scope="module")
def daemon(root, model):
    d = StdioDaemon(model, root / "stdio.log")
    assert d.line(60) == "[daemon] ready"
    yield d
    d.close()


def prompt_file(root, name: str, ids) -> str:
    path = root / name
    np.asarray(ids, dtype="<i4").tofile(path)
    return str(path)


def test_generation_and_snapshot_restore_through_stdio(daemon, ref, root):
    # Guards: the stdio path diverging from the framed one (one core, two transports), a RESTORE
    # that does not continue exactly, a missing or doubled -1.
    prompt = ref.long_prompt(50, 30)
    want, _ = ref.run(prompt, 30)
    path = prompt_file(root, "p50.bin", prompt)
    reply = daemon.cmd(f"{path} 30 snap=37:2")
    f = fields(reply)
    assert reply.startswith("ok ") and f["N"] == "50" and f["gen"] == "30" and f["finish"] == "length"
    assert f["snap_slot"] == "2" and f["snap_pos"] == "37" and f["stream_fd"] != "-1"
    assert daemon.take_request() == want
    other = prompt_file(root, "p7.bin", prompt[:7])
    assert daemon.cmd(f"{other} 3").startswith("ok ")
    daemon.take_request()
    reply = daemon.cmd(f"RESTORE 2 {path} 30")
    assert "prefix_len=37 (RESTORE slot=2)" in reply and fields(reply)["gen"] == "30"
    assert daemon.take_request() == want
    assert daemon.stream_count() == 0  # nothing beyond one -1 per command


def test_slot_commands_and_terminators(daemon, ref, root):
    # Guards: slot commands writing a -1 (the reference's scripts would read a phantom request), replies
    # out of the reference's format.
    prompt = np.arange(40, 80, dtype=np.int32)
    path = prompt_file(root, "p40.bin", prompt)
    assert daemon.cmd(f"{path} 4").startswith("ok ")
    daemon.take_request()
    assert daemon.cmd("SNAPSHOT 5") == f"[snap] inline slot=5 cur_pos={40 + 3}"
    assert daemon.cmd("LIST_SLOTS").startswith("[snap] slots=") and "5" in daemon.cmd("LIST_SLOTS").split("=")[1].split(",")
    assert daemon.cmd("SNAPSHOT 10") == "[snap] inline slot=10 cur_pos=-1 err=invalid_snapshot_slot"  # 8 offered
    assert daemon.cmd("FREE_SNAPSHOT 5") == "[snap] freed slot=5"
    assert daemon.cmd("FREE_SNAPSHOT 5") == "[snap] freed slot=5"  # freeing an empty slot is fine
    assert daemon.cmd("RESTORE 6 " + path + " 4") == "err empty_slot"
    assert daemon.take_request() == []
    time.sleep(0.1)
    assert daemon.stream_count() == 0


@pytest.mark.parametrize("command, reply, terminator", [
    ("frobnicate", "err unknown_command", True),
    ("generate /x 4 /y", "err unknown_command", True),  # the legacy counted-file form: not implemented
    ("/no/such/file.bin 4", "err bad_args", True),
    ("{empty} 4", "err empty_prompt", True),
    ("{prompt} 0", "err bad_args", True),
    ("{prompt} 4 snap=0:1", "err bad_args", True),
    ("{prompt} 4 samp=0.5", "err bad_args", True),
    ("{prompt} 600", "err context_overflow", True),
    ("SNAPSHOT x", "err bad_args", False),
    ("SNAPSHOT 64", "[snap] inline slot=64 cur_pos=-1 err=invalid_snapshot_slot", False),
    ("SNAPSHOT 1 2", "[snap] inline slot=1 cur_pos=-1 err=bad_args", False),
    ("LIST_SLOTS extra", "err bad_args", False),
    ("park sideways", "err bad_args", True),
])
def test_malformed_commands(daemon, root, command, reply, terminator):
    # Guards: a malformed line killing the daemon, silently ignored, or breaking the one-(-1) rule.
    empty = root / "empty.bin"
    empty.write_bytes(b"")
    line = command.format(empty=empty, prompt=prompt_file(root, "p3.bin", [1, 2, 3]))
    assert daemon.cmd(line) == reply
    if terminator:
        assert daemon.take_request() == []
    assert daemon.cmd("LIST_SLOTS").startswith("[snap] slots=")  # still serving, no stray -1
    assert daemon.stream_count() == 0


def test_park_unpark_through_stdio(daemon, ref, root):
    # Guards: park/unpark not answering in the ok form, a generation served while parked.
    prompt = np.arange(7, 30, dtype=np.int32)
    path = prompt_file(root, "p23.bin", prompt)
    reply = daemon.cmd("park")
    assert reply.startswith("ok park target=all released_bytes=")
    assert daemon.take_request() == []
    assert daemon.cmd(f"{path} 5") == "err model_parked"
    assert daemon.take_request() == []
    assert daemon.cmd("unpark target").startswith("ok unpark target=target loaded_bytes=")
    assert daemon.take_request() == []
    assert daemon.cmd(f"{path} 8").startswith("ok ")
    assert daemon.take_request() == ref.run(prompt, 8)[0]


def test_cancel_through_stdio(daemon, ref, root):
    # Guards: `cancel` waiting behind the generation it should stop.
    prompt = ref.long_prompt(20, 400)
    path = prompt_file(root, "p-long.bin", prompt)
    daemon.send(f"{path} 400")
    deadline = time.monotonic() + 30
    while daemon.stream_count() < 5:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert daemon.cmd("cancel") == "ok cancel active=1"
    reply = daemon.line()
    assert reply.startswith("ok ") and fields(reply)["finish"] == "cancelled"
    ids = daemon.take_request()
    assert 5 <= len(ids) < 400 and int(fields(reply)["gen"]) == len(ids)
    assert ids == ref.run(prompt, len(ids))[0]
    assert daemon.cmd("cancel") == "ok cancel active=0"
    short = prompt_file(root, "p-short.bin", prompt[:10])
    assert daemon.cmd(f"{short} 6").startswith("ok ")
    assert daemon.take_request() == ref.run(prompt[:10], 6)[0]


def test_sampling_tail(daemon, ref, root):
    # Guards: samp= parsed but not applied (or not seeded): two runs with one seed must agree.
    path = prompt_file(root, "p-samp.bin", np.arange(1, 20, dtype=np.int32))
    outs = []
    for _ in range(2):
        assert daemon.cmd(f"{path} 12 samp=0.8,0.95,40,1.0,42").startswith("ok ")
        outs.append(daemon.take_request())
    from daemons.sampling import SamplingParams
    from protocol.stdio import parse_samp
    params: SamplingParams = parse_samp("0.8,0.95,40,1.0,42")
    assert outs[0] == outs[1] == ref.run(np.arange(1, 20), 12, params)[0]


def test_quit_exits_zero(daemon):
    # Guards: a daemon that hangs on quit (the reference's scripts wait for it to exit).  Runs last.
    daemon.send("quit")
    assert daemon.proc.wait(30) == 0


def test_without_stream_fd_and_target_as_draft_refused(root, model):
    # Guards: a generation with nowhere to stream succeeding silently; a target file passed as the
    # draft being loaded (or ignored) instead of refused with one line.
    d = StdioDaemon(model, root / "nofd.log", stream=False)
    try:
        assert d.line(60) == "[daemon] ready"
        path = prompt_file(root, "p-nofd.bin", [1, 2, 3])
        assert d.cmd(f"{path} 3") == "err no_stream_fd"
        assert d.cmd("LIST_SLOTS") == "[snap] slots="
    finally:
        assert d.close() == 0  # EOF on stdin = quit
    r = subprocess.run(worker_command(model, "--draft", str(model), "--stdio"), cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "not supported" in err[0] and "Traceback" not in r.stderr
