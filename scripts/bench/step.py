"""DPO train-step benchmark: dpojax against TRL's DPOTrainer on the same model, data and loss.

    python scripts/bench_step.py --model tiny --data dense
    python scripts/bench_step.py --model large --data agent --warmup 2 --steps 4

One invocation builds a random Llama (dpojax `init_model`, exported with `save_pretrained`; both
frameworks load that directory), a word-level tokenizer whose vocabulary has exactly the model's
size (token id i is the word `w{i}`, so random token ids become text that tokenizes back to the
same ids in both pipelines; BOS is prepended and EOS appended to completions by each pipeline's own
convention), and random token-level preference pairs. Then, each in its own subprocess (separate
peak RSS, separate threads):
  peak    a jitted float32 matmul benchmark (best GFLOP/s over a few square sizes): the peak the
          model FLOP utilisation (MFU) is measured against
  dpojax  `tokenize_pairs` -> `BatchIterator` (the `--layout`) -> `Stepper.train`
  trl     `DPOTrainer` (when torch and trl are installed: `pip install -e .[bench]`)
Both train float32, constant learning rate, AdamW, grad-norm clip 1.0, no gradient checkpointing,
sigmoid loss with beta 0.1, a frozen (or precomputed, `--reference precomputed`, for both) reference,
on the same pairs in the same order. A step is timed end to end: building the batch on the host,
the update, and waiting for its result (dpojax) / the time between two `on_step_end` callbacks
(TRL: collation, forward, backward, optimizer, logging). dpojax runs `--warmup` steps and then one
step per batch shape of the timed steps that has not been compiled yet, so the timed steps never
compile; TRL runs `--warmup` steps. The peak and dpojax workers run with glibc's huge-page malloc
(`dpojax.xla_env.hugepage_malloc_env`), as `python -m dpojax.main` does; the TRL worker runs as
TRL users run it, or with it too under `--hugepage-malloc all`.

Data (`--data`):
  dense  8 pairs a step; prompt 64 + completion 64 tokens per sequence (large: 128 + 128)
  agent  TTC-like turns: a 512-1024-token prompt (conversation history; skewed towards short) and
         `--candidates` completions of 8-64 tokens (log-normal, median 16), every pair of them;
         12 pairs a step by default (two turns of 4 candidates)
tokens/s counts the tokens of both sequences of every pair (prompt + completion, the prompt twice),
so it measures the same work in both frameworks whatever dpojax's layout computes. MFU counts the
FLOPs a framework's batch needs (non-padding tokens, the attention its mask allows, the LM head on
scored tokens; x3 for the policy's forward + backward, +1 forward for a frozen reference).

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .dpojax_worker import worker_dpojax
from .measure import loadavg, matmul_peak
from .synthetic import MODELS, benchmark_pairs, build_model_dir, sequence_work
from .trl_worker import run_trl

# The command the workers run: this package's entry point, with `--worker NAME`.
ENTRY = Path(__file__).resolve().parents[1] / "bench_step.py"
LAYOUT_CHOICES = ("auto", "padded", "packed", "prefix_shared", "grouped")
# Extra XLA CPU flags for the dpojax and peak workers unless --xla-flags says otherwise: none. On
# the development VM with jax 0.10.2, XLA's default (YNNPACK dot fusions) ran the large model's
# step 14% faster than `--xla_cpu_experimental_ynn_fusion_type=` (Eigen dots), equal on the tiny
# one (docs/benchmarks-history.md).
DEFAULT_XLA_FLAGS = ""
WORKERS = {"peak": matmul_peak, "dpojax": worker_dpojax, "trl": run_trl}


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    """What is trained: model, data, layout, reference, steps."""
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--data", choices=("dense", "agent"), default="dense")
    parser.add_argument(
        "--layout",
        choices=LAYOUT_CHOICES,
        default="auto",
        help="dpojax batch layout (auto: prefix_shared for dense, grouped for agent data)",
    )
    parser.add_argument("--reference", choices=("frozen", "precomputed"), default="frozen")
    parser.add_argument(
        "--seq",
        type=int,
        default=0,
        help="dense data: tokens per sequence, half prompt and half completion (default: the "
        "model's dense lengths, 128 tiny / 256 large)",
    )
    parser.add_argument(
        "--attention",
        choices=("auto", "reference", "flash", "pallas"),
        default="auto",
        help="dpojax's attention implementation (model.attention)",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--pairs-per-step", type=int, default=None, help="dense 8, agent 12")
    parser.add_argument("--candidates", type=int, default=4, help="agent: completions per turn")
    parser.add_argument(
        "--buckets",
        choices=("fine", "pow2"),
        default="fine",
        help="dpojax row lengths: every multiple of 64 (fine) or powers of two (pow2)",
    )
    parser.add_argument(
        "--vocab-chunk", type=int, default=4096, help="dpojax StepConfig.vocab_chunk (0: none)"
    )
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)


def _add_environment_args(parser: argparse.ArgumentParser) -> None:
    """How it runs: which frameworks, their processes' settings, where files go."""
    parser.add_argument("--frameworks", default="dpojax,trl", help="comma-separated subset")
    parser.add_argument(
        "--xla-flags",
        default=None,
        help="extra XLA_FLAGS for the dpojax and peak workers, appended to the environment's "
        "(default: none)",
    )
    parser.add_argument(
        "--hugepage-malloc",
        choices=("dpojax", "all", "none"),
        default="dpojax",
        help="which workers run with glibc's huge-page malloc (dpojax.xla_env.HUGEPAGE_TUNABLE), "
        "as `python -m dpojax.main` does: the peak and dpojax workers (default), all three (TRL "
        "too, for a comparison under the same allocator), or none",
    )
    parser.add_argument(
        "--trl-omp-wait-policy",
        default="PASSIVE",
        help="OMP_WAIT_POLICY of the TRL worker ('' leaves libgomp's default, spin-waiting: on a "
        "CPU shared with another job that makes torch several times slower)",
    )
    parser.add_argument("--workdir", default=None, help="keep the model, data and results here")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _add_workload_args(parser)
    _add_environment_args(parser)
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Plan:
    """The run the arguments resolve to."""

    frameworks: tuple[str, ...]
    layout: str
    pairs_per_step: int
    data: list[dict]


