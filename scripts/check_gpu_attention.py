"""On a GPU: do cuDNN's fused attention and the flash path give the reference's log-probs?

    python scripts/check_gpu_attention.py            # on an NVIDIA GPU (cuDNN needs one)
    python scripts/check_gpu_attention.py --cpu      # flash and reference only (checks the script)

A random Llama with Llama 3.2 1B's attention shape (32 query / 8 KV heads of 64, 2 layers,
hidden 2048, vocabulary 8192), bf16 compute, padded rows of pairs with varied prompt and answer
lengths. For each implementation: the logits at the real tokens and the per-sequence sums of the
answer tokens' log-probs (what DPO's loss sees), against a float32 run of the reference attention
on the same weights, as ||out - ref|| / ||ref|| and the largest absolute log-prob difference; and
the same for bf16 reference attention, which is the error a bf16 run has anyway. The last line is
one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs without an install


def _pairs(rng, n: int, prompt_max: int, answer_max: int, vocab: int):
    from dpojax.data.tokenize import TokenizedPair

    out = []
    for i in range(n):
        prompt = rng.integers(4, vocab, size=rng.integers(prompt_max // 4, prompt_max))
        chosen = rng.integers(4, vocab, size=rng.integers(2, answer_max))
        rejected = rng.integers(4, vocab, size=rng.integers(2, answer_max))
        out.append(
            TokenizedPair(
                prompt_ids=prompt.astype("int32"),
                chosen_ids=chosen.astype("int32"),
                rejected_ids=rejected.astype("int32"),
                chosen_prompt_len=len(prompt),
                rejected_prompt_len=len(prompt),
                pair_id=i,
                group=i,
            )
        )
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--length", type=int, default=1024, help="row length (tokens)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dpojax.data.layouts import Buckets, build_batch
    from dpojax.models.model_config import ModelConfig
    from dpojax.models.transformer import init_model

    platform = jax.devices()[0].platform
    base = ModelConfig(
        vocab_size=8192, hidden_size=2048, intermediate_size=4096, num_layers=2, num_heads=32,
        num_kv_heads=8, head_dim=64, rope_theta=500000.0, max_position_embeddings=4 * args.length,
        target_platform=platform, row_layout="padded",
    )  # fmt: skip
    rng = np.random.default_rng(args.seed)
    pairs = _pairs(rng, args.pairs, args.length // 2, args.length // 2 - 1, base.vocab_size)
    batch = build_batch(pairs, args.pairs, "padded", Buckets(lengths=(args.length,)))
    ids = {k: jnp.asarray(batch[k]) for k in ("positions", "segment_ids", "parts")}
    tokens = jnp.asarray(batch["tokens"])
    real = np.asarray(batch["segment_ids"]) != 0
    scored = jnp.asarray(batch["completion_ids"]) >= 0  # the answers' tokens (and EOS)
    pred = jnp.asarray(np.maximum(batch["pred_index"], 0))  # the position that predicts each
    weights = nnx.state(init_model(base, seed=args.seed))

    def run(attention: str, dtype: str):
        model = init_model(base.replace(attention=attention, dtype=dtype), seed=args.seed)
        nnx.update(model, weights)  # the same weights for every run
        logits = nnx.jit(lambda m, t, a: m(t, **a))(model, tokens, ids).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        at_pred = jnp.take_along_axis(logp, pred[..., None], axis=1)  # [R, L, V]
        token_logp = jnp.take_along_axis(at_pred, tokens[..., None], axis=-1)[..., 0]
        sums = np.asarray(jnp.sum(jnp.where(scored, token_logp, 0.0), axis=-1))
        return np.asarray(logits)[real], sums

    with jax.default_matmul_precision("highest"):
        ref_logits, ref_sums = run("reference", "float32")
    rows = []
    impls = ["reference", "flash"] + ([] if args.cpu else ["cudnn"])
    for impl in impls:
        logits, sums = run(impl, "bfloat16")
        rows.append(
            dict(
                attention=impl,
                dtype="bfloat16",
                logits_rel_error=float(
                    np.linalg.norm(logits - ref_logits) / np.linalg.norm(ref_logits)
                ),
                seq_logp_max_abs_diff=float(np.max(np.abs(sums - ref_sums))),
                seq_logp_ref_mean_abs=float(np.mean(np.abs(ref_sums))),
                nan=bool(np.isnan(logits).any()),
            )
        )
    print(
        f"{platform} ({jax.devices()[0].device_kind}), {args.pairs} pairs in "
        f"{2 * args.pairs} rows of {args.length}; against float32 reference attention:"
    )
    for r in rows:
        print(
            f"  {r['attention']:>9} bf16: logits rel. error {r['logits_rel_error']:.2e}, "
            f"sequence log-prob max |diff| {r['seq_logp_max_abs_diff']:.3f} "
            f"(mean |log-prob| {r['seq_logp_ref_mean_abs']:.1f})"
        )
    print(json.dumps({"platform": platform, "device": jax.devices()[0].device_kind, "rows": rows}))


if __name__ == "__main__":
    main()
