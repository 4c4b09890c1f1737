"""dpojax.hardware.runtime_choice: the dtype, attention and batch the notebooks pick for a
runtime's accelerator, from JAX's platform and device_kind."""

from __future__ import annotations

import types

import pytest

from dpojax import api
from dpojax.hardware.runtime_choice import choose, choose_for_devices


@pytest.mark.parametrize(
    "platform, kind, recipe, dtype, attention",
    [
        ("cpu", "cpu", "cpu", "float32", "reference"),
        ("tpu", "TPU v5 lite", "tpu", "bfloat16", "pallas"),
        ("tpu", "TPU v6 lite", "tpu", "bfloat16", "pallas"),
        ("tpu", "TPU v2", "tpu", "bfloat16", "flash"),
        ("tpu", "TPU v3", "tpu", "bfloat16", "flash"),
        ("gpu", "Tesla T4", "gpu-fp16", "float16", "flash"),
        ("gpu", "Tesla V100-SXM2-16GB", "gpu-fp16", "float16", "flash"),
        ("gpu", "NVIDIA L4", "gpu-bf16", "bfloat16", "cudnn"),
        ("gpu", "NVIDIA A100-SXM4-40GB", "gpu-bf16", "bfloat16", "cudnn"),
        ("gpu", "NVIDIA H100 80GB HBM3", "gpu-bf16", "bfloat16", "cudnn"),
        ("cuda", "NVIDIA H200", "gpu-bf16", "bfloat16", "cudnn"),
        ("METAL", "Apple M2", "cpu", "float32", "reference"),
    ],
)
def test_each_kind_gets_its_dtype_and_attention(platform, kind, recipe, dtype, attention):
    choice = choose(platform, kind)
    assert (choice.recipe, choice.dtype, choice.attention) == (recipe, dtype, attention)


@pytest.mark.parametrize("count, batch", [(1, 8), (4, 8), (8, 8), (6, 12), (16, 16)])
def test_the_batch_divides_by_the_device_count(count, batch):
    choice = choose("tpu", "TPU v5 lite", count)
    assert choice.batch_size == batch and choice.batch_size % count == 0


@pytest.mark.parametrize(
    "platform, kind", [("cpu", "cpu"), ("gpu", "NVIDIA L4"), ("tpu", "TPU v4")]
)
def test_overrides_are_valid_config_values(platform, kind):
    overrides = choose(platform, kind).overrides()
    config = api.config(None, overrides)  # refuses an unknown key or a value out of its choices
    assert config.model.attention == overrides["model.attention"]


def test_describe_names_the_device_and_the_settings():
    choice = choose("gpu", "Tesla T4", 2)
    text = choice.describe()
    assert text.startswith("2 x Tesla T4: recipe gpu-fp16")
    assert "model.dtype=float16" in text and "model.attention=flash" in text


def test_from_jax_devices_uses_the_first_and_counts_them():
    devices = [types.SimpleNamespace(platform="tpu", device_kind="TPU v4")] * 4
    choice = choose_for_devices(devices)
    assert (choice.platform, choice.device_count, choice.attention) == ("tpu", 4, "pallas")
    with pytest.raises(ValueError, match="no JAX devices"):
        choose_for_devices([])
    with pytest.raises(ValueError, match="device_count"):
        choose("cpu", "cpu", 0)
