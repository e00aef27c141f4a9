"""Shape buckets: powers of two, batch rows in eighths of a doubling, sequence lengths in quarters."""
from marljax.core.shapes import bucket, bucket_rows, length_bucket


def test_bucket_is_the_next_power_of_two_above_a_minimum():
    assert bucket(1) == 1 and bucket(5) == 8 and bucket(3, 16) == 16


def test_batch_rows_pad_little_and_take_few_shapes():
    assert [bucket_rows(n) for n in (1, 3, 5, 8, 12, 48, 96, 100, 288)] == [1, 4, 8, 8, 16, 48, 96, 104, 288]
    shapes = {bucket_rows(n) for n in range(129, 257)}
    assert len(shapes) == 8 and all(r % 8 == 0 for r in shapes)  # 144, 160, ..., 256
    for n in range(9, 2000):
        assert n <= bucket_rows(n) < n * 1.125 + 8 and bucket_rows(bucket_rows(n)) == bucket_rows(n)


def test_lengths_take_two_shapes_per_doubling_in_multiples_of_16():
    assert [length_bucket(n) for n in (1, 16, 17, 100, 129, 300, 1025)] == [16, 16, 32, 128, 192, 384, 1536]
    assert {length_bucket(n) for n in range(1025, 2049)} == {1536, 2048}
    assert {length_bucket(n) for n in range(2049, 4097)} == {3072, 4096}
    for n in range(1, 5000):
        b = length_bucket(n)
        assert n <= b and b % 16 == 0 and length_bucket(b) == b
        assert b - n < max(16, bucket(n) // 4), (n, b)


def test_page_bucket_takes_three_quarters_or_the_power_of_two():
    from marljax.core.shapes import page_bucket
    assert [page_bucket(n) for n in (1, 2, 3, 4, 5, 6, 7, 9, 12, 13, 21, 24, 25)] == [1, 2, 3, 4, 6, 6, 8, 12, 12, 16,
                                                                                      24, 24, 32]
    assert all(n <= page_bucket(n) < 1.5 * n for n in range(3, 3000))
    assert len({page_bucket(n) for n in range(1025, 2049)}) == 2
