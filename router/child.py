"""Entry point of a supervised worker process: `python -m router.child PARENT_PID worker ARGS...`.

Before it becomes a worker, the child asks the kernel to SIGKILL it when its parent dies
(`prctl(PR_SET_PDEATHSIG)`), so a SIGKILLed router leaves no orphan holding a GPU.  Doing this in
the child's own code, rather than in a `preexec_fn` between fork and exec, keeps the parent's
fork path free of Python code (preexec_fn is unsafe once the parent runs threads).  The parent's pid
is checked after the prctl: a parent that died in between would otherwise never trigger it.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            err = ctypes.get_errno()
            print(f"dflashd: warning: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}", file=sys.stderr)
    if os.getppid() != expected_parent:  # the parent is already gone: do not start orphaned
        sys.exit(1)


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m router.child PARENT_PID worker ARGS...", file=sys.stderr)
        sys.exit(2)
    die_with_parent(int(argv[0]))
    from daemons.cli import main as dflashd_main
    dflashd_main(argv[1:], prog_name="dflashd")


if __name__ == "__main__":
    main(sys.argv[1:])
