"""Whole user runs, dpojax against TRL: `python -m dpojax.main` with the shipped
configs/train_pairs.py recipe, and a TRL `DPOTrainer` script with the same settings, on the same
model directory and pair file, each in its own process. Each process is measured from start to exit
(imports, tokenizing, compiling, the steps, the final save): wall seconds, CPU seconds and peak
resident memory (`os.wait4`'s `ru_maxrss`, which covers the process and the children it waited for).

    python scripts/bench_run.py --model medium --seq 512 --pairs 64 --batch-size 8
    python scripts/bench_run.py --model medium --seq 2048 --pairs 16 --batch-size 4

Both train float32 with AdamW at the recipe's learning rate (5e-7, cosine, 10% warmup), grad-norm
clip 1.0, sigmoid loss with beta 0.1 and a frozen reference, `--batch-size` pairs a step over the
`--pairs` pairs once, one sequence per row (dpojax's `padded` layout, TRL's default) at
`--seq` tokens at most; dpojax saves its final checkpoint and export, TRL its model (`save_model`).
TRL 1.16 checkpoints every decoder layer by default (recomputing it in the backward pass);
dpojax's recipe does not (model.remat=none): compare like with like through
`--dpojax-override model.remat=full` or `--trl-gradient-checkpointing false`.
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .synthetic import MODELS, build_model_dir, dense_data, pair_texts

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "scripts" / "bench_run.py"
RECIPE = ROOT / "configs" / "train_pairs.py"
# configs/train_pairs.py's optimizer settings, which the TRL script copies
LEARNING_RATE, WARMUP_RATIO, SCHEDULE = 5e-7, 0.1, "cosine"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="medium")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence (max_length)")
    parser.add_argument("--pairs", type=int, default=64, help="pairs in the file, trained once")
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per optimizer step")
    parser.add_argument("--frameworks", default="dpojax,trl", help="comma-separated, in order")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each framework")
    parser.add_argument(
        "--dpojax-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra `--config.KEY=VALUE` for dpojax (repeatable)",
    )
    parser.add_argument(
        "--trl-omp-wait-policy",
        default="PASSIVE",
        help="OMP_WAIT_POLICY of the TRL process ('' leaves libgomp's spin-waiting default)",
    )
    parser.add_argument(
        "--trl-gradient-checkpointing",
        choices=("true", "false"),
        default="true",
        help="DPOConfig.gradient_checkpointing (TRL 1.16's default: true, every decoder layer "
        "recomputed in the backward pass, as dpojax's model.remat=full)",
    )
    parser.add_argument("--workdir", default=None, help="keep the model, pairs and runs here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.seq < 8 or args.batch_size < 1 or args.pairs < args.batch_size or args.repeat < 1:
        parser.error("need --seq >= 8, --batch-size >= 1, --pairs >= --batch-size, --repeat >= 1")
    return args


def write_inputs(args: argparse.Namespace, workdir: Path) -> tuple[Path, Path]:
    """The random model directory and a TRL-format pair file of `--pairs` dense pairs whose
    sequences are `--seq` tokens long (BOS + prompt, completion + EOS: half each)."""
    model_dir, pairs_path = workdir / "model", workdir / "pairs.jsonl"
    build_model_dir(model_dir, args.model, args.seed)
    vocab = MODELS[args.model]["vocab_size"]
    data = dense_data(args.pairs, args.seq // 2, args.seq - args.seq // 2, vocab, args.seed)
    with pairs_path.open("w") as f:
        for pair in data:
            prompt, chosen, rejected = pair_texts(pair)
            f.write(json.dumps(dict(prompt=prompt, chosen=chosen, rejected=rejected)) + "\n")
    return model_dir, pairs_path


def dpojax_command(args, model_dir: Path, pairs_path: Path, out: Path) -> list[str]:
    steps = args.pairs // args.batch_size
    overrides = [
        f"model.path={model_dir}",
        f"data.train_path={pairs_path}",
        f"data.max_length={args.seq}",
        f"train.batch_size={args.batch_size}",
        f"train.steps={steps}",
        "train.progress=False",
        *args.dpojax_override,
    ]
    cmd = [sys.executable, "-m", "dpojax.main", "--config", str(RECIPE), "--workdir", str(out)]
    return cmd + [f"--config.{o}" for o in overrides]


def trl_command(args, model_dir: Path, pairs_path: Path, out: Path) -> list[str]:
    spec = dict(
        model_dir=str(model_dir),
        pairs_path=str(pairs_path),
        output_dir=str(out),
        max_length=args.seq,
        batch_size=args.batch_size,
        steps=args.pairs // args.batch_size,
        seed=args.seed,
        gradient_checkpointing=args.trl_gradient_checkpointing == "true",
    )
    spec_path = out.parent / f"{out.name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    return [sys.executable, str(ENTRY), "--trl-spec", str(spec_path)]


def trl_user_run(spec: dict) -> None:
    """A TRL user's script: load the model and pairs, `DPOTrainer.train()`, `save_model()`."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    datasets.disable_progress_bars()
    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    train = datasets.load_dataset("json", data_files=spec["pairs_path"], split="train")
    config = DPOConfig(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=spec["batch_size"],
        max_steps=spec["steps"],
        max_length=spec["max_length"],
        learning_rate=LEARNING_RATE,
        lr_scheduler_type=SCHEDULE,
        warmup_steps=WARMUP_RATIO,  # a float below 1: a fraction of the steps
        optim="adamw_torch",
        max_grad_norm=1.0,
        gradient_checkpointing=spec["gradient_checkpointing"],
        beta=0.1,
        loss_type=["sigmoid"],
        bf16=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=spec["seed"],
    )
    trainer = DPOTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer)
    trainer.train()
    trainer.save_model()


