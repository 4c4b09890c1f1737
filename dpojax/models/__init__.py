"""The Llama-family decoder (Flax NNX) and Hugging Face checkpoint interop."""

from dpojax.models.config import (
    ARCHITECTURES,
    ConfigError,
    ModelConfig,
    config_from_hf,
    config_to_hf,
)
from dpojax.models.hf import from_pretrained, load_params, read_config, save_pretrained
from dpojax.models.safetensors_io import CheckpointError
from dpojax.models.sharding import DEFAULT_RULES, named_shardings, partition_specs
from dpojax.models.transformer import CausalLM, abstract_model, init_model

__all__ = [
    "ARCHITECTURES",
    "CausalLM",
    "CheckpointError",
    "ConfigError",
    "DEFAULT_RULES",
    "ModelConfig",
    "abstract_model",
    "config_from_hf",
    "config_to_hf",
    "from_pretrained",
    "init_model",
    "load_params",
    "named_shardings",
    "partition_specs",
    "read_config",
    "save_pretrained",
]
