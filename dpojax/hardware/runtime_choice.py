"""What a notebook runtime's accelerator calls for: the compute dtype, the attention kernel and
the batch, picked from JAX's `platform` and `device_kind` of its first device (a pure function,
so each kind is tested without the device).

- TPU: bfloat16, the Pallas kernel from v4 on (the kernels target v4 and later; v2 and v3, still
  offered by some Colab runtimes, take the pure-JAX flash attention);
- NVIDIA GPUs from Ampere on (A100, A10, L4, H100, H200, B200, RTX 30xx and later): bfloat16 and
  cuDNN's fused attention (the default `data.layout=padded` is the layout it takes);
- older NVIDIA GPUs (T4, V100, P100, ...): no fast bfloat16 and no cuDNN flash attention before
  Ampere, so float16 and the pure-JAX flash attention;
- CPU (and an unknown platform): float32 and the reference attention (the notebooks' rows are
  short; `model.attention=auto` takes flash from 512 tokens on).

The batch (pairs per optimizer step over all devices) must divide by the device count, since
every device takes an equal share: 8, rounded up to a multiple of the count (a v2-8 has 8).
"""

from __future__ import annotations

import dataclasses
import math

BASE_BATCH = 8
# Substrings of pre-Ampere NVIDIA device kinds ("Tesla T4", "Tesla V100-SXM2-16GB", ...).
_PRE_AMPERE = ("T4", "V100", "P100", "P40", "P4", "K80", "M60", "GTX", "RTX 20", "TITAN")
_OLD_TPUS = ("TPU v2", "TPU v3")


@dataclasses.dataclass(frozen=True)
class RuntimeChoice:
    platform: str
    device_kind: str
    device_count: int
    recipe: str  # which of the settings below: cpu, tpu, gpu-bf16, gpu-fp16
    dtype: str  # model.dtype
    attention: str  # model.attention
    batch_size: int  # train.batch_size
    reason: str

    def overrides(self) -> dict[str, object]:
        """The config keys it sets, for `api.config(source, overrides)`."""
        return {
            "model.dtype": self.dtype,
            "model.attention": self.attention,
            "train.batch_size": self.batch_size,
        }

    def describe(self) -> str:
        devices = f"{self.device_count} x {self.device_kind or self.platform}"
        settings = ", ".join(f"{k}={v}" for k, v in self.overrides().items())
        return f"{devices}: recipe {self.recipe} ({self.reason}): {settings}"


def _batch(device_count: int) -> int:
    return math.ceil(BASE_BATCH / device_count) * device_count


def _settings(platform: str, device_kind: str) -> tuple[str, str, str, str]:
    """(recipe, dtype, attention, reason) of one platform and device kind."""
    if platform == "tpu":
        if device_kind.startswith(_OLD_TPUS):
            return "tpu", "bfloat16", "flash", "TPU before v4: no Pallas kernel"
        return "tpu", "bfloat16", "pallas", "TPU: Pallas attention kernel"
    if platform in ("gpu", "cuda"):
        if any(part in device_kind for part in _PRE_AMPERE):
            return "gpu-fp16", "float16", "flash", "GPU before Ampere: no fast bfloat16"
        return "gpu-bf16", "bfloat16", "cudnn", "GPU from Ampere on: cuDNN fused attention"
    return "cpu", "float32", "reference", f"{platform or 'unknown'} platform: exact float32"


def choose(platform: str, device_kind: str = "", device_count: int = 1) -> RuntimeChoice:
    """The settings for a runtime whose first JAX device has this `platform` ("cpu", "gpu",
    "tpu") and `device_kind` ("TPU v5 lite", "Tesla T4", ...), with `device_count` devices."""
    if device_count < 1:
        raise ValueError(f"device_count must be at least 1, got {device_count}")
    platform = platform.strip().lower()
    recipe, dtype, attention, reason = _settings(platform, device_kind.strip())
    return RuntimeChoice(
        platform=platform,
        device_kind=device_kind.strip(),
        device_count=device_count,
        recipe=recipe,
        dtype=dtype,
        attention=attention,
        batch_size=_batch(device_count),
        reason=reason,
    )


def choose_for_devices(devices) -> RuntimeChoice:
    """`choose` for a list of JAX devices (`jax.devices()`)."""
    if not devices:
        raise ValueError("no JAX devices: is jax installed for this runtime?")
    first = devices[0]
    return choose(first.platform, getattr(first, "device_kind", ""), len(devices))
