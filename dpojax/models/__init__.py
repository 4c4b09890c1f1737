"""The decoder (Flax NNX; Llama, Mistral, Qwen2/3, Qwen3-MoE, Gemma 2/3, Phi-3) and Hugging Face
checkpoint interop (local directories and Hub ids)."""

from dpojax.models.hf import from_pretrained, load_params, read_config, save_pretrained
from dpojax.models.layers import LoRAParam, QuantParam
from dpojax.models.model_config import (
    ARCHITECTURES,
    ModelConfig,
    ModelConfigError,
    config_from_hf,
    config_to_hf,
)
from dpojax.models.safetensors_io import ModelFileError
from dpojax.models.sharding import DEFAULT_RULES, named_shardings, partition_specs
from dpojax.models.transformer import (
    CausalLM,
    abstract_model,
    add_lora,
    dequantize_model,
    init_model,
    merge_lora,
    quantize_model,
)

__all__ = [
    "ARCHITECTURES",
    "CausalLM",
    "LoRAParam",
    "QuantParam",
    "ModelFileError",
    "ModelConfigError",
    "DEFAULT_RULES",
    "ModelConfig",
    "abstract_model",
    "add_lora",
    "config_from_hf",
    "config_to_hf",
    "dequantize_model",
    "from_pretrained",
    "init_model",
    "load_params",
    "merge_lora",
    "named_shardings",
    "partition_specs",
    "quantize_model",
    "read_config",
    "save_pretrained",
]
