"""The model families dpojax implements: one record per family (`Family`), the only place a
new family is registered.

A record holds the HF architecture name and `model_type`, how the family's own config.json
fields become ModelConfig fields (`read`), how they are written back on export (`write`, a
sequence of small writers, shared between families that share fields), its tiny presets for tests
and the default recipe (`tiny`, `dpojax.models.tiny`) and, in words, what differs (`features`).
The fields every family shares are read and written by `dpojax.models.model_config`; the
decoder (`dpojax.models.transformer`) reads only ModelConfig fields, so a family made of features
dpojax already has needs nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dpojax.errors import InputProblem

# (config.json fields, source) -> ModelConfig fields of the family
Reader = Callable[[Mapping[str, Any], str], dict[str, Any]]
# (ModelConfig, the config.json dict being written) -> None: writes the family's fields
Writer = Callable[[Any, dict[str, Any]], None]


class ModelConfigError(InputProblem):
    """A config.json (or ModelConfig) that dpojax cannot use; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family (see the module docstring)."""

    model_type: str
    architecture: str
    read: Reader
    write: Sequence[Writer]
    tiny: Mapping[str, Mapping[str, Any]]
    features: str


def require(cfg: Mapping[str, Any], key: str, source: str) -> Any:
    """`cfg[key]`, or the error naming the missing field of `source`."""
    if key not in cfg or cfg[key] is None:
        raise ModelConfigError(f"{source}: required field {key!r} is missing")
    return cfg[key]


def _sliding_qwen(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2/3 apply a sliding window only with use_sliding_window, from max_window_layers up."""
    if not cfg.get("use_sliding_window", False):
        return dict(sliding_window=None, layer_types=None)
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first = int(cfg.get("max_window_layers", 0))
        n = int(cfg["num_hidden_layers"])
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return dict(sliding_window=cfg.get("sliding_window"), layer_types=layer_types)


def _llama(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return dict(sliding_window=None, layer_types=None, qkv_bias=bias, o_bias=bias)


def _mistral(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias)


def _qwen2(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    return dict(qkv_bias=True, o_bias=False, **_sliding_qwen(cfg))


def _qwen3(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, **_sliding_qwen(cfg))


def _qwen3_moe(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    return dict(
        _qwen3(cfg, source),
        num_experts=int(experts),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 8)),
        moe_intermediate_size=int(require(cfg, "moe_intermediate_size", source)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
        output_router_logits=bool(cfg.get("output_router_logits", False)),
    )


def _gemma(cfg: Mapping[str, Any], source: str, pattern: int) -> dict[str, Any]:
    if cfg.get("use_bidirectional_attention"):
        raise ModelConfigError(f"{source}: use_bidirectional_attention is not supported")
    n = int(require(cfg, "num_hidden_layers", source))
    pattern = int(cfg.get("sliding_window_pattern") or pattern)
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
    ]
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        qkv_bias=bias,
        o_bias=bias,
        head_dim=int(cfg.get("head_dim") or 256),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        norm_plus_one=True,
        sandwich_norm=True,
        embed_scale=True,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        sliding_window=int(cfg.get("sliding_window") or 4096),
        layer_types=layer_types,
    )


