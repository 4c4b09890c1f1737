"""The benchmark package behind scripts/bench_step.py and scripts/bench_run.py (imported with
scripts/ on `sys.path`, as a script run from that folder has it).

    synthetic      the random model, word-level tokenizer and token-level pairs both frameworks use
    measure        timing summaries, peak memory, the matmul peak the model FLOP utilisation uses
    dpojax_worker  dpojax's side: tokenize -> batch iterator -> `Stepper.train`
    trl_worker     TRL's `DPOTrainer` on the same model and pairs
    step           the command line: data, workers in subprocesses, the summary table and JSON
    run            bench_run.py: whole user runs (dpojax's command line, a TRL script), measured

Modules import downwards only (step -> workers -> measure, synthetic; run -> synthetic);
tests/hygiene checks that scripts/ has no import cycle.
"""
