"""LoRA adapters exported in PEFT's layout reproduce the merged model."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from dpojax.models import add_lora, init_model, merge_lora, save_pretrained
from dpojax.models.peft import save_lora_adapter
from dpojax.models.safetensors_io import load_tensors
from dpojax.models.tiny import tiny_config


@pytest.mark.slow
def test_peft_adapter_plus_base_equals_merged_export(tmp_path):
    base = init_model(tiny_config("qwen2", vocab_size=64), seed=0)
    model = add_lora(base, rank=4, alpha=8.0, targets=("q_proj", "down_proj"), seed=1)
    for layer in model.layers:  # a trained-looking adapter
        b = layer.self_attn.q_proj.lora_b
        b[...] = 0.01 * jnp.ones_like(b[...])
        d = layer.mlp.down_proj.lora_b
        d[...] = -0.02 * jnp.ones_like(d[...])
    save_pretrained(base, None, tmp_path / "base")
    save_pretrained(model, None, tmp_path / "merged")
    save_lora_adapter(model, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    assert cfg["target_modules"] == ["down_proj", "q_proj"]
    adapter = load_tensors(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == 2 * 2 * 2  # layers x modules x (A, B)
    base_w = load_tensors(tmp_path / "base" / "model.safetensors")
    merged_w = load_tensors(tmp_path / "merged" / "model.safetensors")
    scale = cfg["lora_alpha"] / cfg["r"]
    for name, weight in base_w.items():
        module = name[: -len(".weight")]
        a = adapter.get(f"base_model.model.{module}.lora_A.weight")
        if a is None:
            np.testing.assert_array_equal(merged_w[name], weight, err_msg=name)
            continue
        b = adapter[f"base_model.model.{module}.lora_B.weight"]
        assert a.shape[0] == 4 and b.shape[1] == 4
        np.testing.assert_allclose(merged_w[name], weight + scale * b @ a, atol=1e-6)
    tokens = jnp.arange(12)[None] % 64
    np.testing.assert_allclose(merge_lora(model)(tokens), model(tokens), atol=1e-5)


@pytest.mark.slow
def test_phi3_adapter_on_fused_modules_equals_merged_export(tmp_path):
    """Phi-3 fuses q/k/v and gate/up in its checkpoint: the parts' adapters become one adapter of
    the fused module (stacked A, block-diagonal B, rank and alpha scaled by the parts)."""
    base = init_model(tiny_config("phi3", vocab_size=64), seed=0)
    model = add_lora(base, rank=2, alpha=4.0, targets=("q_proj", "v_proj", "up_proj"), seed=1)
    for layer in model.layers:
        for dense in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.mlp.up_proj):
            shape = dense.lora_b[...].shape
            dense.lora_b[...] = 0.01 * jnp.arange(np.prod(shape)).reshape(shape) / np.prod(shape)
    save_pretrained(base, None, tmp_path / "base")
    save_pretrained(model, None, tmp_path / "merged")
    save_lora_adapter(model, tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["gate_up_proj", "qkv_proj"]
    assert cfg["rank_pattern"] == {"qkv_proj": 4, "gate_up_proj": 2}
    assert cfg["alpha_pattern"] == {"qkv_proj": 8.0, "gate_up_proj": 4.0}
    adapter = load_tensors(tmp_path / "adapter" / "adapter_model.safetensors")
    base_w = load_tensors(tmp_path / "base" / "model.safetensors")
    merged_w = load_tensors(tmp_path / "merged" / "model.safetensors")
    changed = 0
    for name, weight in base_w.items():
        module = name[: -len(".weight")]
        a = adapter.get(f"base_model.model.{module}.lora_A.weight")
        if a is None:
            np.testing.assert_array_equal(merged_w[name], weight, err_msg=name)
            continue
        b = adapter[f"base_model.model.{module}.lora_B.weight"]
        kind = module.rsplit(".", 1)[1]
        scale = cfg["alpha_pattern"][kind] / cfg["rank_pattern"][kind]
        assert a.shape[0] == b.shape[1] == cfg["rank_pattern"][kind]
        np.testing.assert_allclose(merged_w[name], weight + scale * b @ a, atol=1e-6)
        changed += 1
    assert changed == 2 * 2  # layers x fused modules
