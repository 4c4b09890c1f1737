"""DPO train-step benchmark: dpojax against TRL's DPOTrainer on the same model, data and loss.

    python scripts/bench_step.py --model tiny --data dense
    python scripts/bench_step.py --model large --data agent --warmup 2 --steps 4
    python scripts/bench_step.py --help

What it builds, runs and measures: scripts/bench/step.py (the benchmark package beside this file).
The last line printed is one JSON object with every figure.
"""

from bench.step import main

if __name__ == "__main__":
    main()
