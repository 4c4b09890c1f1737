"""Published peak figures of accelerator chips, for the plan's roofline bounds and fit.

Per chip (a TPU chip is one JAX device in these topologies; a GPU is one device): dense bf16
matmul FLOP/s, HBM bandwidth and capacity, and the interconnect bandwidth one device has to its
peers (TPU ICI, NVIDIA NVLink or PCIe) and across hosts (DCN: the data-center network). Sources,
as published by the vendors (checked 2026-11):

- TPU v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1,200 GB/s, ICI 2,400 Gbps per chip —
  Google Cloud TPU documentation, "TPU v4" system architecture page
- TPU v5e: 197 TFLOP/s bf16, 16 GiB at 819 GB/s, ICI 1,600 Gbps — Cloud TPU docs, "TPU v5e"
- TPU v5p: 459 TFLOP/s bf16, 95 GiB at 2,765 GB/s, ICI 4,800 Gbps — Cloud TPU docs, "TPU v5p"
- TPU v6e (Trillium): 918 TFLOP/s bf16, 32 GiB at 1,640 GB/s, ICI 3,584 Gbps — Cloud TPU docs,
  "TPU v6e"
- TPU7x (Ironwood): 2,307 TFLOP/s bf16, 192 GiB at 7,380 GB/s, ICI 1.2 TB/s bidirectional —
  Cloud TPU docs, "TPU7x (Ironwood)"
- NVIDIA A100 80GB SXM: 312 TFLOP/s bf16 dense, 2,039 GB/s, 80 GB, NVLink 3 600 GB/s —
  NVIDIA A100 Tensor Core GPU datasheet
- NVIDIA A100 40GB SXM: 312 TFLOP/s bf16 dense, 1,555 GB/s, 40 GB, NVLink 3 600 GB/s — the same
  datasheet
- NVIDIA L4: 121 TFLOP/s bf16 dense (242 with sparsity), 24 GB GDDR6 at 300 GB/s, PCIe Gen4 x16
  64 GB/s — NVIDIA L4 Tensor Core GPU datasheet
- NVIDIA T4: no bfloat16 (Turing's tensor cores take float16): 65 TFLOP/s float16 mixed
  precision (8.1 float32), 16 GB GDDR6 at 320 GB/s, PCIe Gen3 x16 32 GB/s — NVIDIA T4 Tensor
  Core GPU datasheet. Its `bf16_flops` holds the float16 figure and `half_dtype` says float16: the
  plan and a run with `model.dtype=auto` compute in float16 there; cuDNN's fused attention needs
  Ampere (compute capability 8.0) or later, so `model.attention=auto` is flash there.
- NVIDIA H100 SXM: 989 TFLOP/s bf16 dense (1,979 with sparsity), 80 GB at 3.35 TB/s, NVLink 4
  900 GB/s — NVIDIA H100 Tensor Core GPU datasheet
- NVIDIA H100 PCIe: 756 TFLOP/s bf16 dense, 80 GB at 2.0 TB/s, PCIe Gen5 128 GB/s (NVLink bridge
  600 GB/s where fitted; not assumed) — the same datasheet
- NVIDIA H100 NVL: 835 TFLOP/s bf16 dense, 94 GB at 3.9 TB/s, NVLink bridge 600 GB/s — the same
  datasheet
- NVIDIA H200 SXM: 989 TFLOP/s bf16 dense, 141 GB at 4.8 TB/s, NVLink 900 GB/s — NVIDIA H200
  Tensor Core GPU datasheet
- NVIDIA B200 (HGX B200): 2.25 PFLOP/s bf16 dense (4.5 with sparsity), 180 GB at 7.7 TB/s,
  NVLink 5 1.8 TB/s — NVIDIA HGX B200 datasheet (per-GPU share of the 8-GPU board's figures)
- DCN for GPU hosts: one 400 Gb/s NIC per GPU (NVIDIA DGX H100 / DGX B200 system specifications:
  8x ConnectX-7 400 Gb/s), 50 GB/s per GPU each way.

Interconnect figures are published as the sum of both directions (NVLink's 900 GB/s is 450 GB/s
each way); `link_bandwidth` is one direction, what a ring collective's bytes travel at.

The memory XLA can use on a TPU is a little less than the capacity (the TPU compiler reports
15.75 GiB of v5e's 16 GiB as available): `usable_bytes` is the capacity less `RESERVED_FRACTION`.
On a GPU, JAX's allocator takes a fraction of the memory (`gpu_memory_fraction`).
"""

from __future__ import annotations

import dataclasses
import os

