"""NVIDIA GPUs for ahead-of-time compilation on a host without one (`plan.target = "gpu:h100:8"`).

JAX's CUDA plugin (the `gpu-plan` extra: jax-cuda12-plugin, jax-cuda12-pjrt, and ptxas from
nvidia-cuda-nvcc-cu12) compiles for a GPU described by XLA's `GpuTargetConfigProto` instead of a
present device: `jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=<text proto>, topology="1x<hosts>x<gpus per host>")` returns compile-only devices.

The proto's fields are the device's published properties. Sources: the NVIDIA CUDA C++
Programming Guide's "Compute Capabilities" tables (threads per block and per SM, warp size,
shared memory per block / per SM / opt-in per block, registers per SM and per block, grid
limits — per compute capability 7.5, 8.0, 8.9, 9.0 and 10.0); the NVIDIA A100 (80 and 40 GB),
H100, H200, HGX B200, L4 and T4 datasheets and the NVIDIA Turing (TU104), Ampere (GA100), Ada
(AD104), Hopper (GH100) and Blackwell architecture whitepapers (SM count, FP32 units per SM,
boost clock, L2 cache, memory size and bandwidth). The H100 SXM
memory size is the bytes the CUDA runtime reports for an 80 GB part (cudaDeviceProp
totalGlobalMem); the others use the datasheet's capacity. The cuDNN (9.8) and CUDA runtime (12.9)
versions are those of the CUDA 12 wheels the extra installs.

Caveats of such a compile (docs/plan.md#gpu-plans): XLA's cost analysis is not available, an
over-memory program is not refused (fit is judged from the memory figures), there is no
autotuning (no timing can be read from it), and cuDNN graphs are not built.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re

from dpojax.hardware.chips import CHIPS, Chip


class GpuTargetError(ValueError):
    """An unknown GPU, a bad device count, or the gpu-plan extra missing."""


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    device_kind: str  # the CUDA device name JAX reports as device_kind
    compute_capability: tuple[int, int]
    sm_count: int
    fp32_per_sm: int
    boost_clock_ghz: float
    l2_bytes: int
    memory_bytes: int
    memory_bandwidth: float
    shared_per_sm: int  # bytes
    shared_per_block_optin: int  # bytes
    threads_per_sm: int = 2048  # 1,536 on compute capability 8.6 / 8.9, 1,024 on 7.5


# Per compute capability (CUDA C++ Programming Guide, "Technical Specifications per Compute
# Capability"): 1,024 threads per block, 32 per warp, 64 K 32-bit registers per SM and per block,
# 48 KiB static shared memory per block, grid 2^31-1 x 65,535 x 65,535; threads per SM 2,048 (8.0,
# 9.0, 10.0), 1,536 (8.9), 1,024 (7.5); shared memory per SM / opt-in per block 164 / 163 KiB
# (8.0), 100 / 99 KiB (8.9), 64 / 64 KiB (7.5), 228 / 227 KiB (9.0, 10.0).
SPECS = {
    "a100": GpuSpec(
        "NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 1.41, 40 * 2**20, 80 * 10**9, 2039e9,
        167936, 166912,
    ),
    "a100-40gb": GpuSpec(
        "NVIDIA A100-SXM4-40GB", (8, 0), 108, 64, 1.41, 40 * 2**20, 40 * 10**9, 1555e9,
        167936, 166912,
    ),
    "l4": GpuSpec(
        "NVIDIA L4", (8, 9), 58, 128, 2.04, 48 * 2**20, 24 * 10**9, 300e9,
        102400, 101376, 1536,
    ),
    "t4": GpuSpec(
        "Tesla T4", (7, 5), 40, 64, 1.59, 4 * 2**20, 16 * 10**9, 320e9,
        65536, 65536, 1024,
    ),
    "h100": GpuSpec(
        "NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 1.98, 50 * 2**20, 84929347584, 3.35e12,
        233472, 232448,
    ),
    "h100-pcie": GpuSpec(
        "NVIDIA H100 PCIe", (9, 0), 114, 128, 1.755, 50 * 2**20, 80 * 10**9, 2.0e12,
        233472, 232448,
    ),
    "h100-nvl": GpuSpec(
        "NVIDIA H100 NVL", (9, 0), 132, 128, 1.785, 50 * 2**20, 94 * 10**9, 3.9e12,
        233472, 232448,
    ),
    "h200": GpuSpec(
        "NVIDIA H200", (9, 0), 132, 128, 1.98, 50 * 2**20, 141 * 10**9, 4.8e12,
        233472, 232448,
    ),
    "b200": GpuSpec(
        "NVIDIA B200", (10, 0), 148, 128, 1.965, 126 * 2**20, 180 * 10**9, 7.7e12,
        233472, 232448,
    ),
}  # fmt: skip


def target_config(spec: GpuSpec) -> str:
    """The `GpuTargetConfigProto` text of `spec`."""
    major, minor = spec.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {spec.shared_per_sm}
  threads_per_core_limit: {spec.threads_per_sm}
  core_count: {spec.sm_count}
  fpus_per_core: {spec.fp32_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(spec.memory_bandwidth)}
  l2_cache_size: {spec.l2_bytes}
  clock_rate_ghz: {spec.boost_clock_ghz}
  device_memory_size: {spec.memory_bytes}
  shared_memory_per_block_optin: {spec.shared_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 9 }}
device_description_str: "{spec.device_kind}"
"""


def parse(spec: str) -> tuple[str, int, int]:
    """'gpu:h100:8' -> ("h100", 1 host, 8 GPUs per host); 'gpu:h100:2x8' -> ("h100", 2, 8)."""
    found = re.fullmatch(r"gpu:([\w\-]+):(?:(\d+)x)?(\d+)", spec.strip())
    if not found or found.group(1).lower() not in SPECS:
        raise GpuTargetError(
            f"plan.target {spec!r}: use gpu:<chip>:<gpus> or gpu:<chip>:<hosts>x<gpus per host> "
            f"with a chip among {sorted(SPECS)}, e.g. gpu:h100:8 or gpu:h100:2x8"
        )
    hosts, per_host = int(found.group(2) or 1), int(found.group(3))
    if hosts < 1 or not 1 <= per_host <= 8:
        raise GpuTargetError(
            f"plan.target {spec!r}: 1 to 8 GPUs per host (an HGX board holds 8), at least one host"
        )
    return found.group(1).lower(), hosts, per_host


def plugin_installed() -> bool:
    """Whether JAX's CUDA plugin (the gpu-plan extra) is importable."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ImportError:  # no jax_plugins namespace at all
        return False


def devices(spec: str) -> tuple[list, Chip]:
    """(the compile-only devices of `spec`, its chip figures); raises GpuTargetError."""
    name, hosts, per_host = parse(spec)
    if not plugin_installed():
        raise GpuTargetError(
            f"plan.target={spec} needs JAX's CUDA plugin (XLA's GPU compiler) on this host: "
            "pip install -e '.[gpu-plan]' (no GPU needed; run with JAX_PLATFORMS=cpu)"
        )
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(
            platform="cuda",
            target_config=target_config(SPECS[name]),
            topology=f"1x{hosts}x{per_host}",
        )
    except Exception as e:  # the plugin raises its own runtime error types
        raise GpuTargetError(f"plan.target {spec!r}: JAX's CUDA plugin refused it ({e})") from None
    return list(desc.devices), CHIPS[name]
