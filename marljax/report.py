"""`python -m marljax.report RUN_DIR [RUN_DIR ...] [--out DIR]`: report.md + PNG plots of runs
(what they hold: `marljax.analysis.report`)."""
from __future__ import annotations

import argparse

from marljax.analysis.report import write_report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m marljax.report", description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--out", help="output dir (default: the first run dir)")
    args = ap.parse_args(argv)
    print(f"report: {write_report(args.run_dirs, args.out)}")


if __name__ == "__main__":
    main()
