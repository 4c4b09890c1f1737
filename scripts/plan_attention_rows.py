"""Plans a recipe at several row lengths, one compile at a time, and prints per row length and
attention implementation the kernel, its temporaries, bytes and shares of the step, with the
step's memory and roofline (docs/benchmarks.md#attention-in-the-1b-plans-per-chip-and-row-length).
Each plan is `mode=plan` run in its own process with a time limit; a plan that fails or runs out
of time is a row saying so. With --summarize the plans already in WORKDIR/<target>_<length>/ are
read, not compiled.

    python scripts/plan_attention_rows.py --config configs/llama1b_h100.py --target gpu:h100:8 \
        --lengths 2048,8192,32768 --pairs 8 --workdir runs/attention_rows [--config.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HEAD = (
    "| chip | row | step fits | step GiB | step temp GiB | step s >= (bound) | implementation | "
    "block | attention temp GiB / layer | attention GB / step | bytes % | FLOPs % (XLA / model) |"
)


def run_plan(args, length: int, workdir: Path) -> str:
    """Runs one plan; returns "ok", "failed (rc N)" or "timed out after N s"."""
    cmd = [
        sys.executable, "-m", "dpojax.main", f"--config={args.config}", f"--workdir={workdir}",
        "--config.mode=plan", f"--config.plan.target={args.target}",
        f"--config.data.max_length={length}", f"--config.train.batch_size={args.pairs}",
        f"--config.train.eval_batch_size={args.pairs}", *args.extra,
    ]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "plan.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=log, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return f"timed out after {args.timeout} s"
    return "ok" if rc.returncode == 0 else f"failed (rc {rc.returncode})"


def _pct(share: dict | None, key: str) -> str:
    value = (share or {}).get(key)
    return "n/a" if value is None else f"{value:.1%}"


def rows(report: dict, length: int) -> list[str]:
    """The markdown rows of one plan: one per attention implementation."""
    recipe = next(c for c in report["candidates"] if c["label"] == "recipe")
    train, roof = recipe["train"], recipe.get("roofline") or {}
    total = train.get("total_bytes") or train.get("needed_bytes")
    temp = (train.get("memory_bytes") or {}).get("temp", train.get("needed_temporaries_bytes"))
    bound = f"{roof['step_seconds_bound']:.3f} ({roof['bound_by']})" if roof else "-"
    step = (
        f"| {report['target']} | {length:,} | {'yes' if recipe['fits'] else 'no'} | "
        f"{_gib(total)} | {_gib(temp)} | {bound} | "
    )
    out = []
    for k in report["attention_implementations"]:
        name = k["implementation"] + (
            " (the step's)" if k["implementation"] == recipe["attention"] else ""
        )
        if not k["runs"]:
            out.append(step + f"{name} | - | does not run: {k['reason'][:60]} | | | |")
            continue
        s = k["per_step"]
        hlo = "-" if s["hlo_bytes"] is None else f"{s['hlo_bytes'] / 1e9:.1f}"
        oom = "" if s["fits"] else " (out of memory)"
        out.append(
            step + f"{name} | {k.get('block') or '-'} | {_gib(s['temp_bytes'])}{oom} | {hlo} | "
            f"{_pct(k['share'], 'hlo_bytes')} | {_pct(k['share'], 'flops')} / "
            f"{_pct(k['share'], 'model_flops')} |"
        )
    return out


def _gib(value) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--lengths", default="2048,8192,32768")
    parser.add_argument("--pairs", type=int, required=True, help="pairs a step at every length")
    parser.add_argument("--workdir", default="runs/attention_rows")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per plan")
    parser.add_argument("--summarize", action="store_true", help="read the plans, compile none")
    args, args.extra = parser.parse_known_args()  # the rest: --config.key=value for every plan
    print(HEAD)
    print("|" + "---|" * (HEAD.count(" | ") + 1))
    for length in (int(n) for n in args.lengths.split(",")):
        workdir = Path(args.workdir) / f"{args.target.replace(':', '_')}_{length}"
        start = time.perf_counter()
        status = "ok" if args.summarize else run_plan(args, length, workdir)
        seconds = time.perf_counter() - start
        if status != "ok" or not (workdir / "plan.json").exists():
            status = "no plan.json" if status == "ok" else f"{status} ({seconds:.0f} s)"
            print(f"| {args.target} | {length:,} | {status} | | | | | | | | | |")
            continue
        for line in rows(json.loads((workdir / "plan.json").read_text()), length):
            print(line, flush=True)


if __name__ == "__main__":
    main()
