"""Subprocess for tests/unit/train/test_checkpoint.py: one of 2 processes (2 CPU devices each, one
mesh over the 4) that save a checkpoint whose arrays are sharded over the processes, then, after
process 0 overwrote bytes inside the largest data file of that checkpoint, restore it.

    python tests/helpers/checkpoint_processes.py DIR PORT PROCESS_ID

Prints one JSON line: {"format": <the saved record's format>, "shards": <its number of shard
checksums>, "seal_s": [<seconds of two seals: the first compiles the exchange>, ...],
"refused": <the restore's CheckpointCorrupt message, or null when it restored>}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from tests.helpers.processes import join  # noqa: E402


def _global(value: np.ndarray, sharding) -> jax.Array:
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _overwrite_inside(step_dir: Path, size: int = 64) -> Path:
    """Random bytes over `size` bytes in the middle of the largest file under `step_dir`/state."""
    data = max(
        (f for f in (step_dir / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size
    )
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + size] = np.random.default_rng(0).bytes(size)
    data.write_bytes(bytes(raw))
    return data


def main(directory: str, port: int, process_id: int) -> None:
    join(port, process_id)
    from dpojax.train import hosts, integrity
    from dpojax.train.checkpoint import CheckpointCorrupt, Checkpointer
    from dpojax.train.state import TrainState

    mesh = jax.make_mesh((2, 2), ("data", "fsdp"))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 128)).astype(np.float32)  # over all 4 devices: 2 per process
    b = rng.standard_normal(64).astype(np.float32)  # over fsdp, replicated over data
    state = TrainState(
        step=_global(np.int32(3), NamedSharding(mesh, PartitionSpec())),
        params={
            "w": _global(w, NamedSharding(mesh, PartitionSpec(("data", "fsdp")))),
            "b": _global(b, NamedSharding(mesh, PartitionSpec("fsdp"))),
        },
        frozen={},
        ref=None,
        opt_state=(),
    )
    flat = {("step",): state.step, **{("params", k): v for k, v in state.params.items()}}
    seal_s = []
    for _ in range(2):  # the first one compiles the exchange
        start = time.perf_counter()
        integrity.seal({}, flat)
        seal_s.append(round(time.perf_counter() - start, 4))
    with Checkpointer(directory, async_save=False) as ckpt:
        ckpt.save(1, state, extra={"n": 1})
    record = json.loads((Path(directory) / "1" / "extra" / "metadata").read_text())["integrity"]
    shards = sum(len(v) for v in record["shards"].values()) if record.get("shards") else 0
    if process_id == 0:
        _overwrite_inside(Path(directory) / "1")
    hosts.barrier("damaged")
    refused = None
    try:
        Checkpointer(directory).restore(state)
    except CheckpointCorrupt as e:
        refused = str(e)
    hosts.barrier("restored")
    print(
        json.dumps(
            {"format": record["format"], "shards": shards, "seal_s": seal_s, "refused": refused}
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
