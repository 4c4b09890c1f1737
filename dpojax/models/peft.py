"""LoRA adapters in PEFT's on-disk format (adapter_config.json + adapter_model.safetensors)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from dpojax.models.hf import hf_name
from dpojax.models.layers import LoRAParam
from dpojax.models.safetensors_io import save_tensors
from dpojax.models.transformer import CausalLM


def lora_tensors(model: CausalLM) -> dict[str, np.ndarray]:
    """PEFT-named adapter tensors: lora_A.weight [r, in] and lora_B.weight [out, r]."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        module = hf_name(path[:-1] + ("kernel",))[: -len(".weight")]
        factor = "lora_A" if path[-1] == "lora_a" else "lora_B"
        value = var.get_value()
        if not value.is_fully_addressable:
            value = multihost_utils.process_allgather(value, tiled=True)
        out[f"base_model.model.{module}.{factor}.weight"] = np.asarray(jax.device_get(value)).T
    return out


def save_lora_adapter(model: CausalLM, path: str | os.PathLike, *, base_model: str = "") -> Path:
    """Writes the model's LoRA adapters so that `peft.PeftModel.from_pretrained(base, path)`
    loads them (scaling alpha / rank, no dropout, no bias). Only process 0 writes; every process
    must call this (adapters spread over processes are gathered)."""
    config = model.config
    if not config.lora_rank:
        raise ValueError("the model has no LoRA adapters (lora_rank is 0)")
    path = Path(path)
    tensors = lora_tensors(model)
    if jax.process_index() != 0:
        return path
    path.mkdir(parents=True, exist_ok=True)
    save_tensors(tensors, path / "adapter_model.safetensors")
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "target_modules": sorted(config.lora_targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return path
