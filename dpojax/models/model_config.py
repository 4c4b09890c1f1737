"""Model configuration for the Llama-family decoder, and its translation from/to HF config.json.

One dataclass describes every supported family; the differences between Llama, Mistral, Qwen2 and
Qwen3 are data (biases, q/k norm, head_dim, sliding windows, RoPE scaling), not code paths.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

# model_type -> the architecture name transformers registers for causal LM.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "attention")
ATTENTION_CHOICES = ("auto", "reference", "flash", "pallas")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ConfigError(ValueError):
    """A config.json (or ModelConfig) that dpojax cannot use; the message names the field."""


def supported_architectures() -> str:
    return ", ".join(f"{arch} (model_type {mt!r})" for mt, arch in ARCHITECTURES.items())


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Dimensions and options of a Llama-family decoder.

    `dtype` is the compute dtype, `param_dtype` the storage dtype of the parameters. `hf_config_json`
    keeps the original config.json (as a string, so the config stays hashable) so that an export
    writes back the keys dpojax does not model.
    """

    model_type: str = "llama"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 176
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or a tuple of (key, value) pairs: rope_type plus that type's parameters.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # Per layer: "full_attention" or "sliding_attention"; None = every layer full (or every layer
    # sliding when sliding_window is set and the family applies it everywhere, as Mistral does).
    layer_types: tuple[str, ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    # The attention implementation (dpojax.models.attention): auto, reference, flash or pallas.
    attention: str = "auto"
    # The platform the model is compiled for ("": JAX's default backend); ahead-of-time plans
    # for another platform set it, so that "auto" and the Pallas kernels choose for the target.
    target_platform: str = ""
    # LoRA adapters (rank 0 = none) on the projections named in lora_targets.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    hf_config_json: str = ""

    def __post_init__(self):
        if self.model_type not in ARCHITECTURES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; supported: "
                f"{supported_architectures()}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ConfigError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_heads}); set head_dim explicitly"
            )
        if self.resolved_head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ConfigError(f"{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if self.attention not in ATTENTION_CHOICES:
            raise ConfigError(
                f"attention must be one of {ATTENTION_CHOICES}, got {self.attention!r}"
            )
        if self.lora_rank < 0:
            raise ConfigError(f"lora_rank must be >= 0, got {self.lora_rank}")
        bad_targets = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if self.lora_rank and (bad_targets or not self.lora_targets):
            raise ConfigError(
                f"lora_targets {list(self.lora_targets)} must be a non-empty subset of "
                f"{list(LORA_TARGETS)}"
            )
        rope = self.rope_params
        if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope_type {rope['rope_type']!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ConfigError(
                    f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
                )
            bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
            if bad:
                raise ConfigError(f"layer_types holds unsupported attention types {bad}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ConfigError(
                    "layer_types asks for sliding_attention but sliding_window is unset"
                )

    @property
    def resolved_head_dim(self) -> int:
        return int(self.head_dim) if self.head_dim else self.hidden_size // self.num_heads

    @property
    def rope_params(self) -> dict[str, Any]:
        params = dict(self.rope_scaling or ())
        params.setdefault("rope_type", params.pop("type", "default"))
        return params

    def layer_is_sliding(self, index: int) -> bool:
        if not self.sliding_window:
            return False
        if self.layer_types is None:
            return True
        return self.layer_types[index] == "sliding_attention"

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        hd, h, k = self.resolved_head_dim, self.num_heads, self.num_kv_heads
        attn = d * hd * (h + 2 * k) + h * hd * d
        attn += hd * (h + 2 * k) * self.qkv_bias + d * self.o_bias + 2 * hd * self.qk_norm
        mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
        per_layer = attn + mlp + 2 * d
        return v * d * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + d


# ---------------------------------------------------------------------------------------------
# config.json -> ModelConfig


def _require(cfg: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{source}: required field {key!r} is missing")
    return cfg[key]


def _rope_from_hf(cfg: Mapping[str, Any], source: str) -> tuple[float, tuple | None]:
    """Reads RoPE settings in both dialects: transformers 5 `rope_parameters` and 4.x
    `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_theta" not in params and "full_attention" in params:
        params = params["full_attention"]  # per-layer-type form; all layers share it here
    if isinstance(params, Mapping):
        params = dict(params)
        theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    else:
        theta = cfg.get("rope_theta", 10000.0)
        params = dict(cfg.get("rope_scaling") or {})
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope scaling type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    needed = {
        "linear": ("factor",),
        "llama3": (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ),
    }
    for key in needed.get(rope_type, ()):
        if params.get(key) is None:
            raise ConfigError(f"{source}: rope scaling type {rope_type!r} needs field {key!r}")
    if rope_type == "default":
        return float(theta), None
    keep = {k: params[k] for k in needed[rope_type]}
    return float(theta), tuple(sorted({"rope_type": rope_type, **keep}.items()))


def config_from_hf(
    cfg: Mapping[str, Any], *, source: str = "config.json", **overrides
) -> ModelConfig:
    """Builds a ModelConfig from a parsed HF config.json. Dimensions always come from the file."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    known_arch = [a for a in archs if a in ARCHITECTURES.values()]
    if model_type not in ARCHITECTURES or (archs and not known_arch):
        found = f"model_type {model_type!r}" + (f", architectures {archs}" if archs else "")
        raise ConfigError(
            f"{source}: unsupported architecture ({found}); dpojax supports "
            f"{supported_architectures()}"
        )
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    num_heads = int(_require(cfg, "num_attention_heads", source))
    theta, rope_scaling = _rope_from_hf(cfg, source)
    sliding_window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if model_type in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False):
            sliding_window = None
            layer_types = None
        elif layer_types is None:
            first = int(cfg.get("max_window_layers", 0))
            n = int(cfg["num_hidden_layers"])
            layer_types = [
                "sliding_attention" if i >= first else "full_attention" for i in range(n)
            ]
    if model_type == "llama":
        sliding_window, layer_types = None, None
    if layer_types is not None and "sliding_attention" not in layer_types:
        layer_types = None
    attention_bias = bool(cfg.get("attention_bias", False))
    eos = cfg.get("eos_token_id")
    values = dict(
        model_type=model_type,
        vocab_size=int(_require(cfg, "vocab_size", source)),
        hidden_size=int(_require(cfg, "hidden_size", source)),
        intermediate_size=int(_require(cfg, "intermediate_size", source)),
        num_layers=int(_require(cfg, "num_hidden_layers", source)),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg["head_dim"]) if cfg.get("head_dim") else None,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        sliding_window=int(sliding_window) if sliding_window else None,
        layer_types=tuple(layer_types) if layer_types else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=cfg.get("pad_token_id"),
        hf_config_json=json.dumps(dict(cfg), sort_keys=True),
    )
    values.update(overrides)
    try:
        return ModelConfig(**values)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


# ---------------------------------------------------------------------------------------------
# ModelConfig -> config.json


def config_to_hf(config: ModelConfig, *, dtype: str | None = None) -> dict[str, Any]:
    """The config.json dict for `config`, in the installed transformers' dialect.

    Starts from the original config.json when there is one (keeping keys dpojax does not model),
    else from transformers' config class defaults, then writes every field dpojax models.
    """
    if config.hf_config_json:
        out = json.loads(config.hf_config_json)
    else:
        import transformers

        out = transformers.AutoConfig.for_model(config.model_type).to_dict()
    rope = {"rope_type": config.rope_params["rope_type"], "rope_theta": config.rope_theta}
    rope.update({k: v for k, v in config.rope_params.items() if k != "rope_type"})
    if "rope_scaling" in out and "rope_parameters" not in out:  # transformers 4.x dialect
        out["rope_theta"] = config.rope_theta
        out["rope_scaling"] = (
            None
            if rope["rope_type"] == "default"
            else {k: v for k, v in rope.items() if k != "rope_theta"}
        )
    else:
        out["rope_parameters"] = rope
        out.pop("rope_scaling", None)
        out.pop("rope_theta", None)
    out.update(
        architectures=[ARCHITECTURES[config.model_type]],
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.resolved_head_dim,
        hidden_act="silu",
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=list(config.eos_token_id)
        if isinstance(config.eos_token_id, tuple)
        else config.eos_token_id,
        pad_token_id=config.pad_token_id,
        dtype=dtype or config.param_dtype,
    )
    if "torch_dtype" in out:
        out["torch_dtype"] = out["dtype"]
    if config.model_type == "llama":
        out["attention_bias"] = config.qkv_bias
        out["mlp_bias"] = config.mlp_bias
    elif config.model_type == "qwen3":
        out["attention_bias"] = config.qkv_bias
    if config.model_type == "mistral":
        out["sliding_window"] = config.sliding_window
    elif config.model_type in ("qwen2", "qwen3"):
        out["use_sliding_window"] = bool(config.sliding_window)
        out["sliding_window"] = config.sliding_window
        types = config.layer_types or ("full_attention",) * config.num_layers
        out["layer_types"] = list(types)
        if config.sliding_window:
            out["max_window_layers"] = next(
                (i for i, t in enumerate(types) if t == "sliding_attention"), config.num_layers
            )
    out.pop("_name_or_path", None)
    out.pop("transformers_version", None)
    return {k: v for k, v in out.items() if not (isinstance(v, float) and math.isnan(v))}
