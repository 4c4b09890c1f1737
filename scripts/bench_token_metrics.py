"""What TRL's token metrics (train.token_metrics: entropy, mean_token_accuracy, logits/chosen,
logits/rejected) cost: the policy's log-prob pass over the vocabulary (forward and backward of
`dpojax.train.logprobs.token_outputs`, the part of the step they add work to) timed with and
without them, on this machine's default device.

    python scripts/bench_token_metrics.py --tokens 2048 --dim 768 --vocab 32768 151936
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from dpojax.train.logprobs import token_outputs


def timed(fn, *args, repeats: int) -> float:
    """Median seconds of `fn(*args)` after one untimed (compiling) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def bench(tokens: int, dim: int, vocab: int, chunk: int, repeats: int) -> dict:
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    hidden = jax.random.normal(k1, (1, tokens, dim), jnp.float32)
    head = jax.random.normal(k2, (vocab, dim), jnp.float32) / dim**0.5
    targets = jax.random.randint(k3, (1, tokens), 0, vocab)
    pred = jnp.maximum(jnp.arange(tokens) - 1, 0)[None]
    row = {"tokens": tokens, "dim": dim, "vocab": vocab, "vocab_chunk": chunk}
    for stats in (False, True):

        def loss(h, w, stats=stats):
            out = token_outputs(h, w, targets, pred, vocab_chunk=chunk, with_stats=stats)
            metrics = out.stats.entropy.sum() + out.stats.is_top1.sum() if stats else 0.0
            return out.logps.sum(), metrics

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        row["with" if stats else "without"] = timed(step, hidden, head, repeats=repeats)
    row["overhead"] = row["with"] / row["without"] - 1.0
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="scored tokens in the pass")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768])
    parser.add_argument("--vocab-chunk", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}")
    for vocab in args.vocab:
        row = bench(args.tokens, args.dim, vocab, args.vocab_chunk, args.repeats)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
