"""Shape buckets: the few array sizes a run compiles for, shared by the sampler, the trainer and the matrix.

Every jitted program compiles once per input shape, so sizes are rounded up to a small set: the sampler
pads its batch rows with `bucket_rows` and its prompt block with `bucket`, the train step pads its rows
with `bucket_rows` and its sequences with `length_bucket`, the rollout engine its page tables with
`page_bucket`.
"""
from __future__ import annotations


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two ≥ max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def bucket_rows(n: int) -> int:
    """Batch rows for n sequences: a power of two up to 8, then a multiple of max(8, bucket(n) / 16): at most
    8 shapes per doubling, under 8 padding rows up to 128 and under 12.5% above (a power of two would pad
    48 rows to 64, 288 to 512)."""
    p = bucket(n)
    if p <= 8:
        return p
    step = max(8, p // 16)
    return -(-n // step) * step


def page_bucket(n: int) -> int:
    """Page-table width for n pages: ¾·p or p (p = bucket(n)), two shapes per doubling, under 1.5 n where
    a power of two is up to 2 n (decode attention reads every page of the width)."""
    p = bucket(n)
    return 3 * p // 4 if p >= 4 and n <= 3 * p // 4 else p


def length_bucket(n: int) -> int:
    """n rounded up to a multiple of a quarter of its power of two p (at least 16): ¾·p or p above 64, so two
    shapes per doubling, padding under p / 4 (under n / 2)."""
    step = max(16, bucket(n) // 4)
    return -(-n // step) * step
