"""Compiles the attention core alone (one layer's forward + gradient of the sum of its output,
bf16, the rows sharded over the GPUs) deviceless for NVIDIA GPUs with JAX's CUDA plugin: no GPU
needed. For flash's CPU variant (blocks skipped with `cond`, bounds that depend on the loop
index), the static one that a GPU runs, and cuDNN's fused attention on padded rows (needs
cuDNN: the gpu-plan extra), reports the compiled HLO's while loops (and how many have a known
trip count), conditionals, all-reduces of a predicate (a "block masked?" decision taken over
the global batch), cuDNN fused-attention calls and XLA's temporaries per device (cuDNN's own
workspace is not in them: its graphs are not built without a device).

    JAX_PLATFORMS=cpu python scripts/compile_attention_gpu.py --target gpu:h100:8 --length 2048
"""

from __future__ import annotations

import argparse
import json
import re
import time


def census(compiled) -> dict:
    text = compiled.as_text()
    loops = re.findall(r"= .*\bwhile\(.*", text)
    return {
        "while_loops": len(loops),
        "known_trip_count": sum("known_trip_count" in w for w in loops),
        "conditionals": text.count(" conditional("),
        "predicate_all_reduces": len(re.findall(r"pred\[\][^\n]*all-reduce(-start)?\(", text)),
        "cudnn_calls": len(re.findall(r'custom_call_target="__cudnn\$fmha', text)),
        "temp_mib": round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="gpu:h100:8")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from dpojax.hardware import gpu_targets
    from dpojax.models.attention.cudnn import cudnn_attention
    from dpojax.models.attention.flash import flash_attention
    from dpojax.models.attention.rule import TokenIds

    devices, _ = gpu_targets.devices(args.target)
    per_row = NamedSharding(Mesh(np.array(devices), ("data",)), PartitionSpec("data"))
    b, t, d = len(devices), args.length, args.head_dim
    shapes = [(b, t, args.heads, d), (b, t, args.kv_heads, d), (b, t, args.kv_heads, d)]
    inputs = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=per_row) for s in shapes]
    inputs += [jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=per_row)] * 3
    kernels = {
        "flash (cpu variant)": lambda q, k, v, ids: flash_attention(q, k, v, ids, scale=d**-0.5),
        "flash (static, gpu)": lambda q, k, v, ids: flash_attention(
            q, k, v, ids, scale=d**-0.5, static=True
        ),
        "cudnn": lambda q, k, v, ids: cudnn_attention(q, k, v, ids, scale=d**-0.5),
    }
    for name, kernel in kernels.items():

        def loss(q, k, v, seg, part, pos, kernel=kernel):
            return kernel(q, k, v, TokenIds(seg, part, pos)).astype(jnp.float32).sum()

        start = time.perf_counter()
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*inputs).compile()
        seconds = round(time.perf_counter() - start, 1)
        row = {"target": args.target, "length": t, "kernel": name, "compile_seconds": seconds}
        print(json.dumps(row | census(compiled)), flush=True)


if __name__ == "__main__":
    main()
