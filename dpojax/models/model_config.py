"""Model configuration of the decoder, and its translation from/to HF config.json.

One dataclass describes every supported family; the differences between Llama, Mistral, Qwen2,
Qwen3, Qwen3-MoE, Gemma 2, Gemma 3 and Phi-3 are data (biases, q/k norm, head_dim, sliding
windows, RoPE scaling and partial rotation, Gemma's norms, scaled embeddings and soft-capping,
mixture-of-experts routing, fused checkpoint projections), not separate model classes.

Why one module of this length: a field of `ModelConfig`, its reading from config.json and its
writing back are one fact in three forms; kept side by side, a new feature is one edit here and
the round trip test (tests/unit/models) covers it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from dpojax.models import quant
from dpojax.models.families import (
    ARCHITECTURES,
    FAMILIES,
    ModelConfigError,
    require,
    supported_architectures,
)
from dpojax.models.scan import scan_period

# model_type -> the architecture name transformers registers for causal LM.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# HF activation names -> dpojax's
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "attention")
# The attention implementations (`dpojax.models.attention` runs them); "auto" picks one per
# platform and row length (`attention.resolve`).
ATTENTION_IMPLEMENTATIONS = ("reference", "flash", "pallas", "cudnn")
ATTENTION_CHOICES = ("auto", *ATTENTION_IMPLEMENTATIONS)
# The batch layouts (data.layout) whose attention rule cuDNN's fused attention expresses exactly:
# one causal sequence per row from column 0, then padding (its per-row sequence lengths).
CUDNN_LAYOUTS = ("padded",)
# cuDNN's fused attention: the largest head dim "auto" hands it (256 needs a Hopper GPU or later).
CUDNN_MAX_HEAD_DIM = 256
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Dimensions and options of the decoder, for every supported family.

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
    # Decoder layers stacked per kind and run by one scan (`dpojax.models.scan`); needs a period
    # of the layer kinds (`scan_period`).
    scan_layers: bool = False
    # The attention implementation (dpojax.models.attention): auto, reference, flash, pallas or
    # cudnn.
    attention: str = "auto"
    # The batch layout of the rows the model is called with (data.layout; "" = not known, any
    # layout): cuDNN's fused attention runs only where it expresses the layout's rule exactly.
    row_layout: str = ""
    # The platform the model is compiled for ("": JAX's default backend); ahead-of-time plans
    # for another platform set it, so that "auto" and the Pallas kernels choose for the target.
    target_platform: str = ""
    # The Pallas kernels' query and key block in tokens (a multiple of 128); 0 = the TPU
    # generation's own (dpojax.models.attention.pallas.BLOCKS).
    attention_block: int = 0
    # LoRA adapters (rank 0 = none) on the projections named in lora_targets.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    # The frozen base's attention and MLP projections stored quantized ("none", "int8", "nf4";
    # dpojax.models.quant), one scale per `quantization_block` inputs of each output column.
    quantization: str = "none"
    quantization_block: int = 64
    # The activation of the gated MLP: "silu" or "gelu_tanh" (Gemma).
    hidden_act: str = "silu"
    # Gemma: norms hold an offset from 1 (x * (1 + w), in float32), norms after attention and the
    # MLP as well as before ("sandwich"), embeddings scaled by sqrt(hidden_size), attention
    # scaled by query_pre_attn_scalar**-0.5, tanh soft-capping of attention scores and logits.
    norm_plus_one: bool = False
    sandwich_norm: bool = False
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # Gemma 3: the RoPE base of sliding-window layers (default RoPE), when it differs.
    sliding_rope_theta: float | None = None
    # Phi-3 / Phi-4-mini: RoPE on this fraction of each head's dimensions only.
    partial_rotary_factor: float = 1.0
    # Phi-3's checkpoints fuse q/k/v and gate/up into one tensor each (the model keeps them apart).
    fused_qkv: bool = False
    fused_gate_up: bool = False
    # Mixture of experts (Qwen3-MoE): experts per MoE layer (0 = dense), top-k routing.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False
    hf_config_json: str = ""

    def __post_init__(self):
        if self.model_type not in ARCHITECTURES:
            raise ModelConfigError(
                f"model_type {self.model_type!r} is not supported; supported: "
                f"{supported_architectures()}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            if int(getattr(self, name)) <= 0:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ModelConfigError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_heads}); set head_dim explicitly"
            )
        if self.resolved_head_dim % 2:
            raise ModelConfigError(
                f"head_dim must be even for rotary embeddings, got {self.head_dim}"
            )
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ModelConfigError(
                    f"{name} must be one of {DTYPES}, got {getattr(self, name)!r}"
                )
        if self.remat not in REMAT_POLICIES:
            raise ModelConfigError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if self.attention not in ATTENTION_CHOICES:
            raise ModelConfigError(
                f"attention must be one of {ATTENTION_CHOICES}, got {self.attention!r}"
            )
        if self.attention_block < 0 or self.attention_block % 128:
            raise ModelConfigError(
                f"attention_block must be 0 (the chip's) or a multiple of 128, got "
                f"{self.attention_block}"
            )
        if self.lora_rank < 0:
            raise ModelConfigError(f"lora_rank must be >= 0, got {self.lora_rank}")
        bad_targets = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if self.lora_rank and (bad_targets or not self.lora_targets):
            raise ModelConfigError(
                f"lora_targets {list(self.lora_targets)} must be a non-empty subset of "
                f"{list(LORA_TARGETS)}"
            )
        self._check_quantization()
        rope = self.rope_params
        if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(
                f"rope_type {rope['rope_type']!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        self._check_families()
        if self.scan_layers and not self.scan_period()[0]:
            raise ModelConfigError(
                f"scan_layers: this {self.model_type} model cannot scan its layers: "
                f"{self.scan_period()[1]}; set model.scan_layers=false (or auto)"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ModelConfigError(
                    f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
                )
            bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
            if bad:
                raise ModelConfigError(f"layer_types holds unsupported attention types {bad}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ModelConfigError(
                    "layer_types asks for sliding_attention but sliding_window is unset"
                )

    def projection_inputs(self) -> dict[str, int]:
        """The input size of each attention and MLP projection."""
        d = self.hidden_size
        heads = self.num_heads * self.resolved_head_dim
        sizes = dict.fromkeys(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), d)
        return {**sizes, "o_proj": heads, "down_proj": self.intermediate_size}

    def _check_quantization(self) -> None:
        if self.quantization not in quant.SCHEMES:
            raise ModelConfigError(
                f"quantization must be one of {quant.SCHEMES}, got {self.quantization!r}"
            )
        if self.quantization == "none":
            return
        dense_mlp = any(not self.layer_is_moe(i) for i in range(self.num_layers))
        for name, size in self.projection_inputs().items():
            if name.endswith("_proj") and name[:-5] in ("gate", "up", "down") and not dense_mlp:
                continue  # mixture-of-experts layers only: their experts stay unquantized
            problem = quant.block_problem(size, self.quantization, self.quantization_block)
            if problem:
                raise ModelConfigError(f"quantization_block: {name}: {problem}")

    def _check_families(self) -> None:
        if self.attn_softcap and self.attention in ("flash", "pallas", "cudnn"):
            raise ModelConfigError(
                f"attention soft-capping (Gemma 2) runs in the reference attention; attention "
                f"{self.attention!r} does not soft-cap: use auto or reference"
            )
        if self.attention == "cudnn" and (problem := self.cudnn_problem()):
            raise ModelConfigError(f"model.attention='cudnn': {problem}")
        if self.hidden_act not in set(ACTIVATIONS.values()):
            raise ModelConfigError(f"hidden_act {self.hidden_act!r} is not supported")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise ModelConfigError(
                f"partial_rotary_factor {self.partial_rotary_factor} must give an even number of "
                f"rotary dimensions in (0, head_dim]"
            )
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ModelConfigError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, "
                    f"num_experts ({self.num_experts})]"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step < 1:
                raise ModelConfigError(
                    "moe_intermediate_size and decoder_sparse_step must be positive"
                )

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (all but with a partial rotary factor)."""
        return int(self.resolved_head_dim * self.partial_rotary_factor)

    def layer_is_moe(self, index: int) -> bool:
        """Whether decoder layer `index` has a mixture-of-experts MLP."""
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
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

    def scan_period(self) -> tuple[int, str]:
        """(P, "") with P the period of the layer kinds that scanned layers repeat, or (0, why
        the layers cannot be scanned) (`dpojax.models.scan.scan_period`)."""
        kinds = [(self.layer_is_sliding(i), self.layer_is_moe(i)) for i in range(self.num_layers)]
        return scan_period(self.num_layers, kinds)

    def cudnn_problem(self, layout: str | None = None) -> str:
        """Why cuDNN's fused attention cannot compute this model's attention exactly on rows of
        `layout` (default `row_layout`; "" = not known: the rows' own arrays are not checked
        here), and what to use instead; "" where it can."""
        layout = self.row_layout if layout is None else layout
        if layout and layout not in CUDNN_LAYOUTS:
            return (
                f"cuDNN's fused attention expresses the {'/'.join(CUDNN_LAYOUTS)} layout only "
                f"(per-row sequence lengths), not {layout!r} rows (segments, shared prompts); "
                "use flash (or auto, which picks it there)"
            )
        if self.dtype == "float32":
            return (
                "cuDNN's fused attention takes bfloat16 or float16, not float32: set "
                "model.dtype=bfloat16, or use flash"
            )
        d = self.resolved_head_dim
        if d % 8 or d > CUDNN_MAX_HEAD_DIM:
            return (
                f"cuDNN's fused attention needs a head dim that is a multiple of 8 and at most "
                f"{CUDNN_MAX_HEAD_DIM}, this model's is {d}: use flash"
            )
        return ""

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def mlp_params(self, index: int, *, active: bool = False) -> int:
        """Parameters of layer `index`'s MLP (with `active`, those one token uses: its top-k
        experts and the router)."""
        d, f = self.hidden_size, self.intermediate_size
        if not self.layer_is_moe(index):
            return 3 * d * f + (2 * f + d) * self.mlp_bias
        experts = self.num_experts_per_tok if active else self.num_experts
        return experts * 3 * d * self.moe_intermediate_size + d * self.num_experts

    def num_params(self) -> int:
        d, v = self.hidden_size, self.vocab_size
        hd, h, k = self.resolved_head_dim, self.num_heads, self.num_kv_heads
        attn = d * hd * (h + 2 * k) + h * hd * d
        attn += hd * (h + 2 * k) * self.qkv_bias + d * self.o_bias + 2 * hd * self.qk_norm
        norms = (4 if self.sandwich_norm else 2) * d
        layers = sum(attn + norms + self.mlp_params(i) for i in range(self.num_layers))
        return v * d * (1 if self.tie_word_embeddings else 2) + layers + d


