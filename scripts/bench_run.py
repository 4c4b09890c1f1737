"""Whole user runs: `python -m dpojax.main` (configs/train_pairs.py) against a TRL DPOTrainer script
on the same model and pairs, each in its own process: wall time, CPU time and peak RSS.

    python scripts/bench_run.py --model medium --seq 512 --pairs 64 --batch-size 8
    python scripts/bench_run.py --help

What it builds, runs and measures: scripts/bench/run.py. The last line printed is one JSON object.
"""

from bench.run import main

if __name__ == "__main__":
    main()
