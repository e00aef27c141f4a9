"""Reading finished runs: the per-run report (`report`, which a training run writes at its end and
`python -m marljax.report` writes for any runs) and the statistics over seeds (`seed_stats`)."""
