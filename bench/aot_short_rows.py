"""A cell's short update micro-batch (the most 256-token answers its token budget admits) compiled for a TPU
topology with the trainer's former log-prob chunks (256 positions of every row at once) and with today's
(at most `LOGPROB_BYTES` of float32 logits per chip), at the planned token budget (one longest row per chip)
and at half of it: XLA's peak per chip.

    PYTHONPATH=. python bench/aot_short_rows.py [--cell eval_opt-math-qwen3-4b-isolated] [--topology v5e-8] [--layers N]
"""
from __future__ import annotations

import argparse
import dataclasses

from marljax import aot, matrix
from marljax.models.presets import PRESETS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cell", default="eval_opt-math-qwen3-4b-isolated")
    ap.add_argument("--topology", default="v5e-8", choices=sorted(aot.TOPOLOGIES))
    ap.add_argument("--layers", type=int, help="compile this many layers of the model (a smoke run: 1)")
    a = ap.parse_args()
    cell = next(c for c in matrix.cells() if c.name == a.cell)
    acc = matrix.ACCELERATORS[a.topology]
    est = matrix.estimate(cell, acc)
    cfg = matrix.cell_config(est, acc)  # at the planned budget (one longest row), whatever aot_fits.yaml records
    cfg = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, micro_batch_tokens=matrix.longest_row(cell)))
    chips = est.mesh[0] * est.mesh[1]
    short = aot.update_shapes(cell, cfg.rl.micro_batch_tokens, chips)["short"]
    per_row = short.rows // chips * 256 * PRESETS[cell.model].vocab_size * 4  # the former chunk, all rows
    half = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, micro_batch_tokens=cfg.rl.micro_batch_tokens // 2))
    print(f"# {a.cell} on {a.topology}: {short}")
    for name, c, budget in (("256 positions per row", cfg, per_row), ("LOGPROB_BYTES", cfg, None),
                            ("LOGPROB_BYTES, half the token budget", half, None)):
        r = aot.compile_cell(cell, c, a.topology, acc, shape="short", logprob_bytes=budget,
                             layers=a.layers)
        print(f"{name:38} rows {r.rows:4d} × {r.length}: peak {r.total_bytes / aot.GiB:.2f} GiB per chip, "
              f"fits {r.fits}" + (f" ({r.program.oom[:80]})" if r.program.oom else ""), flush=True)


if __name__ == "__main__":
    main()
