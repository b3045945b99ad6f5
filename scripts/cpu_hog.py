"""A CPU hog for `make test-stress`: one busy process per core, each busy `--load` percent of every 100 ms, until
its parent (the test run) is gone or `--seconds` have passed. Standard library only.

    python scripts/cpu_hog.py --workers 2 --load 60 --parent PID

Why not a steady 100 %: a hog that takes every cycle only makes the suite slower; one that comes and goes moves
the tests' threads and processes between running and waiting at random points, which is what finds the tests
that race the clock (stress-ng --cpu-load works the same way)."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time

PERIOD_S = 0.1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def hog(load: float, parent: int, until: float) -> None:
    busy = PERIOD_S * load
    while time.monotonic() < until and _alive(parent):
        for _ in range(int(1 / PERIOD_S)):  # about a second of periods between checks of the parent
            start = time.monotonic()
            while time.monotonic() - start < busy:
                pass
            time.sleep(max(0.0, PERIOD_S - busy))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--load", type=float, default=60.0, help="percent of each period spent busy (1-100)")
    parser.add_argument("--parent", type=int, default=os.getppid(), help="stop when this process is gone")
    parser.add_argument("--seconds", type=float, default=4 * 3600, help="stop after this long in any case")
    args = parser.parse_args()
    if not 1 <= args.load <= 100:
        parser.error(f"--load {args.load}: give a percentage from 1 to 100")
    until = time.monotonic() + args.seconds
    workers = [multiprocessing.Process(target=hog, args=(args.load / 100, args.parent, until), daemon=True)
               for _ in range(args.workers)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


if __name__ == "__main__":
    main()
