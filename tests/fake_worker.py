"""A protocol-speaking stand-in for a worker, for router benchmarks and protocol-level tests.

    python -m tests.fake_worker --connect tcp://127.0.0.1:PORT --worker-id fake-0 --model-id tiny \
        [--token-delay 0] [--n-ctx 4096]

It joins with HELLO, heartbeats, and answers each GENERATE with `max_tokens` TOKENS messages (one id
per message, as a real worker streams them) as fast as it can (or `--token-delay` seconds apart),
then DONE.  The ids cycle through the bytes 'a'..'z', whose text is the letter in the synthetic byte
vocabulary.  CANCEL stops the running request with DONE(cancelled).  It is not a model: the real
tests of issue 5 use `dflashd worker` processes; this one measures the router alone.
"""
from __future__ import annotations

import argparse
import collections
import os
import time

import numpy as np
import zmq

from protocol.framing import dealer_socket, recv, send
from protocol.messages import (
    PROTOCOL_VERSION,
    WORKER_ACCEPTS,
    Cancel,
    Capacity,
    Done,
    ErrorCode,
    ErrorMessage,
    FinishReason,
    Generate,
    Heartbeat,
    Hello,
    Load,
    ProtocolError,
    Shutdown,
    Timings,
    Tokens,
    Usage,
    WorkerDead,
)

LETTERS = np.arange(ord("a"), ord("z") + 1, dtype=np.int32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connect", required=True)
    ap.add_argument("--worker-id", required=True)
    ap.add_argument("--model-id", required=True)
    ap.add_argument("--n-ctx", type=int, default=1 << 20)
    ap.add_argument("--token-delay", type=float, default=0.0)
    ap.add_argument("--heartbeat-interval", type=float, default=1.0)
    args = ap.parse_args(argv)

    ctx = zmq.Context()
    sock = dealer_socket(ctx, args.connect, args.worker_id)
    hello = Hello(worker_id=args.worker_id, protocol_version=PROTOCOL_VERSION, architecture="qwen35",
                  model_id=args.model_id, model_hash="fake", backend="cpu", device="cpu",
                  capacity=Capacity(n_ctx=args.n_ctx, n_slots=0, snapshot_bytes=0, memory_bytes=0),
                  pid=os.getpid(), hostname="localhost")
    send(sock, hello)
    queue: collections.deque[Generate] = collections.deque()
    active: Generate | None = None
    produced = 0
    started = 0.0
    first_at = 0.0
    hb_seq = 0
    next_hb = time.monotonic() + args.heartbeat_interval
    next_token = 0.0
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)

    def finish(reason: FinishReason) -> None:
        nonlocal active
        assert active is not None
        now = time.perf_counter()
        dur_ms = (now - started) * 1000
        send(sock, Done(request_id=active.request_id, finish_reason=reason,
                        usage=Usage(prompt_tokens=int(active.prompt_ids.size), completion_tokens=produced),
                        timings=Timings(prompt_ms=0.0, prompt_per_second=0.0, predicted_ms=dur_ms,
                                        predicted_per_second=produced / (dur_ms / 1000) if dur_ms else 0.0,
                                        ttft_ms=(first_at - started) * 1000 if produced else 0.0)))
        active = None

    while True:
        timeout = 0 if (active is not None or queue) else 100
        if active is not None and args.token_delay:
            timeout = max(0, int((next_token - time.monotonic()) * 1000))
        events = dict(poller.poll(timeout))
        while sock in events:
            try:
                _, msg = recv(sock, zmq.NOBLOCK, accept=WORKER_ACCEPTS)
            except zmq.Again:
                break
            except ProtocolError as e:
                send(sock, ErrorMessage.from_exception(e))
                continue
            if isinstance(msg, Generate):
                queue.append(msg)
            elif isinstance(msg, Cancel):
                if active is not None and active.request_id == msg.request_id:
                    finish(FinishReason.CANCELLED)
                else:
                    for g in list(queue):
                        if g.request_id == msg.request_id:
                            queue.remove(g)
            elif isinstance(msg, ErrorMessage) and msg.code == ErrorCode.UNKNOWN_WORKER:
                send(sock, hello)
            elif isinstance(msg, Shutdown):
                send(sock, WorkerDead(worker_id=args.worker_id, code=ErrorCode.SHUTDOWN, reason="shutdown"))
                sock.close(linger=1000)
                ctx.term()
                return 0
        now = time.monotonic()
        if now >= next_hb:
            hb_seq += 1
            send(sock, Heartbeat(worker_id=args.worker_id, seq=hb_seq, time=time.time(),
                                 load=Load(active=int(active is not None), queued=len(queue))))
            next_hb = now + args.heartbeat_interval
        if active is None and queue:
            active = queue.popleft()
            produced = 0
            started = time.perf_counter()
            if active.max_tokens == 0:
                finish(FinishReason.LENGTH)
        if active is not None and (not args.token_delay or now >= next_token):
            tok = LETTERS[produced % len(LETTERS)]
            if produced == 0:
                first_at = time.perf_counter()
            send(sock, Tokens(request_id=active.request_id, offset=produced, ids=np.array([tok], np.int32),
                              text=chr(int(tok))))
            produced += 1
            next_token = now + args.token_delay
            if produced >= active.max_tokens:
                finish(FinishReason.LENGTH)


if __name__ == "__main__":
    raise SystemExit(main())