# ---------------------------------------------------------------------------------------------
# config.json -> ModelConfig


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
        raise ModelConfigError(
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
            raise ModelConfigError(f"{source}: rope scaling type {rope_type!r} needs field {key!r}")
    if rope_type == "default":
        return float(theta), None
    keep = {k: params[k] for k in needed[rope_type]}
    return float(theta), tuple(sorted({"rope_type": rope_type, **keep}.items()))


def _model_type(cfg: Mapping[str, Any], source: str) -> str:
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    known_arch = [a for a in archs if a in ARCHITECTURES.values()]
    if model_type not in ARCHITECTURES or (archs and not known_arch):
        found = f"model_type {model_type!r}" + (f", architectures {archs}" if archs else "")
        raise ModelConfigError(
            f"{source}: unsupported architecture ({found}); dpojax supports "
            f"{supported_architectures()}"
        )
    return model_type


def config_from_hf(
    cfg: Mapping[str, Any], *, source: str = "config.json", **overrides
) -> ModelConfig:
    """Builds a ModelConfig from a parsed HF config.json. Dimensions always come from the file."""
    model_type = _model_type(cfg, source)
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise ModelConfigError(
            f"{source}: hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})"
        )
    num_heads = int(require(cfg, "num_attention_heads", source))
    theta, rope_scaling = _rope_from_hf(cfg, source)
    eos = cfg.get("eos_token_id")
    values = dict(
        model_type=model_type,
        vocab_size=int(require(cfg, "vocab_size", source)),
        hidden_size=int(require(cfg, "hidden_size", source)),
        intermediate_size=int(require(cfg, "intermediate_size", source)),
        num_layers=int(require(cfg, "num_hidden_layers", source)),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg["head_dim"]) if cfg.get("head_dim") else None,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=cfg.get("sliding_window"),
        layer_types=cfg.get("layer_types"),
        hidden_act=ACTIVATIONS[act],
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=cfg.get("pad_token_id"),
        hf_config_json=json.dumps(dict(cfg), sort_keys=True),
    )
    values.update(FAMILIES[model_type].read(cfg, source))
    window, types = values["sliding_window"], values["layer_types"]
    if not window or (types is not None and "sliding_attention" not in types):
        window, types = None, None  # no layer slides
    values["sliding_window"] = int(window) if window else None
    values["layer_types"] = tuple(types) if types else None
    values.update(overrides)
    try:
        return ModelConfig(**values)
    except ModelConfigError as e:
        raise ModelConfigError(f"{source}: {e}") from None


