"""LoRA adapters exported in PEFT's layout reproduce the merged model."""

import json

import jax.numpy as jnp
import numpy as np

from dpojax.models import add_lora, init_model, merge_lora, save_pretrained
from dpojax.models.peft import save_lora_adapter
from dpojax.models.safetensors_io import load_tensors
from dpojax.models.tiny import tiny_config


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