def plan(args: argparse.Namespace) -> Plan:
    if args.steps < 1 or args.warmup < 1:
        raise SystemExit("--steps and --warmup must be >= 1")
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    if "trl" in frameworks and not all(
        importlib.util.find_spec(m) for m in ("torch", "trl", "datasets")
    ):
        print("torch / trl not installed (pip install -e .[bench]): dpojax only")
        frameworks = [f for f in frameworks if f != "trl"]
    layout = args.layout
    if layout == "auto":
        layout = "prefix_shared" if args.data == "dense" else "grouped"
    pairs_per_step = args.pairs_per_step or (8 if args.data == "dense" else 12)
    n_pairs = (args.warmup + args.steps) * pairs_per_step
    data = benchmark_pairs(
        args.model, args.data, n_pairs, seq=args.seq, candidates=args.candidates, seed=args.seed
    )
    return Plan(tuple(frameworks), layout, pairs_per_step, data)


def environments(args: argparse.Namespace) -> tuple[dict, dict]:
    """The environments of the JAX workers (peak, dpojax) and of the TRL worker."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    env.setdefault("JAX_PLATFORMS", "cpu")
    xla_flags = DEFAULT_XLA_FLAGS if args.xla_flags is None else args.xla_flags
    jax_env = dict(env, XLA_FLAGS=(env.get("XLA_FLAGS", "") + " " + xla_flags).strip())
    trl_env = dict(env)
    if args.trl_omp_wait_policy:
        trl_env["OMP_WAIT_POLICY"] = args.trl_omp_wait_policy
    if args.hugepage_malloc != "none":
        from dpojax.xla_env import hugepage_malloc_env

        jax_env = hugepage_malloc_env(jax_env) or jax_env
        if args.hugepage_malloc == "all":
            trl_env = hugepage_malloc_env(trl_env) or trl_env
    return jax_env, trl_env


def run_worker(name: str, spec_path: Path, workdir: Path, env: dict) -> dict:
    """Runs worker `name` in its own process; its result with the load and wall time around it."""
    out = workdir / f"result_{name}.json"
    load = loadavg()
    start = time.perf_counter()
    cmd = [sys.executable, str(ENTRY), "--worker", name, "--spec", str(spec_path)]
    proc = subprocess.run([*cmd, "--out", str(out)], env=env)
    if proc.returncode != 0:
        raise SystemExit(f"worker {name} failed with exit status {proc.returncode}")
    result = json.loads(out.read_text())
    result.update(load_before=load, load_after=loadavg(), wall_s=time.perf_counter() - start)
    return result


def run_workers(args: argparse.Namespace, run: Plan, workdir: Path):
    """Writes the model, data and spec into `workdir` and runs the workers. Returns the model's
    config and the results by worker name."""
    jax_env, trl_env = environments(args)
    config = build_model_dir(workdir / "model", args.model, args.seed)
    (workdir / "data.json").write_text(json.dumps(run.data))
    spec = dict(
        model_dir=str(workdir / "model"),
        data_path=str(workdir / "data.json"),
        layout=run.layout,
        reference=args.reference,
        pairs_per_step=run.pairs_per_step,
        warmup=args.warmup,
        steps=args.steps,
        buckets=args.buckets,
        vocab_chunk=args.vocab_chunk,
        learning_rate=args.learning_rate,
        attention=args.attention,
    )
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    results = {}
    if "dpojax" in run.frameworks:
        results["peak"] = run_worker("peak", spec_path, workdir, jax_env)
        results["dpojax"] = run_worker("dpojax", spec_path, workdir, jax_env)
    if "trl" in run.frameworks:
        results["trl"] = run_worker("trl", spec_path, workdir, trl_env)
    return config, results, (jax_env, trl_env)


def _framework_figures(name: str, r: dict, pairs_per_step: int, tokens_per_step: float) -> dict:
    s = r["s_per_step"]
    return {
        f"{name}_s_per_step": s,
        f"{name}_s_per_step_median": r["s_per_step_median"],
        f"{name}_pairs_per_s": pairs_per_step / s,
        f"{name}_tokens_per_s": tokens_per_step / s,
        f"{name}_peak_rss_gb": r["peak_rss_gb"],
        f"{name}_load": f"{r['load_before']} -> {r['load_after']}",
        f"{name}_step_times": r["step_times"],
        f"{name}_ref_precompute_s": r["ref_precompute_s"],
    }


def _dpojax_figures(r: dict, peak: float) -> dict:
    return dict(
        mfu=r["model_flops_per_step"] / r["s_per_step"] / (peak * 1e9),
        dpojax_model_gflop_per_step=r["model_flops_per_step"] / 1e9,
        dpojax_computed_tokens_per_step=r["computed_tokens_per_step"],
        dpojax_head_positions_per_step=r["head_positions_per_step"],
        dpojax_padding_fraction=r["padding_fraction"],
        dpojax_batch_shapes=sorted({tuple(s) for s in r["batch_shapes"]}),
        dpojax_attention=r["attention"],
        dpojax_compile_steps=r["compile_steps"],
        dpojax_recompiles_in_timed_steps=r["recompiles_in_timed_steps"],
        dpojax_device_s_per_step=r["device_s_per_step"],
        dpojax_outside_s_per_step=r["outside_s_per_step"],
        dpojax_pipelined_s_per_step=r["pipelined_s_per_step"],
        dpojax_pipelined_outside_s_per_step=r["pipelined_outside_s_per_step"],
        dpojax_outside_s_per_step_median=r["outside_s_per_step_median"],
        dpojax_pipelined_outside_s_per_step_median=r["pipelined_outside_s_per_step_median"],
        dpojax_host_batch_s_per_step_median=r["host_batch_s_per_step_median"],
        dpojax_pipelined_input_wait_s_per_step_median=r["pipelined_input_wait_s_per_step_median"],
        dpojax_pipelined_step_times=r["pipelined_step_times"],
        dpojax_setup_s=r["setup_s"],
        dpojax_warm_s=r["warm_s"],
    )


def _trl_figures(r: dict, trl_flops: float, peak: float | None) -> dict:
    out = dict(
        trl_model_gflop_per_step=trl_flops / 1e9,
        trl_torch_threads=r["torch_threads"],
        trl_attn_implementation=r["attn_implementation"],
        trl_version=r["trl_version"],
        trl_omp_wait_policy=r["omp_wait_policy"],
        torch_version=r["torch_version"],
    )
    if peak:
        out["trl_mfu"] = trl_flops / r["s_per_step"] / (peak * 1e9)
    return out


def _comparison(d: dict, t: dict) -> dict:
    """dpojax against TRL: the throughput ratio and the first batch's log-probs."""
    diffs = [
        abs(a - b)
        for k in ("chosen", "rejected")
        for a, b in zip(d["first_batch_logps"][k], t["first_batch_logps"][k], strict=True)
    ]
    mags = [abs(b) for k in ("chosen", "rejected") for b in t["first_batch_logps"][k]]
    return dict(
        ratio=t["s_per_step"] / d["s_per_step"],
        ratio_median=t["s_per_step_median"] / d["s_per_step_median"],
        logps_max_abs_diff=max(diffs),
        logps_max_rel_diff=max(x / max(m, 1e-30) for x, m in zip(diffs, mags, strict=True)),
        logps_mean_abs=sum(mags) / len(mags),
    )


