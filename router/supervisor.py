"""Local worker processes of `dflashd serve`: start, watch, restart with backoff, take down.

Each configured worker is a `WorkerSlot`: one `dflashd worker` process (started through
`router.child`, which arranges to die with this process) pinned to its device by environment
(`CUDA_VISIBLE_DEVICES` / `HIP_VISIBLE_DEVICES`, see `config.device_isolation`), in its own process
group so that stopping it also stops anything it started.

* A worker that exits is reported to the hub at once (its in-flight requests fail or move now, not
  after the heartbeat timeout) and restarted after a delay that doubles with each crash
  (`restart_backoff_s` .. `restart_backoff_max_s`) and falls back to the first value once a worker
  has served for a while.  `max_start_failures` crashes in a row without ever reaching HELLO mark
  the slot failed (the model shows `failed` in /v1/models with the exit reason) and it stays down.
* A worker whose process lives but which stopped heartbeating for twice the liveness window is
  hung: it is killed and restarted like a crashed one.
* `stop()` sends SIGTERM to each process group (the worker sends WORKER_DEAD and exits), waits a
  few seconds, then SIGKILLs what is left.  If this process is SIGKILLed, the kernel kills the
  workers (PR_SET_PDEATHSIG set in router/child.py).
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from router.config import Config, ModelSpec, WorkerSpec, device_isolation
from router.registry import Registry, WorkerHub

__all__ = ["Supervisor", "WorkerSlot"]

log = logging.getLogger("dflashd.supervisor")
REPO_ROOT = Path(__file__).resolve().parent.parent
BACKOFF_RESET_AFTER_S = 60.0  # a worker that served this long crashed "once", not in a loop
STOP_GRACE_S = 5.0


@dataclass
class WorkerSlot:
    worker_id: str
    model: ModelSpec
    spec: WorkerSpec
    proc: asyncio.subprocess.Process | None = None
    state: str = "starting"  # starting | ready | backoff | failed | stopped
    starts: int = 0
    consecutive_failures: int = 0
    last_exit: str | None = None
    started_at: float = 0.0
    ready_at: float | None = None


def _safe_id(text: str, limit: int) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]", "-", text).strip("-.") or "model"
    return s[:limit]


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"killed by {name}"
    return f"exited with status {rc}"


class Supervisor:
    def __init__(self, config: Config, registry: Registry, hub: WorkerHub,
                 on_state_change: Callable[[], None] | None = None):
        self.config = config
        self.registry = registry
        self.hub = hub
        self.on_state_change = on_state_change
        self.slots: list[WorkerSlot] = []
        n = 0
        for m in config.models:
            for spec in m.workers:
                wid = f"{_safe_id(m.id, 40)}-{spec.device.replace(':', '')}-{n}"
                self.slots.append(WorkerSlot(worker_id=wid, model=m, spec=spec))
                registry.expected[wid] = m.id
                registry.models[m.id].local_workers[wid] = "starting"
                n += 1
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self.endpoint: str | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self, endpoint: str) -> None:
        self.endpoint = endpoint
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(slot), name=f"supervise-{slot.worker_id}") for slot in self.slots]

    async def stop(self) -> None:
        self._stopping = True
        procs = [s.proc for s in self.slots if s.proc is not None and s.proc.returncode is None]
        for p in procs:
            self._signal_group(p, signal.SIGTERM)
        if procs:
            try:
                await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), STOP_GRACE_S)
            except asyncio.TimeoutError:
                for p in procs:
                    if p.returncode is None:
                        log.warning("worker pid %d ignored SIGTERM for %.0f s: SIGKILL", p.pid, STOP_GRACE_S)
                        self._signal_group(p, signal.SIGKILL)
                await asyncio.gather(*(p.wait() for p in procs), return_exceptions=True)
        for p in procs:  # anything the workers started, even if the worker itself already exited
            self._signal_group(p, signal.SIGKILL)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self.slots:
            s.state = "stopped"

    @staticmethod
    def _signal_group(proc: asyncio.subprocess.Process, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # the worker leads its own process group (process_group=0)
        except (ProcessLookupError, PermissionError):
            pass

    def _set_state(self, slot: WorkerSlot, state: str) -> None:
        slot.state = state
        self.registry.models[slot.model.id].local_workers[slot.worker_id] = state
        if self.on_state_change is not None:
            self.on_state_change()

    def model_states(self) -> dict[str, str]:
        """Per configured model with local workers: ready (one is), failed (all were given up), or
        pending."""
        out = {}
        for m in self.config.models:
            states = [s.state for s in self.slots if s.model.id == m.id]
            if not states:
                continue
            out[m.id] = "ready" if "ready" in states else "failed" if all(x == "failed" for x in states) else "pending"
        return out

    @property
    def settled(self) -> bool:
        """Every model is ready or failed: nothing is still loading for the first time."""
        return all(v != "pending" for v in self.model_states().values())

    # ---- one slot ------------------------------------------------------------------------------------
    def command(self, slot: WorkerSlot) -> tuple[list[str], dict[str, str]]:
        s = self.config.server
        isolation, told_device = device_isolation(slot.spec.device)
        m = slot.model
        args = [sys.executable, "-m", "router.child", str(os.getpid()), "worker",
                "--model", str(m.path), "--device", told_device, "--connect", str(self.endpoint),
                "--worker-id", slot.worker_id, "--alias", m.id,
                "--heartbeat-interval", repr(s.heartbeat_interval_s),
                "--heartbeat-liveness", str(s.heartbeat_liveness)]
        ctx = slot.spec.ctx_size or m.ctx_size
        if ctx is not None:
            args += ["--ctx-size", str(ctx)]
        if m.draft is not None:
            args += ["--draft", str(m.draft)]
            for flag, value in (("--draft-max", m.draft_max), ("--draft-min", m.draft_min),
                                ("--draft-margin", m.draft_margin)):
                if value is not None:
                    args += [flag, repr(value) if isinstance(value, float) else str(value)]
        args += list(slot.spec.args)
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)  # readiness is the router's to report, not each worker's
        env.update(isolation)
        env.update(slot.spec.env)
        env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return args, env

    async def _run(self, slot: WorkerSlot) -> None:
        s = self.config.server
        backoff = s.restart_backoff_s
        entry = self.registry.models[slot.model.id]
        while not self._stopping:
            args, env = self.command(slot)
            self._set_state(slot, "starting")
            slot.starts += 1
            slot.started_at = time.monotonic()
            slot.ready_at = None
            try:
                slot.proc = await asyncio.create_subprocess_exec(*args, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                                 process_group=0)
            except OSError as e:
                slot.last_exit = f"cannot start: {e}"
                rc = None
            else:
                log.info("started worker %s (pid %d) for %s on %s%s", slot.worker_id, slot.proc.pid, slot.model.id,
                         slot.spec.device, f" (start {slot.starts})" if slot.starts > 1 else "")
                rc = await self._watch(slot)
                slot.last_exit = describe_exit(rc)
            if self._stopping:
                break
            served = slot.ready_at is not None
            reason = f"worker {slot.worker_id} {slot.last_exit}" + ("" if served else " before it was ready")
            entry.failure = reason
            self.hub.worker_process_exited(slot.worker_id, slot.last_exit)
            if served and time.monotonic() - slot.ready_at >= BACKOFF_RESET_AFTER_S:
                backoff = s.restart_backoff_s
            if served:
                slot.consecutive_failures = 0
            else:
                slot.consecutive_failures += 1
                if slot.consecutive_failures >= s.max_start_failures:
                    log.error("%s; %d failed starts in a row: giving up on this worker", reason,
                              slot.consecutive_failures)
                    self._set_state(slot, "failed")
                    return
            log.warning("%s; restarting in %.1f s", reason, backoff)
            self._set_state(slot, "backoff")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, s.restart_backoff_max_s)

    async def _watch(self, slot: WorkerSlot) -> int:
        """Wait for the process to exit, marking the slot ready at its HELLO and killing it when
        it hangs (alive but silent) after having been ready."""
        proc = slot.proc
        assert proc is not None
        s = self.config.server
        hung_after = 2 * s.heartbeat_interval_s * s.heartbeat_liveness
        wait = asyncio.ensure_future(proc.wait())
        try:
            while True:
                done, _ = await asyncio.wait({wait}, timeout=0.1)
                if done:
                    return wait.result()
                rec = self.registry.workers.get(slot.worker_id)
                fresh = rec is not None and rec.hello.pid in (None, proc.pid)
                if slot.ready_at is None and fresh and rec.healthy:
                    slot.ready_at = time.monotonic()
                    slot.consecutive_failures = 0
                    self._set_state(slot, "ready")
                elif slot.ready_at is not None and fresh and not rec.healthy and slot.state == "ready":
                    if time.monotonic() - rec.last_seen > hung_after:
                        log.error("worker %s (pid %d) is alive but silent for %.0f s: killing it", slot.worker_id,
                                  proc.pid, time.monotonic() - rec.last_seen)
                        self._signal_group(proc, signal.SIGKILL)
                    elif rec.unhealthy_reason and rec.unhealthy_reason.startswith("worker exited"):
                        pass  # sent WORKER_DEAD: it is on its way out
                elif slot.ready_at is not None and fresh and rec.healthy and slot.state != "ready":
                    self._set_state(slot, "ready")
        finally:
            if not wait.done():
                wait.cancel()