GiB = 2**30
RESERVED_FRACTION = 0.02  # TPU runtime reservations: 0.25 GiB of v5e's 16 GiB
DCN_GPU = 50e9  # 400 Gb/s per GPU, one direction


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    bf16_flops: float
    hbm_bandwidth: float
    hbm_bytes: float
    link_bandwidth: float = 0.0  # bytes/s one way, to the devices of the same host or slice
    dcn_bandwidth: float = 0.0  # bytes/s one way, to other hosts
    kind: str = "tpu"
    half_dtype: str = "bfloat16"  # the 16-bit dtype of its matmul peak (`bf16_flops`)
    fused_attention: bool = True  # a GPU that runs cuDNN's fused attention (Ampere and later)

    @property
    def usable_bytes(self) -> float:
        if self.kind == "gpu":
            return self.hbm_bytes * gpu_memory_fraction()[0]
        return self.hbm_bytes * (1 - RESERVED_FRACTION)


def _gbps(gigabits_per_second: float) -> float:
    """Bytes/s one way of a link published in Gbit/s for both directions."""
    return gigabits_per_second * 1e9 / 8 / 2


CHIPS = {
    "v4": Chip("TPU v4", 275e12, 1200e9, 32 * GiB, _gbps(2400)),
    "v5e": Chip("TPU v5e", 197e12, 819e9, 16 * GiB, _gbps(1600)),
    "v5p": Chip("TPU v5p", 459e12, 2765e9, 95 * GiB, _gbps(4800)),
    "v6e": Chip("TPU v6e", 918e12, 1640e9, 32 * GiB, _gbps(3584)),
    "tpu7x": Chip("TPU7x", 2307e12, 7380e9, 192 * GiB, 1.2e12 / 2),
    "a100": Chip("NVIDIA A100 80GB SXM", 312e12, 2039e9, 80e9, 300e9, DCN_GPU, "gpu"),
    "a100-40gb": Chip("NVIDIA A100 40GB SXM", 312e12, 1555e9, 40e9, 300e9, DCN_GPU, "gpu"),
    "l4": Chip("NVIDIA L4", 121e12, 300e9, 24e9, 32e9, DCN_GPU, "gpu"),
    "t4": Chip("NVIDIA T4", 65e12, 320e9, 16e9, 16e9, DCN_GPU, "gpu", "float16", False),
    "h100": Chip("NVIDIA H100 SXM", 989e12, 3.35e12, 80e9, 450e9, DCN_GPU, "gpu"),
    "h100-pcie": Chip("NVIDIA H100 PCIe", 756e12, 2.0e12, 80e9, 64e9, DCN_GPU, "gpu"),
    "h100-nvl": Chip("NVIDIA H100 NVL", 835e12, 3.9e12, 94e9, 300e9, DCN_GPU, "gpu"),
    "h200": Chip("NVIDIA H200 SXM", 989e12, 4.8e12, 141e9, 450e9, DCN_GPU, "gpu"),
    "b200": Chip("NVIDIA B200", 2250e12, 7.7e12, 180e9, 900e9, DCN_GPU, "gpu"),
}

# JAX `device_kind` strings (the CUDA device name; the TPU runtime's chip name) -> chip keys,
# matched exactly: "NVIDIA H100 PCIe" must not get the SXM figures.
DEVICE_KINDS = {
    "TPU v4": "v4",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
    "TPU7x": "tpu7x",
    "NVIDIA A100-SXM4-80GB": "a100",
    "NVIDIA A100 80GB SXM": "a100",
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA L4": "l4",
    "Tesla T4": "t4",
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA H100 SXM": "h100",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA H200": "h200",
    "NVIDIA H200 SXM": "h200",
    "NVIDIA B200": "b200",
}


def chip_for(name: str) -> Chip | None:
    """The chip of a table key ("v5e", "h100-pcie") or of an exact JAX `device_kind` ("TPU v5
    lite", "NVIDIA H100 80GB HBM3"); None when unknown (a CPU, or a kind not in the table)."""
    key = name.strip()
    if key.lower() in CHIPS:
        return CHIPS[key.lower()]
    chip = DEVICE_KINDS.get(key)
    return CHIPS[chip] if chip else None


def gpu_memory_fraction(env: dict | None = None) -> tuple[float, str]:
    """(the share of a GPU's memory JAX's allocator may use, why): XLA_PYTHON_CLIENT_MEM_FRACTION
    when set; all of it with XLA_PYTHON_CLIENT_ALLOCATOR=platform (no pool: cudaMalloc per
    buffer); JAX's default of 75% otherwise. XLA_PYTHON_CLIENT_PREALLOCATE=false only makes the
    pool grow on demand: its limit is still the fraction."""
    env = os.environ if env is None else env
    fraction = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if fraction:
        try:
            value = float(fraction)
        except ValueError:
            raise ValueError(
                f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction!r} is not a number; set it to a "
                "fraction such as 0.9"
            ) from None
        if not 0 < value <= 1:
            raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction!r} must be in (0, 1]")
        return value, f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction}"
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return 1.0, "XLA_PYTHON_CLIENT_ALLOCATOR=platform"
    grows = env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0")
    return 0.75, "JAX's default memory fraction (75%" + (", grown on demand)" if grows else ")")