def measured(cmd: list[str], env: dict, log: Path) -> dict:
    """Runs `cmd` to its exit; its wall seconds, CPU seconds and peak RSS (GB)."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{cmd[1:4]} failed with exit status {proc.returncode}:\n{tail}")
    return dict(
        wall_s=wall,
        cpu_s=usage.ru_utime + usage.ru_stime,
        peak_rss_gb=usage.ru_maxrss / 1024**2,  # KiB on Linux
        load_before=round(load, 2),
        load_after=round(os.getloadavg()[0], 2),
    )


def environments(args) -> dict[str, dict]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.pop("XLA_FLAGS", None)  # the user's default devices, not a test session's fake ones
    trl_env = dict(env)
    if args.trl_omp_wait_policy:
        trl_env["OMP_WAIT_POLICY"] = args.trl_omp_wait_policy
    return dict(dpojax=env, trl=trl_env)


def run_all(args, workdir: Path) -> dict[str, list[dict]]:
    """Every framework's runs, in order, `--repeat` times; their measurements."""
    model_dir, pairs_path = write_inputs(args, workdir)
    envs = environments(args)
    builders = dict(dpojax=dpojax_command, trl=trl_command)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = sorted(set(frameworks) - set(builders))
    if unknown:
        raise SystemExit(f"--frameworks: unknown {unknown}; choose from {sorted(builders)}")
    results: dict[str, list[dict]] = {f: [] for f in frameworks}
    for i in range(args.repeat):
        for name in frameworks:
            out = workdir / f"{name}_run{i}"
            cmd = builders[name](args, model_dir, pairs_path, out)
            results[name].append(measured(cmd, envs[name], workdir / f"{name}_run{i}.log"))
            print(f"{name} run {i}: {json.dumps(results[name][-1])}", flush=True)
    return results


def summarize(args, results: dict[str, list[dict]]) -> dict:
    """Per framework: the median run's figures (by wall time) and every run; the ratios."""
    summary: dict = dict(
        model=args.model,
        seq=args.seq,
        pairs=args.pairs,
        batch_size=args.batch_size,
        steps=args.pairs // args.batch_size,
        cpu_count=os.cpu_count(),
        dpojax_overrides=args.dpojax_override,
        trl_gradient_checkpointing=args.trl_gradient_checkpointing == "true",
    )
    for name, runs in results.items():
        ordered = sorted(runs, key=lambda r: r["wall_s"])
        median = ordered[len(ordered) // 2]
        summary.update({f"{name}_{k}": v for k, v in median.items()})
        summary[f"{name}_peak_rss_gb_max"] = max(r["peak_rss_gb"] for r in runs)
        summary[f"{name}_runs"] = runs
    if "dpojax" in results and "trl" in results:
        summary["speedup"] = summary["trl_wall_s"] / summary["dpojax_wall_s"]
        summary["rss_ratio"] = summary["dpojax_peak_rss_gb"] / summary["trl_peak_rss_gb"]
    return summary


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.trl_spec:
        trl_user_run(json.loads(Path(args.trl_spec).read_text()))
        return
    from dpojax.runtime import skip_accelerator_plugins

    # this process writes the random model with JAX on the CPU: no CUDA or TPU plugin start-up
    skip_accelerator_plugins()
    if args.workdir:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        results = run_all(args, workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="bench_run_") as tmp:
            results = run_all(args, Path(tmp))
    summary = summarize(args, results)
    print("\n| framework | wall s | CPU s | peak RSS GB | load (1 min) |\n|---|---:|---:|---:|---|")
    for name in results:
        print(
            f"| {name} | {summary[f'{name}_wall_s']:.1f} | {summary[f'{name}_cpu_s']:.1f} | "
            f"{summary[f'{name}_peak_rss_gb']:.2f} | {summary[f'{name}_load_before']} -> "
            f"{summary[f'{name}_load_after']} |"
        )
    if "speedup" in summary:
        print(f"\ndpojax {summary['speedup']:.2f}x faster, {summary['rss_ratio']:.2f}x TRL's RSS")
    print(json.dumps(summary))
