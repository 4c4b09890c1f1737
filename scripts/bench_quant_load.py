"""Peak host memory of a quantized load: a checkpoint quantized tensor by tensor as it is read.

    python scripts/bench_quant_load.py                       # ~1.2B llama, nf4 and int8
    python scripts/bench_quant_load.py --layers 4 --vocab 32000 --schemes nf4
    python scripts/bench_quant_load.py --after               # also the old way, for contrast

Writes a random llama-style HF checkpoint (bfloat16 safetensors in several files with an index;
by default Llama 3.2 1B's shapes: hidden 2048, 16 layers, MLP 8192, 32 / 8 heads, vocabulary
128256, tied embeddings) to a temporary folder, then loads it once per scheme in a fresh
process with `from_pretrained(..., quantization=scheme)` on the CPU and reports that process's
peak resident memory (`ru_maxrss`; VmHWM as well) against its resident memory after the imports and JAX's start
(the baseline), the loaded model's bytes (codes, scales, and the embeddings and norms in
`--param-dtype`) and one decoder layer's bytes in the checkpoint. The goal: peak <= baseline +
quantized model + 2 layers. `--after` adds a load of the float model quantized afterwards
(`quantize_model`), as loads went before. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIB = 1024**2
if str(HERE) not in sys.path:  # the bench package beside this file (also when loaded by path)
    sys.path.insert(0, str(HERE))
from bench.children import child_json, run_child_role  # noqa: E402


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--schemes", default="nf4,int8")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--param-dtype", default="bfloat16")
    p.add_argument("--shard-mib", type=int, default=512, help="checkpoint file size")
    p.add_argument("--after", action="store_true", help="also load the float model, then quantize")
    p.add_argument("--dir", help="write the checkpoint here (default: a temporary folder)")
    p.add_argument("--worker", nargs=2, metavar=("DIR", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--write-only", metavar="DIR", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _layer_tensors(args, i: int) -> dict[str, tuple[int, ...]]:
    """HF name -> shape ([out, in]) of decoder layer `i`'s tensors."""
    d, head = args.hidden, args.hidden // args.heads
    kv = args.kv_heads * head
    pre = f"model.layers.{i}."
    return {
        pre + "self_attn.q_proj.weight": (d, d),
        pre + "self_attn.k_proj.weight": (kv, d),
        pre + "self_attn.v_proj.weight": (kv, d),
        pre + "self_attn.o_proj.weight": (d, d),
        pre + "mlp.gate_proj.weight": (args.intermediate, d),
        pre + "mlp.up_proj.weight": (args.intermediate, d),
        pre + "mlp.down_proj.weight": (d, args.intermediate),
        pre + "input_layernorm.weight": (d,),
        pre + "post_attention_layernorm.weight": (d,),
    }


def _hf_config(args) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def write_checkpoint(args, path: Path) -> dict:
    """Random bfloat16 weights (normal, std 0.02; norms 1) in files of about --shard-mib MiB."""
    import ml_dtypes
    import numpy as np

    from dpojax.models.safetensors_io import save_tensors

    path.mkdir(parents=True, exist_ok=True)
    shapes = {"model.embed_tokens.weight": (args.vocab, args.hidden)}
    for i in range(args.layers):
        shapes.update(_layer_tensors(args, i))
    shapes["model.norm.weight"] = (args.hidden,)
    rng = np.random.default_rng(0)
    files, shard, size, weight_map = [], {}, 0, {}
    for n, (name, shape) in enumerate(shapes.items()):
        if len(shape) == 1:
            arr = np.ones(shape, ml_dtypes.bfloat16)
        else:
            arr = (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        shard[name], size = arr, size + arr.nbytes
        if size >= args.shard_mib * MIB or n == len(shapes) - 1:
            files.append(f"model-{len(files) + 1:05d}.safetensors")
            save_tensors(shard, path / files[-1])
            weight_map.update(dict.fromkeys(shard, files[-1]))
            shard, size = {}, 0
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (path / "config.json").write_text(json.dumps(_hf_config(args), indent=1))
    layer = sum(int(np.prod(s)) * 2 for s in _layer_tensors(args, 0).values())
    return {"files": len(files), "params": sum(int(np.prod(s)) for s in shapes.values()),
            "bytes": sum(int(np.prod(s)) * 2 for s in shapes.values()), "layer_bytes": layer}  # fmt: skip


def _status_mib(field: str = "VmRSS") -> float:
    """A memory figure of this process from /proc/self/status (VmRSS now, VmHWM its peak)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def worker(path: str, mode: str, args) -> None:
    """One load in this process; prints a JSON line of its memory figures."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dpojax.models import from_pretrained, quantize_model

    jnp.zeros(1).block_until_ready()  # the backend started: part of the baseline
    baseline = _status_mib()
    start = time.perf_counter()
    scheme = mode.removesuffix("-after")
    kw = dict(param_dtype=args.param_dtype, tokenizer=False, scan_layers=False)
    if mode.endswith("-after"):
        model, _ = from_pretrained(path, **kw)
        model = quantize_model(model, scheme, args.block, free=True)
    else:
        model, _ = from_pretrained(path, quantization=scheme, quantization_block=args.block, **kw)
    leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - start
    out = {
        "mode": mode,
        "baseline_mib": round(baseline, 1),
        "peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "hwm_mib": round(_status_mib("VmHWM"), 1),
        "end_mib": round(_status_mib(), 1),
        "model_mib": round(sum(np.prod(x.shape) * x.dtype.itemsize for x in leaves) / MIB, 1),
        "load_s": round(seconds, 1),
    }
    print(json.dumps(out), flush=True)


def _child(argv: list[str], what: str) -> dict:
    """The last JSON line of this script run in a fresh process with `argv`. This process stays
    small (it imports no numpy or JAX): a child's ru_maxrss starts from its parent's resident
    memory at the fork, which a parent that wrote the checkpoint would have inflated."""
    return child_json(__file__, argv, what, {**os.environ, "JAX_PLATFORMS": "cpu"})


def _measure(path: Path, mode: str, argv: list[str], layer_mib: float) -> dict:
    out = _child([*argv, "--worker", str(path), mode], f"{mode}: the load")
    out["bound_mib"] = round(out["baseline_mib"] + out["model_mib"] + 2 * layer_mib, 1)
    out["over_baseline_mib"] = round(out["peak_mib"] - out["baseline_mib"], 1)
    out["extra_layers"] = round((out["peak_mib"] - out["bound_mib"]) / layer_mib + 2, 2)
    out["within_goal"] = out["peak_mib"] <= out["bound_mib"]
    print(json.dumps(out), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    if run_child_role(args, worker, write_checkpoint):
        return
    with tempfile.TemporaryDirectory(prefix="bench_quant_load_") as tmp:
        path = Path(args.dir or tmp) / "model"
        written = _child([*argv, "--write-only", str(path)], "writing the checkpoint")
        print(json.dumps({"checkpoint": written}), flush=True)
        layer_mib = written["layer_bytes"] / MIB
        modes = args.schemes.split(",")
        modes += [f"{modes[0]}-after"] if args.after else []
        runs = [_measure(path, mode, argv, layer_mib) for mode in modes]
    summary = {"checkpoint": written, "layer_mib": round(layer_mib, 1), "runs": runs}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