def summarize(args, run: Plan, config, results: dict, envs: tuple[dict, dict]) -> dict:
    """Every figure of the run, as the JSON line prints them."""
    from dpojax.train.flops import step_flops

    jax_env, trl_env = envs
    seq_tokens, seq_attention, seq_scored = sequence_work(
        run.data[args.warmup * run.pairs_per_step :]
    )
    tokens_per_step = seq_tokens / args.steps
    peak = results.get("peak", {}).get("matmul_peak_gflops")
    summary: dict = dict(
        model=args.model,
        data=args.data,
        layout=run.layout,
        reference=args.reference,
        buckets=args.buckets,
        vocab_chunk=args.vocab_chunk,
        pairs_per_step=run.pairs_per_step,
        warmup=args.warmup,
        steps=args.steps,
        sequence_tokens_per_step=tokens_per_step,
        cpu_count=os.cpu_count(),
        matmul_peak_gflops=peak,
        matmul_best_call_gflops=results.get("peak", {}).get("matmul_best_call_gflops"),
        xla_flags=jax_env["XLA_FLAGS"],
        glibc_tunables_dpojax=jax_env.get("GLIBC_TUNABLES", ""),
        glibc_tunables_trl=trl_env.get("GLIBC_TUNABLES", ""),
    )
    for name in ("dpojax", "trl"):
        if name in results:
            figures = _framework_figures(name, results[name], run.pairs_per_step, tokens_per_step)
            summary.update(figures)
    if "dpojax" in results:
        summary.update(_dpojax_figures(results["dpojax"], peak))
    if "trl" in results:
        frozen = args.reference == "frozen"
        work = (seq_tokens, seq_attention, seq_scored)
        trl_flops = step_flops(config, *work, reference_forward=frozen) / args.steps
        summary.update(_trl_figures(results["trl"], trl_flops, peak))
    if "dpojax" in results and "trl" in results:
        summary.update(_comparison(results["dpojax"], results["trl"]))
    return summary


