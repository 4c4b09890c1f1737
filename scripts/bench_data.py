"""Data pipeline benchmark: JSONL pairs -> batch arrays throughput, and padding per layout.

    python scripts/bench_data.py                      # the figures in docs/benchmarks.md
    python scripts/bench_data.py --num-pairs 2000     # a quick run

Part 1 (throughput): a synthetic JSONL file of ~512-token pairs (prompt ~256 tokens, completions
~128 each, TRL plain form) is read, tokenized (docs/layouts.md#tokenization-convention) and turned into one
epoch of batches per layout; pairs/s per stage and end to end. Twice: all prompts distinct, and
TTC-style (4 candidates per turn, 6 pairs per turn sharing a prompt), and again from the token
cache (`dpojax.data.token_cache`: a later run over the same data). The "tokenizer floor" is the
fast tokenizer encoding each pair's text once (prompt + chosen + rejected): no exact pipeline can
beat it, since every pair's text must be encoded at least once.
Part 2 (padding): a length-skewed dataset (log-normal prompt and completion lengths, TTC turns of
2-6 candidates); the fraction of padding token slots over an epoch per layout, and the array tokens
per pair (what the forward pass costs).
Uses the local tiny byte-level BPE tokenizer (`dpojax.models.tiny.build_tokenizer`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import numpy as np  # noqa: E402

from dpojax.data.layouts import LAYOUTS, Buckets  # noqa: E402
from dpojax.data.pair_files import pair_from_record, read_pairs  # noqa: E402
from dpojax.data.pipeline import BatchIterator  # noqa: E402
from dpojax.data.token_cache import tokenize_pairs_cached  # noqa: E402
from dpojax.data.tokenize import tokenize_pairs  # noqa: E402
from dpojax.models.tiny import _WORDS, build_tokenizer  # noqa: E402


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(words, 1)))


def uniform_records(n: int, seed: int, ttc: bool) -> list[dict]:
    """~512-token pairs: prompt ~120 words, completions ~60 words (about 2.1 tokens a word)."""
    rng = random.Random(seed)
    records: list[dict] = []
    while len(records) < n:
        prompt = _text(rng, rng.randint(110, 130))
        if ttc:  # one turn, 4 candidates, all 6 pairs
            cands = [" " + _text(rng, rng.randint(50, 70)) for _ in range(4)]
            meta = {"example_id": f"ex{len(records)}", "turn_id": 0}
            for i in range(4):
                for j in range(i + 1, 4):
                    records.append(
                        {
                            "prompt": prompt,
                            "chosen": cands[i],
                            "rejected": cands[j],
                            "metadata": meta,
                        }
                    )
        else:
            c, r = (" " + _text(rng, rng.randint(50, 70)) for _ in range(2))
            records.append({"prompt": prompt, "chosen": c, "rejected": r})
    return records[:n]


def skewed_records(n: int, seed: int) -> list[dict]:
    """Log-normal lengths (median prompt ~40 words, completions ~15, long tails); TTC turns of
    2-6 candidates with all their pairs."""
    rng = random.Random(seed)
    records: list[dict] = []
    turn = 0
    while len(records) < n:
        prompt = _text(rng, int(rng.lognormvariate(np.log(40), 0.9)))
        k = rng.randint(2, 6)
        cands = [" " + _text(rng, int(rng.lognormvariate(np.log(15), 1.0))) for _ in range(k)]
        meta = {"example_id": f"ex{turn}", "turn_id": 0}
        records += [
            {"prompt": prompt, "chosen": cands[i], "rejected": cands[j], "metadata": meta}
            for i in range(k)
            for j in range(i + 1, k)
        ]
        turn += 1
    return records[:n]


def write_jsonl(records: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def epoch(pairs, layout: str, batch_pairs: int, buckets: Buckets) -> list[dict]:
    it = BatchIterator(
        pairs, batch_pairs=batch_pairs, layout=layout, buckets=buckets, num_epochs=1, seed=0
    )
    return list(it)


def throughput(args, tok, workdir: Path, ttc: bool) -> None:
    n = args.num_pairs
    path = write_jsonl(uniform_records(n, args.seed, ttc), workdir / f"pairs_{int(ttc)}.jsonl")
    (pairs, _), t_read = timed(lambda: read_pairs(path))
    result, t_tok = timed(lambda: tokenize_pairs(pairs, tok, max_length=args.max_length))
    tp = result.pairs
    cache = workdir / f"token_cache_{int(ttc)}"
    (_, hit_miss), t_miss = timed(
        lambda: tokenize_pairs_cached(pairs, tok, cache_dir=cache, max_length=args.max_length)
    )
    (cached, hit), t_hit = timed(
        lambda: tokenize_pairs_cached(pairs, tok, cache_dir=cache, max_length=args.max_length)
    )
    assert hit and not hit_miss and len(cached.pairs) == len(tp)
    cache_mb = sum(f.stat().st_size for f in cache.iterdir()) / 1e6
    texts = [p.prompt + p.chosen + p.rejected for p in pairs]
    _, t_floor = timed(lambda: tok.backend_tokenizer.encode_batch_fast(texts))
    seq_tokens = np.mean([len(p.prompt_ids) + len(p.chosen_ids) for p in tp])
    pair_tokens = np.mean(
        [p.chosen_prompt_len + len(p.chosen_ids) + len(p.rejected_ids) for p in tp]
    )
    kind = "TTC turns (4 candidates, 6 pairs per prompt)" if ttc else "distinct prompts"
    print(f"\n### Throughput: {n} pairs, {kind}")
    print(
        f"{pair_tokens:.0f} tokens per pair (prompt + chosen + rejected), {seq_tokens:.0f} per sequence"
    )
    print(f"batch_pairs={args.batch_pairs}, max_length={args.max_length}\n")
    print("| stage | seconds | pairs/s |")
    print("|---|---:|---:|")
    print(f"| read JSONL (`read_pairs`) | {t_read:.2f} | {n / t_read:,.0f} |")
    print(f"| tokenize (`tokenize_pairs`) | {t_tok:.2f} | {n / t_tok:,.0f} |")
    print(f"| tokenizer floor (one encode per pair) | {t_floor:.2f} | {n / t_floor:,.0f} |")
    print(
        f"| token cache miss (tokenize + write {cache_mb:.0f} MB) | {t_miss:.2f} | {n / t_miss:,.0f} |"
    )
    print(f"| token cache hit (hash texts + load) | {t_hit:.2f} | {n / t_hit:,.0f} |")
    warm = []
    for layout in LAYOUTS:
        _, t_batch = timed(lambda layout=layout: epoch(tp, layout, args.batch_pairs, Buckets()))
        print(
            f"| batches, {layout} (tokenized pairs -> arrays) | {t_batch:.2f} | {n / t_batch:,.0f} |"
        )
        total = t_read + t_tok + t_batch
        print(f"| **end to end, {layout}** (JSONL -> arrays) | {total:.2f} | {n / total:,.0f} |")
        warm.append((layout, t_read + t_hit + t_batch))
    for layout, total in warm:
        print(f"| **end to end from the token cache, {layout}** | {total:.2f} | {n / total:,.0f} |")


def padding(args, tok) -> None:
    pairs = [pair_from_record(r) for r in skewed_records(args.skewed_pairs, args.seed + 1)]
    result = tokenize_pairs(pairs, tok, max_length=args.max_length)
    tp = result.pairs
    seq = np.array([len(p.prompt_ids) + len(p.chosen_ids) for p in tp])
    print(f"\n### Padding: {len(pairs)} pairs, length-skewed, TTC turns of 2-6 candidates")
    print(f"tokenization: {result}")
    print(
        f"sequence tokens: median {np.median(seq):.0f}, mean {seq.mean():.0f}, p99 "
        f"{np.percentile(seq, 99):.0f}, max {seq.max()}; batch_pairs={args.batch_pairs}, "
        f"default Buckets (lengths 64..8192, row_bits 3)\n"
    )
    print("| layout | batch_pairs | padding fraction | array tokens per pair | distinct shapes |")
    print("|---|---:|---:|---:|---:|")
    runs = [(layout, args.batch_pairs) for layout in LAYOUTS]
    runs.append(("grouped", 4 * args.batch_pairs))  # a grouped batch holds far fewer tokens
    for layout, batch_pairs in runs:
        batches = epoch(tp, layout, batch_pairs, Buckets())
        slots = sum(b["segment_ids"].size for b in batches)
        empty = sum(int((b["segment_ids"] == 0).sum()) for b in batches)
        shapes = {b["tokens"].shape for b in batches}
        print(
            f"| {layout} | {batch_pairs} | {empty / slots:.1%} | {slots / len(tp):.0f} | "
            f"{len(shapes)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-pairs", type=int, default=20_000)
    parser.add_argument("--skewed-pairs", type=int, default=20_000)
    parser.add_argument("--batch-pairs", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tok = build_tokenizer()
    print(
        f"CPU cores: {os.cpu_count()}, TOKENIZERS_PARALLELISM={os.environ['TOKENIZERS_PARALLELISM']}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for ttc in (False, True):
            throughput(args, tok, Path(tmp), ttc)
    padding(args, tok)


if __name__ == "__main__":
    main()
