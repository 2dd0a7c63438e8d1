"""One table from `ab_bench.sh`'s output: per build, the CUDA graphs' device times over the rounds.

    ROUNDS=3 bash tests/bench/ab_bench.sh TREE... | tee /tmp/ab.log; python3 tests/bench/ab_summary.py < /tmp/ab.log

(ab_bench.sh runs it at its end.) A build's figures are its `== TREE` sections' `host` line (the decode
step's graph) and `verify graph` line, in the order the rounds ran them. Each cell is the median over the
rounds, the range beside it, and the first build's median subtracted below (the checkout: every change is
read against it). Compare builds by these device times, not by the host-timed lines: the host's time per
step moves by ~0.3 ms between runs of one build.
"""
from __future__ import annotations

import re
import statistics
import sys
from typing import Iterable

_HOST = re.compile(r"^host\s.*- ([0-9.]+) ms device time of its CUDA graph")
_VERIFY = re.compile(r"^verify graph (.*?)\s+\(")
_WIDTH = re.compile(r"W=(\d+): ([0-9.]+) ms")


def parse(lines: Iterable[str]) -> dict[str, dict[str, list[float]]]:
    """{build: {column: [value per round]}} in the order builds first appear; columns are "decode"
    and "W=<width>" (ms of graph device time)."""
    builds: dict[str, dict[str, list[float]]] = {}
    cur = None
    for line in lines:
        line = line.rstrip("\n")
        if line.startswith("== "):
            cur = builds.setdefault(line[3:].strip(), {})
            continue
        if cur is None:
            continue
        m = _HOST.match(line)
        if m:
            cur.setdefault("decode", []).append(float(m.group(1)))
            continue
        m = _VERIFY.match(line)
        if m:
            for w, ms in _WIDTH.findall(m.group(1)):
                cur.setdefault(f"W={w}", []).append(float(ms))
    return builds


def table(builds: dict[str, dict[str, list[float]]]) -> str:
    if not builds:
        return "no `== TREE` sections with graph times in the input"
    columns: list[str] = []
    for cols in builds.values():
        columns += [c for c in cols if c not in columns]
    columns.sort(key=lambda c: (c != "decode", int(c[2:]) if c.startswith("W=") else 0))
    base = next(iter(builds.values()))
    rows = [["build", "rounds"] + [f"{c} ms" for c in columns]]
    for name, cols in builds.items():
        n = max((len(v) for v in cols.values()), default=0)
        cells = [name, str(n)]
        for c in columns:
            v = cols.get(c)
            if not v:
                cells.append("-")
                continue
            med = statistics.median(v)
            cell = f"{med:.3f} ({min(v):.3f}-{max(v):.3f})"
            if cols is not base and base.get(c):
                cell += f" {med - statistics.median(base[c]):+.3f}"
            cells.append(cell)
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


if __name__ == "__main__":
    print(table(parse(sys.stdin)))