def fmt(x, spec=",.0f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(args, run: Plan, config, summary: dict) -> None:
    """The human-readable table, then the JSON line."""
    print(
        f"\n{args.model} model ({config.num_layers} layers, hidden {config.hidden_size}, vocab "
        f"{config.vocab_size}), {args.data} data, {run.pairs_per_step} pairs/step, "
        f"{summary['sequence_tokens_per_step']:,.0f} sequence tokens/step; dpojax layout "
        f"{run.layout}, reference {args.reference}; {args.warmup} warm-up + {args.steps} timed "
        f"steps; matmul peak {fmt(summary['matmul_peak_gflops'], '.1f')} GFLOP/s\n"
    )
    print("| framework | s/step (mean / median) | pairs/s | tokens/s | MFU | peak RSS GB | load |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in ("dpojax", "trl"):
        if f"{name}_s_per_step" not in summary:
            continue
        mfu = summary.get("mfu" if name == "dpojax" else "trl_mfu")
        print(
            f"| {name} | {summary[f'{name}_s_per_step']:.3f} / "
            f"{summary[f'{name}_s_per_step_median']:.3f} | "
            f"{summary[f'{name}_pairs_per_s']:.2f} | {summary[f'{name}_tokens_per_s']:,.0f} | "
            f"{fmt(mfu, '.0%')} | {summary[f'{name}_peak_rss_gb']:.2f} | {summary[f'{name}_load']} |"
        )
    if "dpojax_device_s_per_step" in summary:
        print(
            f"\ndpojax outside the compiled step: {summary['dpojax_outside_s_per_step']:.4f} s a "
            f"step synchronous, {summary['dpojax_pipelined_outside_s_per_step']:.4f} s pipelined "
            f"(compiled step alone {summary['dpojax_device_s_per_step']:.4f} s); medians "
            f"{summary['dpojax_outside_s_per_step_median']:.4f} s / "
            f"{summary['dpojax_pipelined_outside_s_per_step_median']:.4f} s. Host batch building "
            f"in the synchronous step (median): "
            f"{summary['dpojax_host_batch_s_per_step_median']:.4f} s; pipelined loop's wait for "
            f"its next batch (median): "
            f"{summary['dpojax_pipelined_input_wait_s_per_step_median']:.4f} s"
        )
    if "ratio" in summary:
        print(
            f"\nratio dpojax/TRL (throughput): {summary['ratio']:.2f}x (medians "
            f"{summary['ratio_median']:.2f}x); first-batch log-probs: max |diff| "
            f"{summary['logps_max_abs_diff']:.2e} (mean |logp| {summary['logps_mean_abs']:.1f})"
        )
    print(json.dumps(summary))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        Path(args.out).write_text(json.dumps(WORKERS[args.worker](spec)))
        return
    run = plan(args)
    if args.workdir:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        config, results, envs = run_workers(args, run, workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
            config, results, envs = run_workers(args, run, Path(tmp))
    summary = summarize(args, run, config, results, envs)
    print_report(args, run, config, summary)