# ---------------------------------------------------------------------------------------------
# ModelConfig -> config.json


def _rope_to_hf(config: ModelConfig, out: dict[str, Any]) -> None:
    """RoPE settings in the dialect of `out` (transformers 5 `rope_parameters`, or 4.x
    `rope_theta` + `rope_scaling`), Gemma 3's per-layer-type form included."""
    rope = {"rope_type": config.rope_params["rope_type"], "rope_theta": config.rope_theta}
    rope.update({k: v for k, v in config.rope_params.items() if k != "rope_type"})
    if config.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = config.partial_rotary_factor
    local = config.sliding_rope_theta
    if "rope_scaling" in out and "rope_parameters" not in out:  # transformers 4.x dialect
        out["rope_theta"] = config.rope_theta
        out["rope_scaling"] = (
            None
            if rope["rope_type"] == "default"
            else {k: v for k, v in rope.items() if k != "rope_theta"}
        )
        if local is not None:
            out["rope_local_base_freq"] = local
        if config.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = config.partial_rotary_factor
        return
    out.pop("rope_scaling", None)
    out.pop("rope_theta", None)
    out.pop("rope_local_base_freq", None)
    if config.model_type == "gemma3_text":
        local_rope = {"rope_type": "default", "rope_theta": local or 1e4}
        out["rope_parameters"] = {"full_attention": rope, "sliding_attention": local_rope}
    else:
        out["rope_parameters"] = rope


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
    _rope_to_hf(config, out)
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
    for write in FAMILIES[config.model_type].write:
        write(config, out)
    out.pop("_name_or_path", None)
    out.pop("transformers_version", None)
    return {k: v for k, v in out.items() if not (isinstance(v, float) and math.isnan(v))}
