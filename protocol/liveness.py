"""Heartbeat bookkeeping for the peer that watches workers (PROTOCOL.md §3 "Liveness").

``HeartbeatMonitor`` holds no socket and starts no thread: the owner's event loop calls ``seen``
for every frame that arrives from a peer (any frame proves it alive), asks ``expired`` which peers
have been silent for ``liveness × interval``, ``due`` which peers it should heartbeat now, and
``next_deadline`` how long it may block in ``poll``.  The router and the tests drive it the same way.
"""
from __future__ import annotations

import time
from typing import Callable, Generic, Hashable, Iterator, TypeVar

from protocol.messages import HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS

__all__ = ["HeartbeatMonitor"]

Peer = TypeVar("Peer", bound=Hashable)


class HeartbeatMonitor(Generic[Peer]):
    """Last-heard times of peers (e.g. worker identities) and the Paranoid Pirate rules over them.

    A peer is dead once nothing arrived from it for ``timeout_s = liveness * interval_s`` seconds.
    ``expired`` reports each dead peer once and forgets it; a later ``seen`` registers it afresh
    (a worker re-sends HELLO after a restart).
    """

    def __init__(self, interval_s: float = HEARTBEAT_INTERVAL_S, liveness: int = HEARTBEAT_LIVENESS,
                 clock: Callable[[], float] = time.monotonic):
        if not interval_s > 0:
            raise ValueError(f"heartbeat interval must be positive, got {interval_s!r}")
        if not isinstance(liveness, int) or liveness < 1:
            raise ValueError(f"heartbeat liveness must be a positive integer, got {liveness!r}")
        self.interval_s = float(interval_s)
        self.liveness = liveness
        self.clock = clock
        self._last_rx: dict[Peer, float] = {}
        self._last_tx: dict[Peer, float] = {}

    @property
    def timeout_s(self) -> float:
        return self.interval_s * self.liveness

    def _now(self, now: float | None) -> float:
        return self.clock() if now is None else now

    def seen(self, peer: Peer, now: float | None = None) -> None:
        """A frame (of any type) arrived from ``peer``."""
        t = self._now(now)
        self._last_rx[peer] = t
        self._last_tx.setdefault(peer, t)

    def sent(self, peer: Peer, now: float | None = None) -> None:
        """We sent ``peer`` a heartbeat (or any frame): the next one is due an interval later."""
        if peer in self._last_rx:
            self._last_tx[peer] = self._now(now)

    def forget(self, peer: Peer) -> None:
        self._last_rx.pop(peer, None)
        self._last_tx.pop(peer, None)

    def last_seen(self, peer: Peer) -> float | None:
        return self._last_rx.get(peer)

    def silence(self, peer: Peer, now: float | None = None) -> float | None:
        """Seconds since ``peer`` was last heard (None if unknown)."""
        t = self._last_rx.get(peer)
        return None if t is None else self._now(now) - t

    def expired(self, now: float | None = None) -> list[Peer]:
        """Peers silent for ``timeout_s`` or longer, oldest first; they are forgotten."""
        t = self._now(now)
        dead = sorted((p for p, last in self._last_rx.items() if t - last >= self.timeout_s),
                      key=lambda p: self._last_rx[p])
        for p in dead:
            self.forget(p)
        return dead

    def due(self, now: float | None = None) -> list[Peer]:
        """Peers we have not sent anything to for an interval (heartbeat them, then call ``sent``)."""
        t = self._now(now)
        return [p for p, last in self._last_tx.items() if t - last >= self.interval_s]

    def next_deadline(self, now: float | None = None) -> float | None:
        """Seconds until the next expiry or heartbeat due (0 if overdue); None with no peers."""
        if not self._last_rx:
            return None
        t = self._now(now)
        soonest = min(min(self._last_rx.values()) + self.timeout_s, min(self._last_tx.values()) + self.interval_s)
        return max(0.0, soonest - t)

    def __contains__(self, peer: object) -> bool:
        return peer in self._last_rx

    def __len__(self) -> int:
        return len(self._last_rx)

    def __iter__(self) -> Iterator[Peer]:
        return iter(list(self._last_rx))
