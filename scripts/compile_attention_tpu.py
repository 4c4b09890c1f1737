"""Compiles the Pallas attention kernels alone (one layer's forward + gradient of the sum of its
output, bf16, one causal sequence per row) ahead of time for a TPU topology with libtpu, on this
host: no TPU needed. Reports per row length whether Mosaic/XLA compiled it (or ran out of VMEM
or memory), the compile time and XLA's temporaries of the compiled function.

    python scripts/compile_attention_tpu.py --topology v5e:2x2 --lengths 2048,16384,32768

One JSON line per length; docs/benchmarks.md records the results. `--block 0` (the default)
uses the generation's block (`dpojax.models.attention.pallas.BLOCKS`); give a block to run the
script against an earlier commit's kernels.
"""

from __future__ import annotations

import argparse
import json
import time


def compile_one(devices, generation: str, length: int, args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from dpojax.models.attention import pallas
    from dpojax.models.attention.rule import TokenIds

    one = NamedSharding(Mesh(np.array(devices[:1]), ("x",)), PartitionSpec())
    block = args.block or pallas.chip_block(generation)  # --block: also for earlier commits
    b, h, kv, d = args.batch, args.heads, args.kv_heads, args.head_dim

    def loss(q, k, v, seg, part, pos):
        ids = TokenIds(seg, part, pos)
        out = pallas.pallas_attention(q, k, v, ids, scale=d**-0.5, block=block, interpret=False)
        return out.astype(jnp.float32).sum()

    shapes = [(b, length, h, d), (b, length, kv, d), (b, length, kv, d)]
    inputs = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=one) for s in shapes]
    inputs += [jax.ShapeDtypeStruct((b, length), jnp.int32, sharding=one)] * 3
    row = {"topology": args.topology, "length": length, "block": block}
    start = time.perf_counter()
    try:
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*inputs).compile()
    except Exception as e:  # libtpu's own error types: out of VMEM, out of memory
        return row | {"compiled": False, "error": str(e).splitlines()[0][:200]}
    temp = compiled.memory_analysis().temp_size_in_bytes
    seconds = round(time.perf_counter() - start, 1)
    return row | {"compiled": True, "compile_seconds": seconds, "temp_mib": round(temp / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="v5e:2x2")
    parser.add_argument("--lengths", default="2048,16384,32768")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=0)
    args = parser.parse_args()

    from jax.experimental import topologies

    from dpojax.runtime import prepare_tpu_compile_host

    prepare_tpu_compile_host(args.topology)
    generation = args.topology.split(":")[0]
    kwargs = {"chip_config_name": "megacore"} if generation in ("v4", "v5p") else {}
    devices = topologies.get_topology_desc(args.topology, "tpu", **kwargs).devices
    for length in (int(x) for x in args.lengths.split(",")):
        print(json.dumps(compile_one(devices, generation, length, args)), flush=True)


if __name__ == "__main__":
    main()
