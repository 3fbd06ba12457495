"""The benchmarks: one script per measured part, all on the harness in ``bench/common.py``.

A package importable from the repository root (``from bench import common``; pytest puts the root on
the path), so tests import the scripts' pieces as ``bench.<script>``. Each script runs either way from
the root: ``python -m bench.bench_planner`` or ``python bench/bench_planner.py``
(``docs/benchmarks.md``)."""
