"""CPU step time of a LoRA DPO step on a quantized base (int8, nf4) against a bfloat16 base.

    python scripts/bench_quant_step.py                          # the defaults below
    python scripts/bench_quant_step.py --layers 1 --steps 3 --repeats 1   # a quick look

Writes a random llama-style HF checkpoint (dpojax `init_model` + `save_pretrained`, with a
word-level tokenizer whose vocabulary is exactly the model's, scripts/bench/synthetic.py) and
random token-level pairs (prompt and completions of --seq / 2 tokens each, so every row holds
--seq tokens) to a temporary folder. Then each case (model.quantization none, int8, nf4) runs
in its own fresh process, the cases interleaved (none, int8, nf4, none, ...) --repeats times.
A case builds the train job's own `Trainer` (dpojax.jobs.train.trainer: the quantized load, LoRA,
the step config, the optimizer, the train state and the jitted `Stepper`) from one config that
differs between cases only in model.quantization: LoRA rank --rank on all seven projections,
reference.type=lora_base, model.dtype and model.param_dtype bfloat16, --pairs pairs a step,
padded rows. It runs --warmup steps (the first compiles), then --steps timed steps, each built
on the host, placed, run and waited for, as the train loop's steps are (without its prefetch
thread). Reported per case: the median timed step (the median of its processes' medians) and
the fastest (the least disturbed by other work on the machine), their ratios to the bfloat16
base, XLA's compile seconds (JAX's backend-compile events), the process's peak RSS
(ru_maxrss) and, as a sanity check, step 1's loss and the policy's mean log-probs (equal seeds
and data: the cases differ only by the quantization error). The last line printed is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

CASES = ("none", "int8", "nf4")
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the bench package beside this file (also when loaded by path)
    sys.path.insert(0, str(HERE))
from bench.children import child_json, run_child_role  # noqa: E402


def _parse(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--hidden", type=int, default=512, help="hidden size")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--intermediate", type=int, default=0, help="MLP size (0: 4 x hidden)")
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    p.add_argument("--seq", type=int, default=512, help="tokens per row (prompt + completion)")
    p.add_argument("--pairs", type=int, default=1, help="pairs a step (2 rows each)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (all seven projections)")
    p.add_argument("--block", type=int, default=64, help="model.quantization_block")
    p.add_argument("--param-dtype", default="bfloat16", help="model.param_dtype of every case")
    p.add_argument("--steps", type=int, default=5, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1: compiles)")
    p.add_argument("--repeats", type=int, default=2, help="rounds of the interleaved cases")
    p.add_argument("--cases", default=",".join(CASES), help="model.quantization values")
    p.add_argument("--dir", help="write the model and pairs here (default: a temporary folder)")
    p.add_argument("--worker", nargs=2, metavar=("DIR", "CASE"), help=argparse.SUPPRESS)
    p.add_argument("--write-only", metavar="DIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--warmup, --steps and --repeats must be >= 1")
    if args.seq % 2:
        p.error("--seq must be even (half prompt, half completion)")
    bad = [c for c in args.cases.split(",") if c not in CASES]
    if bad:
        p.error(f"--cases: unknown {bad}; choose from {CASES}")
    return args


def overrides(args, case: str, model_dir: str, train_path: str) -> dict:
    """The config keys of one case (the cases differ only in model.quantization)."""
    from dpojax.models.model_config import LORA_TARGETS

    return {
        "model.path": model_dir,
        "model.dtype": "bfloat16",
        "model.param_dtype": args.param_dtype,
        "model.quantization": case,
        "model.quantization_block": args.block,
        "lora.rank": args.rank,
        "lora.alpha": float(args.rank),
        "lora.targets": LORA_TARGETS,  # all seven projections
        "reference.type": "lora_base",
        "data.train_path": train_path,
        "data.max_length": args.seq,
        "data.layout": "padded",
        "data.shuffle": False,
        "data.token_cache": False,
        "train.batch_size": args.pairs,
        "train.steps": args.warmup + args.steps,
        "train.auto_fit": "off",
        "train.progress": False,
        "mesh.data": 1,
        "seed": 0,
    }


def write_inputs(args, out: Path) -> dict:
    """The random model (float32 safetensors) and (warmup + steps) * pairs random pairs."""
    from bench.synthetic import BOS_ID, EOS_ID, PAD_ID, dense_data, pair_texts, word_tokenizer

    from dpojax.models import ModelConfig, init_model, save_pretrained

    config = ModelConfig(
        model_type="llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 4 * args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        max_position_embeddings=max(4096, args.seq),
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    model = init_model(config, seed=0)
    save_pretrained(model, word_tokenizer(args.vocab), out / "model")
    n = (args.warmup + args.steps) * args.pairs
    half = args.seq // 2  # the prompt gains BOS, each completion EOS
    with open(out / "pairs.jsonl", "w") as f:
        for pair in dense_data(n, half, half, args.vocab, seed=0):
            prompt, chosen, rejected = pair_texts(pair)  # completions start with a space
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    return {"params": config.num_params(), "pairs": n}


def worker(path: str, case: str, args) -> None:
    """One case in this process: the train job's Trainer, warm-up steps, then timed steps."""
    import jax
    from jax import monitoring

    compile_s = []

    def on_event(event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compile_s.append(seconds)

    monitoring.register_event_duration_secs_listener(on_event)
    from dpojax import api
    from dpojax.config import frozen, validate
    from dpojax.jobs.train.trainer import Trainer
    from dpojax.train.batches import stack_micro_batches

    d = Path(path)
    cfg = api.config(None, overrides(args, case, str(d / "model"), str(d / "pairs.jsonl")))
    errors = validate(cfg, num_devices=jax.device_count())
    if errors:
        raise SystemExit("\n".join(errors))
    start = time.perf_counter()
    workdir = tempfile.TemporaryDirectory(prefix="bench_quant_step_")  # removed at exit
    trainer = Trainer(frozen(cfg), workdir.name, train=True)
    setup_s = time.perf_counter() - start
    stepper, state, batches = trainer.stepper, trainer.state, trainer.train_batches()

    def step(state):
        host = trainer.with_reference(stack_micro_batches(next(batches)), "train")
        state, metrics = stepper.train_placed(state, stepper.put(host, micro_axis=True)[0])
        return state, jax.device_get(metrics)  # waits for the step

    times, records = [], []
    for i in range(args.warmup + args.steps):
        begun = time.perf_counter()
        state, metrics = step(state)
        times.append(time.perf_counter() - begun)
        records.append({k: float(v) for k, v in metrics.items() if getattr(v, "ndim", 1) == 0})
        if i == args.warmup - 1:
            compiled = stepper.train_cache_size()
    timed = times[args.warmup :]
    first = records[0]
    out = {
        "case": case,
        "median_s": round(statistics.median(timed), 4),
        "step_s": [round(t, 4) for t in timed],
        "first_step_s": round(times[0], 2),
        "compile_s": round(sum(compile_s), 2),
        "recompiles": stepper.train_cache_size() - compiled,
        "setup_s": round(setup_s, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "loss_1": first["loss"],
        "logps_chosen_1": first.get("logps/chosen"),
        "logps_rejected_1": first.get("logps/rejected"),
        "loss_last": records[-1]["loss"],
        "rows": list(next(batches)["tokens"].shape),
    }
    print(json.dumps(out), flush=True)


def _child(argv: list[str], what: str) -> dict:
    """The last JSON line of this script run in a fresh process (CPU, no compilation cache,
    glibc's huge-page malloc as `python -m dpojax.main` sets it)."""
    from dpojax.xla_env import hugepage_malloc_env

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_ENABLE_COMPILATION_CACHE": "false"}
    return child_json(__file__, argv, what, hugepage_malloc_env(env) or env)


def summarize(runs: list[dict], cases: list[str]) -> dict:
    """Per case: the median of its processes' median step times, its ratio to the "none" case,
    its fastest step, and the compile seconds, peak RSS and step-1 figures of its processes."""
    out = {}
    for case in cases:
        mine = [r for r in runs if r["case"] == case]
        out[case] = {
            "median_s": round(statistics.median(r["median_s"] for r in mine), 4),
            "process_medians_s": [r["median_s"] for r in mine],
            "fastest_s": min(min(r["step_s"]) for r in mine),  # the least disturbed step
            "compile_s": [r["compile_s"] for r in mine],
            "peak_rss_mib": [r["peak_rss_mib"] for r in mine],
            "loss_1": mine[0]["loss_1"],
            "logps_chosen_1": mine[0]["logps_chosen_1"],
            "logps_rejected_1": mine[0]["logps_rejected_1"],
        }
    if "none" in out:
        for case in cases:
            for key in ("median", "fastest"):
                ratio = out[case][f"{key}_s"] / out["none"][f"{key}_s"]
                out[case][f"x_bf16_{key}"] = round(ratio, 3)
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    if run_child_role(args, worker, write_inputs):
        return
    cases = args.cases.split(",")
    with tempfile.TemporaryDirectory(prefix="bench_quant_step_") as tmp:
        path = Path(args.dir or tmp)
        written = _child([*argv, "--write-only", str(path)], "writing the model and pairs")
        print(json.dumps({"inputs": written}), flush=True)
        runs = []
        for _ in range(args.repeats):
            for case in cases:
                runs.append(_child([*argv, "--worker", str(path), case], f"case {case}"))
                print(json.dumps(runs[-1]), flush=True)
    shapes = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "vocab")}
    shapes.update(intermediate=args.intermediate or 4 * args.hidden, seq=args.seq)
    shapes.update(pairs=args.pairs, rank=args.rank, block=args.block, params=written["params"])
    summary = {"shapes": shapes, "cases": summarize(runs, cases), "runs": runs}
    summary.update(steps=args.steps, warmup=args.warmup, load=os.getloadavg())
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
