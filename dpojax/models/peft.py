"""LoRA adapters in PEFT's on-disk format (adapter_config.json + adapter_model.safetensors).

Where the checkpoint fuses projections that dpojax keeps apart (Phi-3's `qkv_proj` and
`gate_up_proj`), the adapters of the parts become one adapter of the fused module: A stacks
the parts' A factors (rank r per part) and B is block-diagonal, so each part's output gets
exactly its own update; `rank_pattern` / `alpha_pattern` give that module rank n * r and alpha
n * alpha, keeping the scale alpha / r.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from dpojax.models.hf_names import FUSED, hf_name
from dpojax.models.layers import LoRAParam
from dpojax.models.safetensors_io import save_tensors
from dpojax.models.scan import unstack_flat
from dpojax.models.transformer import CausalLM


def _fused_module(config, name: str) -> str | None:
    if config.fused_qkv and name in ("q_proj", "k_proj", "v_proj"):
        return "qkv_proj"
    if config.fused_gate_up and name in ("gate_proj", "up_proj"):
        return "gate_up_proj"
    return None


_PARTS = FUSED  # a fused checkpoint tensor -> the dpojax projections it holds


def _host_adapters(model: CausalLM) -> dict[tuple, np.ndarray]:
    """Every adapter factor on the host (factors spread over processes are gathered)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        value = var.get_value()
        if not value.is_fully_addressable:
            value = multihost_utils.process_allgather(value, tiled=True)
        out[path] = np.asarray(jax.device_get(value))
    return out


def _fused_factors(
    factors: dict[tuple, np.ndarray], widths: dict[tuple, int], owner: tuple, fused: str
) -> tuple[np.ndarray, np.ndarray]:
    """(A [n r, in], block-diagonal B [out, n r]) of one fused module from its parts' adapters
    (`widths`: each projection's output width); a part without an adapter contributes zero rows
    of B."""
    a_rows, b_blocks = [], []
    for part in _PARTS[fused]:
        a = factors.get((*owner, part, "lora_a"))
        out = widths[(*owner, part)]
        b_blocks.append((out, None if a is None else factors[(*owner, part, "lora_b")].T))
        if a is not None:
            a_rows.append(a.T)
    rank = sum(r.shape[0] for r in a_rows)
    b = np.zeros((sum(out for out, _ in b_blocks), rank), a_rows[0].dtype)
    row = col = 0
    for out, block in b_blocks:
        if block is not None:
            b[row : row + out, col : col + block.shape[1]] = block
            col += block.shape[1]
        row += out
    return np.concatenate(a_rows), b


def lora_tensors(model: CausalLM) -> dict[str, np.ndarray]:
    """PEFT-named adapter tensors: lora_A.weight [r, in] and lora_B.weight [out, r] (fused
    modules as in the module docstring). Every process must call this."""
    config = model.config
    factors = _host_adapters(model)
    widths = {
        path[:-1]: var.shape[-1]
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if path[-1] in ("kernel", "codes")  # a quantized base keeps the output width
    }
    if config.scan_layers:  # PEFT names one adapter per layer: unstack the scanned factors
        period = config.scan_period()[0]
        rows = config.num_layers // period
        factors = unstack_flat(factors, period, rows, lambda a, g: a[g])
        widths = unstack_flat(widths, period, rows, lambda w, g: w)
    out = {}
    for path, value in factors.items():
        fused = _fused_module(config, path[-2])
        if fused is not None:
            module = hf_name((*path[:-2], fused, "kernel"))[: -len(".weight")]
            if f"base_model.model.{module}.lora_A.weight" not in out:
                a, b = _fused_factors(factors, widths, path[:-2], fused)
                out[f"base_model.model.{module}.lora_A.weight"] = a
                out[f"base_model.model.{module}.lora_B.weight"] = b
            continue
        module = hf_name(path[:-1] + ("kernel",))[: -len(".weight")]
        factor = "lora_A" if path[-1] == "lora_a" else "lora_B"
        out[f"base_model.model.{module}.{factor}.weight"] = value.T
    return out


def _targets(config) -> tuple[list[str], dict[str, int], dict[str, float]]:
    """PEFT's target_modules, rank_pattern and alpha_pattern for the adapted projections."""
    targets, ranks, alphas = set(), {}, {}
    for name in config.lora_targets:
        fused = _fused_module(config, name)
        if fused is None:
            targets.add(name)
            continue
        targets.add(fused)
        parts = sum(p in config.lora_targets for p in _PARTS[fused])
        ranks[fused] = parts * config.lora_rank
        alphas[fused] = parts * config.lora_alpha
    return sorted(targets), ranks, alphas


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
    targets, ranks, alphas = _targets(config)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "target_modules": targets,
        "rank_pattern": ranks,
        "alpha_pattern": alphas,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return path
