"""``dflashd worker``: serve one model on one device, over ZeroMQ (``--connect``) or stdio (``--stdio``).

Flags follow llama-server's spellings where one exists (``--model/-m``, ``--ctx-size/-c``,
``--batch-size/-b``, ``--alias/-a``).  Snapshot slots are not llama-server's ``--parallel`` slots
(concurrent sequences): they are saved states in host memory, hence ``--snapshot-slots`` (alias
``--slots``) and ``--snapshot-budget``.  No setting is read from the environment.

Speculative decoding: ``--draft`` (llama-server's ``--model-draft/-md``) names a DFlash draft (a
``dflash`` or ``qwen35-dflash-draft`` GGUF, or a z-lab directory); ``--draft-max`` / ``--draft-min``
(llama-server's spellings) and ``--draft-margin`` set the defaults each GENERATE's ``speculative``
options override; ``--ctx-size-draft`` (llama-server's ``-cd``) the draft's context window.  A draft
that does not fit the target stops the worker before it serves: exit status 2, one line on stderr.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from protocol.messages import HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS, MAX_SLOTS

EXIT_USER_ERROR = 2


def _fail(message: str) -> None:
    click.echo(f"dflashd: error: {message}", err=True)
    sys.exit(EXIT_USER_ERROR)


def _byte_size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    from daemons.memory import parse_byte_size
    try:
        return parse_byte_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command("worker", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "-m", "model_path", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Target model (GGUF).")
@click.option("--draft", "--model-draft", "-md", "draft_path", default=None, type=click.Path(path_type=Path),
              help="DFlash draft for speculative decoding: a dflash / qwen35-dflash-draft GGUF or a z-lab "
                   "directory (config.json + safetensors).")
@click.option("--draft-max", "--draft-n", "draft_max", default=None, type=click.IntRange(0, 256),
              help="Most draft tokens per step [draft block size - 1]; 0 = no speculation.  Requests may override.")
@click.option("--draft-min", "--draft-n-min", "draft_min", default=0, show_default=True, type=click.IntRange(0, 256),
              help="Do not verify drafts shorter than this (after the margin cut).")
@click.option("--draft-margin", default=0.0, show_default=True, type=click.FloatRange(0.0, 1.0),
              help="Cut the draft before the first token whose top-1 - top-2 draft probability is below this "
                   "(dynamic draft length; 0 = off).")
@click.option("--ctx-size-draft", "-cd", "draft_ctx", default=4096, show_default=True,
              type=click.IntRange(1, 1 << 24),
              help="Positions of target features the draft attends over (capped at --ctx-size).")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda:N or hip:N")
@click.option("--connect", "endpoint", default=None, metavar="tcp://HOST:PORT",
              help="Router to join (ZeroMQ DEALER -> ROUTER).")
@click.option("--stdio", is_flag=True, help="Serve the reference daemon's stdin/stdout protocol instead.")
@click.option("--stream-fd", type=click.IntRange(min=0), default=None,
              help="With --stdio: inherited file descriptor that receives token ids (int32 LE, -1 ends a request).")
@click.option("--ctx-size", "-c", "n_ctx", type=click.IntRange(0, 1 << 24), default=4096, show_default=True,
              help="Context length of a sequence (0 = the model's trained context).")
@click.option("--batch-size", "-b", "prefill_chunk", type=click.IntRange(1, 65536), default=512, show_default=True,
              help="Prompt tokens per model call during prefill.")
@click.option("--snapshot-slots", "--slots", "n_slots", type=click.IntRange(0, MAX_SLOTS), default=MAX_SLOTS,
              show_default=True, help="Snapshot slots offered (saved states in host memory, numbered from 0).")
@click.option("--snapshot-budget", "snapshot_budget", default="1G", show_default=True, callback=_byte_size,
              help="Host memory all snapshots may hold (bytes; K/M/G suffixes).")
@click.option("--worker-id", default=None, help="Routing id (default: <arch>-<device>@<host>).")
@click.option("--alias", "-a", "alias", default=None, help="Model name announced to the router (default: file name).")
@click.option("--queue-size", type=click.IntRange(0, 100_000), default=16, show_default=True,
              help="Requests that may wait behind the running one; more get ERROR busy.")
@click.option("--heartbeat-interval", type=click.FloatRange(min=0.001, max=3600), default=HEARTBEAT_INTERVAL_S,
              show_default=True, help="Seconds between heartbeats (the router must use the same value).")
@click.option("--heartbeat-liveness", type=click.IntRange(1, 1000), default=HEARTBEAT_LIVENESS, show_default=True,
              help="Missed heartbeats after which a peer counts as dead.")
@click.option("--stall-timeout", type=click.FloatRange(min=0), default=300.0, show_default=True,
              help="Seconds one compute step may run before the worker declares itself hung and exits (0 = off).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
def worker(model_path: Path, draft_path: Path | None, draft_max: int | None, draft_min: int, draft_margin: float,
           draft_ctx: int, device: str, endpoint: str | None, stdio: bool,
           stream_fd: int | None, n_ctx: int, prefill_chunk: int, n_slots: int, snapshot_budget: int,
           worker_id: str | None, alias: str | None, queue_size: int, heartbeat_interval: float,
           heartbeat_liveness: int, stall_timeout: float, log_level: str) -> None:
    """Serve one model on one device for a router (--connect) or a script (--stdio)."""
    from daemons.worker import WorkerConfig, WorkerConfigError

    if (endpoint is None) == (not stdio):
        raise click.UsageError("give exactly one of --connect tcp://HOST:PORT and --stdio")
    if stream_fd is not None and not stdio:
        raise click.UsageError("--stream-fd belongs to --stdio")
    if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise click.UsageError(f"--connect takes a ZeroMQ endpoint such as tcp://127.0.0.1:5555, got {endpoint!r}")
    if draft_path is None and (draft_max is not None or draft_min or draft_margin):
        _fail("--draft-max, --draft-min and --draft-margin need --draft")
    if draft_path is not None and not draft_path.exists():
        _fail(f"--draft {draft_path}: no such file or directory")
    if draft_max is not None and draft_min > draft_max:
        _fail(f"--draft-min {draft_min} exceeds --draft-max {draft_max}")
    try:
        config = WorkerConfig(model_path=str(model_path), device=device, n_ctx=n_ctx, n_snapshot_slots=n_slots,
                              snapshot_budget_bytes=snapshot_budget, worker_id=worker_id, model_alias=alias,
                              heartbeat_interval_s=heartbeat_interval, heartbeat_liveness=heartbeat_liveness,
                              stall_timeout_s=stall_timeout, max_queued=queue_size, prefill_chunk=prefill_chunk,
                              draft_path=str(draft_path) if draft_path is not None else None, draft_max=draft_max,
                              draft_min=draft_min, draft_margin=draft_margin, draft_ctx=draft_ctx)
    except WorkerConfigError as e:
        _fail(str(e))

    logging.basicConfig(stream=sys.stderr, level=getattr(logging, log_level.upper()),
                        format="%(asctime)s [worker %(process)d] %(levelname)s %(message)s")
    if stdio:
        from daemons.worker_stdio import run_stdio_worker
        status = run_stdio_worker(config, stream_fd)
    else:
        from daemons.worker_zmq import run_zmq_worker
        status = run_zmq_worker(config, endpoint)
    sys.stdout.flush()
    sys.exit(status)
