"""Peak resident memory of a command: runs it and prints the largest resident set size any of its
processes reached (the kernel's `ru_maxrss` of waited-for children, as `/usr/bin/time -v` reports it).

    python bench/peak_rss.py -- python -m marljax.train --config configs/default.yaml steps=2 run_dir=/tmp/rss
"""
from __future__ import annotations

import resource
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python bench/peak_rss.py -- COMMAND [ARGS...]")
    t = time.perf_counter()
    rc = subprocess.call(argv)
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    print(f"peak resident memory {peak_kib / 2**20:.2f} GiB ({peak_kib * 1024 / 1e9:.2f} GB), "
          f"{time.perf_counter() - t:.0f} s, exit {rc}: {' '.join(argv)}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