def _gemma2(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    out = _gemma(cfg, source, pattern=2)
    out["attn_softcap"] = cfg.get("attn_logit_softcapping", 50.0)
    out["final_softcap"] = cfg.get("final_logit_softcapping", 30.0)
    return out


def _gemma3_rope(cfg: Mapping[str, Any], source: str) -> tuple[float, float]:
    """(global RoPE base, local RoPE base) of a Gemma 3 config in either dialect."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and "sliding_attention" in params:
        local = dict(params["sliding_attention"] or {})
        if local.get("rope_type", "default") != "default":
            raise ModelConfigError(f"{source}: sliding-attention RoPE must be of type 'default'")
        full = params.get("full_attention") or {}
        return float(full.get("rope_theta", 1e6)), float(local.get("rope_theta", 1e4))
    return float(cfg.get("rope_theta", 1e6)), float(cfg.get("rope_local_base_freq", 1e4))


def _gemma3_text(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    out = _gemma(cfg, source, pattern=6)
    out["rope_theta"], out["sliding_rope_theta"] = _gemma3_rope(cfg, source)
    out["qk_norm"] = True
    out["attn_softcap"] = None  # Gemma 3's attention does not soft-cap
    out["final_softcap"] = cfg.get("final_logit_softcapping")
    return out


def _phi3(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return dict(
        fused_qkv=True,
        fused_gate_up=True,
        partial_rotary_factor=float(factor),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _attention_bias(config: Any, out: dict[str, Any]) -> None:
    out["attention_bias"] = config.qkv_bias


def _mlp_bias(config: Any, out: dict[str, Any]) -> None:
    out["mlp_bias"] = config.mlp_bias


def _window(config: Any, out: dict[str, Any]) -> None:
    out["sliding_window"] = config.sliding_window


def _qwen_window(config: Any, out: dict[str, Any]) -> None:
    out["use_sliding_window"] = bool(config.sliding_window)
    out["sliding_window"] = config.sliding_window
    types = config.layer_types or ("full_attention",) * config.num_layers
    out["layer_types"] = list(types)
    if config.sliding_window:
        out["max_window_layers"] = next(
            (i for i, t in enumerate(types) if t == "sliding_attention"), config.num_layers
        )


def _gemma_fields(config: Any, out: dict[str, Any]) -> None:
    out.pop("hidden_act", None)
    out["hidden_activation"] = "gelu_pytorch_tanh"
    scalar = config.query_pre_attn_scalar
    out["query_pre_attn_scalar"] = int(scalar) if float(scalar).is_integer() else scalar
    out["final_logit_softcapping"] = config.final_softcap
    out["attn_logit_softcapping"] = config.attn_softcap
    out["sliding_window"] = config.sliding_window
    out["layer_types"] = list(config.layer_types or ("full_attention",) * config.num_layers)


def _moe_fields(config: Any, out: dict[str, Any]) -> None:
    out.pop("num_local_experts", None)
    out.update(
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=config.norm_topk_prob,
        decoder_sparse_step=config.decoder_sparse_step,
        mlp_only_layers=list(config.mlp_only_layers),
        router_aux_loss_coef=config.router_aux_loss_coef,
        output_router_logits=config.output_router_logits,
    )


_LLAMA3_SCALING = (
    ("factor", 8.0),
    ("high_freq_factor", 4.0),
    ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 16),
    ("rope_type", "llama3"),
)

_TINY_GEMMA = dict(
    hidden_act="gelu_tanh",
    norm_plus_one=True,
    sandwich_norm=True,
    embed_scale=True,
    head_dim=32,
    query_pre_attn_scalar=24.0,
    tie_word_embeddings=True,
    sliding_window=6,
    layer_types=("sliding_attention", "full_attention"),
)

_QWEN_ROPE = dict(rope_theta=1000000.0)
_TINY_QWEN3 = dict(qk_norm=True, head_dim=32, **_QWEN_ROPE)

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            "llama",
            "LlamaForCausalLM",
            read=_llama,
            write=(_attention_bias, _mlp_bias),
            tiny={
                "llama": dict(rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING),
                "llama_tied": dict(tie_word_embeddings=True),
            },
            features="GQA, llama3 RoPE scaling, optional attention_bias / mlp_bias",
        ),
        Family(
            "mistral",
            "MistralForCausalLM",
            read=_mistral,
            write=(_attention_bias, _window),
            tiny={"mistral": dict(sliding_window=6, num_kv_heads=1)},
            features="sliding-window attention",
        ),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            read=_qwen2,
            write=(_qwen_window,),
            tiny={"qwen2": dict(qkv_bias=True, **_QWEN_ROPE)},
            features="q/k/v bias, optional sliding window on upper layers",
        ),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            read=_qwen3,
            write=(_attention_bias, _qwen_window),
            tiny={"qwen3": dict(_TINY_QWEN3, tie_word_embeddings=True)},
            features="RMSNorm on q and k, explicit head_dim",
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            read=_qwen3_moe,
            write=(_attention_bias, _qwen_window, _moe_fields),
            tiny={
                "qwen3_moe": dict(
                    _TINY_QWEN3,
                    num_layers=3,
                    num_experts=4,
                    num_experts_per_tok=2,
                    moe_intermediate_size=48,
                    norm_topk_prob=True,
                    mlp_only_layers=(1,),
                    router_aux_loss_coef=0.001,
                )
            },
            features="mixture-of-experts MLPs with top-k routing and a load-balancing loss",
        ),
        Family(
            "gemma2",
            "Gemma2ForCausalLM",
            read=_gemma2,
            write=(_attention_bias, _gemma_fields),
            tiny={"gemma2": dict(_TINY_GEMMA, attn_softcap=50.0, final_softcap=30.0)},
            features="1 + w norms around attention and MLP, scaled embeddings, soft-capping, "
            "alternating sliding / global layers",
        ),
        Family(
            "gemma3_text",
            "Gemma3ForCausalLM",
            read=_gemma3_text,
            write=(_attention_bias, _gemma_fields),
            tiny={
                "gemma3": dict(
                    _TINY_GEMMA,
                    qk_norm=True,
                    rope_theta=1000000.0,
                    rope_scaling=(("factor", 8.0), ("rope_type", "linear")),
                    sliding_rope_theta=10000.0,
                )
            },
            features="Gemma 2's traits without attention soft-capping, q/k norms, a RoPE base "
            "of its own on sliding layers",
        ),
        Family(
            "phi3",
            "Phi3ForCausalLM",
            read=_phi3,
            write=(_window,),
            tiny={
                "phi3": dict(
                    fused_qkv=True, fused_gate_up=True, partial_rotary_factor=0.5, sliding_window=8
                )
            },
            features="fused qkv_proj / gate_up_proj in the checkpoint, partial rotary "
            "embeddings, sliding window",
        ),
    )
}
# model_type -> the HF architecture name config.json carries.
ARCHITECTURES: dict[str, str] = {t: f.architecture for t, f in FAMILIES.items()}
# tiny preset name -> (model_type, overrides): `dpojax.models.tiny`.
TINY_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    name: (t, preset) for t, f in FAMILIES.items() for name, preset in f.tiny.items()
}


def supported_architectures() -> str:
    return ", ".join(f"{arch} (model_type {mt!r})" for mt, arch in ARCHITECTURES.items())
