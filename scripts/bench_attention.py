"""Micro-benchmark of the attention core alone: one layer's self-attention forward + gradient
(of the sum of its output) for each implementation and row length, on this machine's JAX
backend. Reports the mean time of a call after a warm-up and XLA's temporaries of the compiled
function (its memory for intermediates: the [T, T] score blocks for the reference).

    python scripts/bench_attention.py --lengths 384,1024,2048,4096 --batch 4 --heads 12
    python scripts/bench_attention.py --implementations cudnn,flash --dtype bfloat16  # on a GPU

One JSON line per (implementation, length) and a table; docs/benchmarks.md records the results.
"""

from __future__ import annotations

import argparse
import json
import time


def measure(
    implementation: str,
    batch: int,
    length: int,
    heads: int,
    dim: int,
    repeats: int,
    dtype: str = "float32",
):
    import jax
    import jax.numpy as jnp

    from dpojax.models.attention import attend, rows
    from dpojax.models.attention.rule import TokenIds

    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (batch, length, heads, dim), dtype) for key in keys)
    ids = TokenIds.of(batch, length)
    scale = dim**-0.5

    def loss(q, k, v):
        r = rows(implementation, ids, None)
        return attend(r, q, k, v, scale=scale, sliding=False).astype(jnp.float32).sum()

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    compiled = grad.lower(q, k, v).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(compiled(q, k, v))  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(compiled(q, k, v))
    seconds = (time.perf_counter() - t0) / repeats
    return {
        "implementation": implementation,
        "batch": batch,
        "length": length,
        "heads": heads,
        "head_dim": dim,
        "dtype": dtype,
        "ms_per_call": 1e3 * seconds,
        "temp_gb": temp / 1e9,
        "backend": jax.default_backend(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="384,1024,2048,4096")
    parser.add_argument("--implementations", default="reference,flash")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="bfloat16 for cudnn")
    args = parser.parse_args()
    results = []
    for length in (int(x) for x in args.lengths.split(",")):
        for impl in args.implementations.split(","):
            r = measure(
                impl, args.batch, length, args.heads, args.head_dim, args.repeats, args.dtype
            )
            results.append(r)
            print(json.dumps(r), flush=True)
    print("\n| length | implementation | ms / call | XLA temporaries GB |")
    print("|---:|---|---:|---:|")
    for r in results:
        row = (r["length"], r["implementation"], f"{r['ms_per_call']:.0f}", f"{r['temp_gb']:.3f}")
        print("| " + " | ".join(str(x) for x in row) + " |")


if __name__ == "__main__":
    main()
