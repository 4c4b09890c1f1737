"""A profiled train run of a recipe on the chips at hand, with random weights of the recipe's model
shape and word-token pairs of its row length — no download, so it runs on a machine that reaches
nothing (a rented GPU VM before the weights are copied there, say).

    # the 1B H100 recipe's per-GPU share (8 of its 64 pairs a step) on one GPU, steps 10-15 traced:
    python scripts/profile_recipe.py --out /tmp/prof
    # the same on a CPU, shrunk to a toy (checks the script itself):
    python scripts/profile_recipe.py --out /tmp/prof --shrink --seq 128 --steps 6 --profile 3:4

It writes OUT/model (config.json from --model-config with the tokenizer's special ids, random
bf16 weights, a word-level tokenizer of the model's vocabulary size), OUT/pairs.jsonl, runs
`python -m dpojax.main --config RECIPE` into OUT/run with the overrides below (plus any
--set key=value), then prints the run's `timing` (compile, step median / p90, input wait, tokens/s,
MFU), its peak memory, and the trace files under OUT/run/profile. The last line is one JSON
object with those figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The run gets the caller's environment (main builds the random weights on the host, so that it
# holds no accelerator memory while the run is on the chips).
RUN_ENV = dict(os.environ)
RUN_ENV["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]  # runs without an install

from bench.synthetic import (  # noqa: E402
    BOS_ID,
    EOS_ID,
    PAD_ID,
    dense_data,
    pair_texts,
    word_tokenizer,
)

# --shrink: the recipe's model family and head layout at toy width and depth.
SHRUNK = dict(
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    vocab_size=512,
    head_dim=32,
    num_heads=4,
    num_kv_heads=2,
)


def build_model(out: Path, model_config: Path, shrink: bool, seed: int):
    """The random model directory; returns its ModelConfig."""
    from dpojax.models.hf import read_config, save_pretrained
    from dpojax.models.transformer import init_model

    overrides = dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    if shrink:
        overrides.update(SHRUNK)
    config = read_config(model_config, **overrides)
    model = init_model(config, seed=seed)
    save_pretrained(model, word_tokenizer(config.vocab_size), out, dtype="bfloat16")
    return config


def write_pairs(path: Path, n: int, seq: int, vocab: int, seed: int) -> None:
    """`n` pairs whose sequences are exactly `seq` tokens with BOS and EOS: a prompt of half the
    row, chosen and rejected answers of the other half."""
    with path.open("w") as f:
        for pair in dense_data(n, seq // 2, seq - seq // 2, vocab, seed):
            prompt, chosen, rejected = pair_texts(pair)
            f.write(json.dumps(dict(prompt=prompt, chosen=chosen, rejected=rejected)) + "\n")


def trace_files(profile_dir: Path) -> list[Path]:
    return sorted(
        p
        for p in profile_dir.rglob("*")
        if p.is_file() and (p.name.endswith(".trace.json.gz") or p.name.endswith(".xplane.pb"))
    )


def device_activity(trace: Path) -> dict | None:
    """How busy the accelerators were over a Perfetto trace: the union of the device timelines'
    events against the span from their first start to their last end, and the longest idle gaps
    (None when the trace holds no device, as on a CPU)."""
    import gzip

    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    devices = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and str(e.get("args", {}).get("name", "")).startswith("/device:")
    }
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if e.get("ph") == "X" and e.get("pid") in devices
    )
    if not spans:
        return None
    busy, gaps, (start, end) = 0.0, [], spans[0]
    first = start
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            gaps.append(s - end)
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    span = end - first
    gaps.sort(reverse=True)
    return {
        "span_ms": round(span / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3),
        "busy_fraction": round(busy / span, 4) if span else None,
        "idle_gaps": len(gaps),
        "longest_gaps_ms": [round(g / 1e3, 3) for g in gaps[:5]],
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--recipe", type=Path, default=REPO / "configs" / "llama1b_h100.py")
    p.add_argument("--model-config", type=Path, default=REPO / "configs/models/llama-3.2-1b")
    p.add_argument("--shrink", action="store_true", help="a toy of the model's shape (CPU check)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (the row length)")
    p.add_argument("--batch", type=int, default=8, help="pairs a step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", default="10:15", help="train.profile_steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--reuse",
        action="store_true",
        help="keep OUT/model and OUT/pairs.jsonl if "
        "there (another run over the same assets: OUT/run is replaced)",
    )
    p.add_argument("--run-name", default="run", help="the run's folder under OUT")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another --config.KEY=VALUE for the run",
    )
    return p.parse_args(argv)


def run_recipe(args: argparse.Namespace, model_dir: Path, pairs: Path, workdir: Path):
    """Runs the recipe; (its wall seconds, [(seconds, resident GiB)] samples)."""
    overrides = {
        "model.path": model_dir,
        "data.train_path": pairs,
        "data.eval_path": "",
        "data.max_length": args.seq,
        "train.batch_size": args.batch,
        "train.eval_batch_size": args.batch,
        "train.steps": args.steps,
        "train.eval_every": 0,
        "train.profile_steps": args.profile,
        "mesh.data": -1,
        "mesh.fsdp": 1,
        "mesh.tensor": 1,
        "checkpoint.every_steps": 10 * args.steps,
        "export.enabled": False,
    }
    cmd = [sys.executable, "-m", "dpojax.main", f"--config={args.recipe}", f"--workdir={workdir}"]
    cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
    cmd += [f"--config.{kv}" for kv in args.set]
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=RUN_ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    samples: list[tuple[float, float]] = []
    sampler = threading.Thread(target=_sample_rss, args=(proc, start, samples), daemon=True)
    sampler.start()
    for line in proc.stdout:  # each line stamped with the run's time and resident memory
        rss = samples[-1][1] if samples else 0.0
        print(
            f"[{time.perf_counter() - start:6.1f} s, RSS {rss:5.1f} GiB] {line}", end="", flush=True
        )
    if proc.wait():
        raise SystemExit(f"the run failed (exit {proc.returncode})")
    sampler.join()
    return time.perf_counter() - start, samples


def _sample_rss(proc: subprocess.Popen, start: float, samples: list) -> None:
    """The run's resident memory (GiB) every 0.2 s, from /proc (Linux)."""
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            kib = next(
                int(x.split()[1]) for x in status.read_text().splitlines() if x.startswith("VmRSS:")
            )
        except (OSError, StopIteration, ValueError):
            break
        samples.append((round(time.perf_counter() - start, 2), round(kib / 2**20, 2)))
        time.sleep(0.2)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"  # this process only: the run gets RUN_ENV
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    pairs = args.out / "pairs.jsonl"
    if args.reuse and pairs.is_file() and (args.out / "model" / "config.json").is_file():
        from dpojax.models.hf import read_config

        config = read_config(args.out / "model")
    else:
        config = build_model(args.out / "model", args.model_config, args.shrink, args.seed)
        write_pairs(pairs, args.batch * args.steps, args.seq, config.vocab_size, args.seed)
    assets = time.perf_counter() - start
    print(
        f"assets: {config.num_params():,} parameters, {args.batch * args.steps} pairs of "
        f"{args.seq}-token sequences, {assets:.1f} s",
        flush=True,
    )
    run = args.out / args.run_name
    if run.exists():
        shutil.rmtree(run)
    wall, rss = run_recipe(args, args.out / "model", pairs, run)
    (run / "rss_timeline.json").write_text(json.dumps(rss))
    traces = [p for p in trace_files(run / "profile") if p.suffix == ".gz"]
    summary = json.loads((run / "summary.json").read_text())
    timing = summary.get("timing", {})
    for key, value in timing.items():
        print(f"  {key}: {value}")
    result = {
        "params": config.num_params(),
        "seq": args.seq,
        "pairs_per_step": args.batch,
        "steps": args.steps,
        "run_wall_seconds": round(wall, 2),
        "timing": timing,
        "memory": {k: v for k, v in summary.items() if "memory" in k or "rss" in k},
        "peak_rss_gib_sampled": max((r for _, r in rss), default=None),
        "traces": [str(p) for p in traces],
        "device_activity": device_activity(traces[0]) if traces else None,
    }
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
