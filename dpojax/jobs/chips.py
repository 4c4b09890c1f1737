"""Published peak figures of accelerator chips, for the plan's roofline bounds.

Per chip (a TPU chip is one JAX device in these topologies; a GPU is one device): dense bf16
matmul FLOP/s, HBM bandwidth in bytes/s and HBM capacity in bytes. Sources, as published by the
vendors (checked 2026-11):

- TPU v4: 275 TFLOP/s bf16, 1,228 GB/s, 32 GiB — cloud.google.com/tpu/docs/v4
- TPU v5e: 197 TFLOP/s bf16, 819 GB/s, 16 GiB — cloud.google.com/tpu/docs/v5e
- TPU v5p: 459 TFLOP/s bf16, 2,765 GB/s, 95 GiB — cloud.google.com/tpu/docs/v5p
- TPU v6e (Trillium): 918 TFLOP/s bf16, 1,640 GB/s, 32 GiB — cloud.google.com/tpu/docs/v6e
- NVIDIA A100 80GB SXM: 312 TFLOP/s bf16 dense, 2,039 GB/s, 80 GB —
  nvidia.com/en-us/data-center/a100/ (datasheet)
- NVIDIA H100 SXM: 989 TFLOP/s bf16 dense (1,979 with sparsity), 3.35 TB/s, 80 GB —
  nvidia.com/en-us/data-center/h100/ (datasheet)
- NVIDIA H200 SXM: 989 TFLOP/s bf16 dense, 4.8 TB/s, 141 GB — nvidia.com/en-us/data-center/h200/

The memory XLA can use is a little less than the capacity (the TPU compiler reports 15.75 GiB of
v5e's 16 GiB as available), so `fits` compares with the capacity less `RESERVED_FRACTION`.
"""

from __future__ import annotations

import dataclasses

GiB = 2**30
RESERVED_FRACTION = 0.02  # runtime reservations: 0.25 GiB of v5e's 16 GiB


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    bf16_flops: float
    hbm_bandwidth: float
    hbm_bytes: float

    @property
    def usable_bytes(self) -> float:
        return self.hbm_bytes * (1 - RESERVED_FRACTION)


CHIPS = {
    "v4": Chip("TPU v4", 275e12, 1228e9, 32 * GiB),
    "v5e": Chip("TPU v5e", 197e12, 819e9, 16 * GiB),
    "v5p": Chip("TPU v5p", 459e12, 2765e9, 95 * GiB),
    "v6e": Chip("TPU v6e", 918e12, 1640e9, 32 * GiB),
    "a100": Chip("NVIDIA A100 80GB", 312e12, 2039e9, 80e9),
    "h100": Chip("NVIDIA H100", 989e12, 3.35e12, 80e9),
    "h200": Chip("NVIDIA H200", 989e12, 4.8e12, 141e9),
}

# JAX device_kind strings -> chip keys (checked in order; the first match wins).
_DEVICE_KINDS = (
    ("v5 lite", "v5e"),
    ("v5e", "v5e"),
    ("v6 lite", "v6e"),
    ("v6e", "v6e"),
    ("v5p", "v5p"),
    ("v5", "v5p"),
    ("v4", "v4"),
    ("h200", "h200"),
    ("h100", "h100"),
    ("a100", "a100"),
)


def chip_for(name: str) -> Chip | None:
    """The chip of a topology prefix ("v5e") or a JAX `device_kind` ("TPU v5 lite",
    "NVIDIA H100 80GB HBM3"); None when unknown (e.g. a CPU)."""
    key = name.strip().lower()
    if key in CHIPS:
        return CHIPS[key]
    for fragment, chip in _DEVICE_KINDS:
        if fragment in key:
            return CHIPS[chip]
    return None
