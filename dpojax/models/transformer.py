"""The decoder in Flax NNX: Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3
(text) and Phi-3, one module tree configured by `ModelConfig`.

`CausalLM(config, rngs=...)(tokens)` returns float32 logits [B, T, V]; `return_hidden=True` returns
the final (normed) hidden states [B, T, D] instead, so log-probs can be computed in chunks against
`lm_head_weight()` without materialising the full logits (`config.final_softcap` is then applied
to those logits by the caller). `return_router_logits=True` also returns each mixture-of-experts
layer's router logits, from which `load_balancing_loss` computes the auxiliary loss.

Why one module of this length: the decoder's blocks (attention, the MLP and the experts, the
layer, the scanned stack, the model) are one module tree whose parameter names are the
checkpoint's (`dpojax.models.hf_names`); the attention kernels, norms and layers live elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dpojax.errors import ConfigProblem
from dpojax.models import attention, quant
from dpojax.models.attention.context import order as context_order
from dpojax.models.attention.context import to_rows as context_to_rows
from dpojax.models.attention.rule import TokenIds
from dpojax.models.layers import (
    Dense,
    LoRAParam,
    QuantParam,
    RMSNorm,
    activation,
    apply_rope,
    rope_cos_sin,
    rope_inv_freq,
    softcap,
)
from dpojax.models.model_config import LORA_TARGETS, ModelConfig
from dpojax.models.scan import run_stack, stack_layers, unstacked_layers
from dpojax.models.sharding import ACTIVATION_RULES, constrain, context_size, spec_for

RESIDUAL = ("batch", "length", "embed")


def residual_spec(shape) -> jax.sharding.PartitionSpec:
    """The residual stream's layout on the current mesh."""
    return spec_for(RESIDUAL, shape, ACTIVATION_RULES, jax.sharding.get_abstract_mesh())


_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    # everything recomputed but the flash / Pallas attention's output and log-sum-exp: the
    # backward pass never reruns the attention kernel (the reference attention reruns in full)
    "attention": jax.checkpoint_policies.save_only_these_names("attention_out", "attention_lse"),
}


def _lora(config: ModelConfig, name: str) -> dict:
    """The Dense keywords of projection `name`: its LoRA adapter and its base's quantization."""
    kw = {}
    if config.quantization != "none":
        kw["quant"] = (config.quantization, config.quantization_block)
    if config.lora_rank and name in config.lora_targets:
        kw.update(lora_rank=config.lora_rank, lora_alpha=config.lora_alpha)
    return kw


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, hd = config.hidden_size, config.resolved_head_dim
        h, k = config.num_heads, config.num_kv_heads
        dt, pdt = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
        kw = dict(dtype=dt, param_dtype=pdt, rngs=rngs)
        self.q_proj = Dense(
            d,
            h * hd,
            axes=("embed", "heads"),
            use_bias=config.qkv_bias,
            **kw,
            **_lora(config, "q_proj"),
        )
        self.k_proj = Dense(
            d,
            k * hd,
            axes=("embed", "kv_heads"),
            use_bias=config.qkv_bias,
            **kw,
            **_lora(config, "k_proj"),
        )
        self.v_proj = Dense(
            d,
            k * hd,
            axes=("embed", "kv_heads"),
            use_bias=config.qkv_bias,
            **kw,
            **_lora(config, "v_proj"),
        )
        self.o_proj = Dense(
            h * hd,
            d,
            axes=("heads", "embed"),
            use_bias=config.o_bias,
            **kw,
            **_lora(config, "o_proj"),
        )
        if config.qk_norm:
            norm_kw = dict(
                eps=config.rms_norm_eps,
                axis_name="head_dim",
                dtype=dt,
                param_dtype=pdt,
                plus_one=config.norm_plus_one,
            )
            self.q_norm = RMSNorm(hd, **norm_kw)
            self.k_norm = RMSNorm(hd, **norm_kw)
        else:
            self.q_norm = self.k_norm = None
        self.num_heads, self.num_kv_heads, self.head_dim = h, k, hd
        scalar = config.query_pre_attn_scalar
        self.scale = float(scalar) ** -0.5 if scalar else hd**-0.5
        self.cap = config.attn_softcap

    def qkv(self, x, cos, sin, kv_length: str = "kv_length"):
        """Projected, normed (q/k norm) and rotated q [B, T, H, D], k and v [B, T, K, D]; k and
        v laid out along `kv_length` ("length": split like the queries, for an attention that
        gathers them itself)."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # queries keep the row split over the context axis; keys and values are gathered whole
        # (a no-op without a context axis): every query attends any earlier key of its row
        return (
            constrain(q, ("batch", "length", "heads", "head_dim")),
            constrain(k, ("batch", kv_length, "kv", "head_dim")),
            constrain(v, ("batch", kv_length, "kv", "head_dim")),
        )

    def __call__(self, x, rows: attention.Rows, cos, sin, sliding: bool):
        b, t, _ = x.shape
        kv_length = "length" if attention.gathers_keys(rows.implementation) else "kv_length"
        q, k, v = self.qkv(x, cos, sin, kv_length)
        out = attention.attend(rows, q, k, v, scale=self.scale, sliding=sliding, cap=self.cap)
        out = constrain(out, ("batch", "length", "heads", "head_dim"))
        return constrain(self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim)), RESIDUAL)


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        kw = dict(
            use_bias=config.mlp_bias,
            dtype=jnp.dtype(config.dtype),
            param_dtype=jnp.dtype(config.param_dtype),
            rngs=rngs,
        )
        self.gate_proj = Dense(d, f, axes=("embed", "mlp"), **kw, **_lora(config, "gate_proj"))
        self.up_proj = Dense(d, f, axes=("embed", "mlp"), **kw, **_lora(config, "up_proj"))
        self.down_proj = Dense(f, d, axes=("mlp", "embed"), **kw, **_lora(config, "down_proj"))
        self.act = activation(config.hidden_act)

    def __call__(self, x):
        h = constrain(self.act(self.gate_proj(x)) * self.up_proj(x), ("batch", "length", "mlp"))
        return constrain(self.down_proj(h), RESIDUAL)


class Experts(nnx.Module):
    """The experts of a mixture-of-experts layer, stacked: gate_proj and up_proj [E, D, F],
    down_proj [E, F, D]. Each token runs through its top-k experts only: the (token, expert)
    assignments are sorted by expert and each expert's rows are multiplied by its weights in one
    grouped matmul (`jax.lax.ragged_dot`)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        e, d, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
        pdt = jnp.dtype(config.param_dtype)

        def param(shape, axes):
            value = 0.02 * jax.random.normal(rngs.params(), shape)
            return nnx.Param(value.astype(pdt), logical_axes=axes)

        self.gate_proj = param((e, d, f), ("expert", "embed", "mlp"))
        self.up_proj = param((e, d, f), ("expert", "embed", "mlp"))
        self.down_proj = param((e, f, d), ("expert", "mlp", "embed"))
        self.dtype = jnp.dtype(config.dtype)
        self.act = activation(config.hidden_act)

    def __call__(self, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
        """x [N, D], each token's experts and routing weights [N, k] -> [N, D]."""
        n, k = experts.shape
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token = order // k
        sizes = jnp.bincount(flat, length=self.gate_proj.shape[0]).astype(jnp.int32)
        rows = x[token]

        def grouped(h, w):
            return jax.lax.ragged_dot(h, w[...].astype(self.dtype), sizes)

        h = self.act(grouped(rows, self.gate_proj)) * grouped(rows, self.up_proj)
        out = grouped(h, self.down_proj) * weights.reshape(-1)[order][:, None]
        return jnp.zeros((n, x.shape[-1]), out.dtype).at[token].add(out)


class MoE(nnx.Module):
    """A mixture-of-experts MLP (Qwen3-MoE): a linear router, softmax over the experts in
    float32, the top-k experts per token (their weights renormalised with `norm_topk_prob`)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        kw = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))
        self.gate = Dense(
            config.hidden_size, config.num_experts, axes=("embed", "expert"), rngs=rngs, **kw
        )
        self.experts = Experts(config, rngs=rngs)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(router logits [N, E], experts [N, k], weights [N, k]) of tokens x [N, D]."""
        logits = self.gate(x)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
        return logits, experts, weights.astype(logits.dtype)

    def forward(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, T, D] -> (output [B, T, D], router logits [B * T, E])."""
        flat = constrain(x.reshape(-1, x.shape[-1]).astype(self.experts.dtype), ("tokens", "embed"))
        logits, experts, weights = self.route(flat)
        out = constrain(self.experts(flat, experts, weights), ("tokens", "embed"))
        return constrain(out.reshape(x.shape), RESIDUAL), logits

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.forward(x)[0]


def load_balancing_loss(
    router_logits, num_experts: int, top_k: int, token_mask: jax.Array | None = None
) -> jax.Array:
    """The auxiliary load-balancing loss of the MoE layers (Switch Transformer's, as
    transformers computes it for Qwen3-MoE and Mixtral): E * sum_e f_e * P_e, where f_e is the
    share of top-k assignments and P_e the mean router probability of expert e, both pooled over
    every MoE layer's tokens (`token_mask` [N]: 1 for real tokens, 0 for padding)."""
    counts = jnp.zeros((num_experts,), jnp.float32)
    probs_sum = jnp.zeros((num_experts,), jnp.float32)
    rows = 0.0
    for logits in router_logits:
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        _, chosen = jax.lax.top_k(probs, top_k)
        assigned = jax.nn.one_hot(chosen, num_experts, dtype=jnp.float32).sum(1)
        if token_mask is not None:
            weight = token_mask.astype(jnp.float32)[:, None]
            assigned, probs = assigned * weight, probs * weight
            rows = rows + token_mask.astype(jnp.float32).sum()
        else:
            rows = rows + probs.shape[0]
        counts, probs_sum = counts + assigned.sum(0), probs_sum + probs.sum(0)
    rows = jnp.maximum(rows, 1.0)
    return num_experts * jnp.sum((counts / rows) * (probs_sum / rows))


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP blocks with residuals; Gemma also norms each block's output
    (`post_attention_layernorm`, `post_feedforward_layernorm`; the MLP's input norm is then
    `pre_feedforward_layernorm`)."""

    def __init__(self, config: ModelConfig, index: int, *, rngs: nnx.Rngs):
        norm_kw = dict(
            eps=config.rms_norm_eps,
            dtype=jnp.dtype(config.dtype),
            param_dtype=jnp.dtype(config.param_dtype),
            plus_one=config.norm_plus_one,
        )
        d = config.hidden_size
        self.input_layernorm = RMSNorm(d, **norm_kw)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, **norm_kw)
        if config.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(d, **norm_kw)
            self.post_feedforward_layernorm = RMSNorm(d, **norm_kw)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        self.mlp = MoE(config, rngs=rngs) if config.layer_is_moe(index) else MLP(config, rngs=rngs)
        self.sliding = config.layer_is_sliding(index)

    def add_attention(self, x: jax.Array, out: jax.Array) -> jax.Array:
        """The residual stream after the attention block whose output is `out`."""
        if self.post_feedforward_layernorm is not None:
            out = self.post_attention_layernorm(out)
        return x + out

    def add_mlp(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(residual stream after the MLP block, router logits of a MoE layer or None)."""
        sandwich = self.post_feedforward_layernorm is not None
        h = (self.pre_feedforward_layernorm if sandwich else self.post_attention_layernorm)(x)
        logits = None
        if isinstance(self.mlp, MoE):
            h, logits = self.mlp.forward(h)
        else:
            h = self.mlp(h)
        if sandwich:
            h = self.post_feedforward_layernorm(h)
        return x + h, logits

    def __call__(self, x, rows: attention.Rows, cos, sin):
        out = self.self_attn(self.input_layernorm(x), rows, cos, sin, self.sliding)
        return self.add_mlp(self.add_attention(x, out))


def _rematerialized(policy: Any) -> Callable:
    """`_layer_forward` under `jax.checkpoint` with `policy`, on the layer's state as a plain
    pytree (split, merged inside). `nnx.remat` on the module itself failed inside a
    `jax.lax.scan` (the micro-batches of train.grad_accum > 1) with flax's TraceContextError
    for the reference model merged in each micro-batch."""

    def forward(layer, x, rows, cos, sin):
        graphdef, state = nnx.split(layer)

        def pure(state, x, rows, cos, sin):
            return _layer_forward(nnx.merge(graphdef, state), x, rows, cos, sin)

        return jax.checkpoint(pure, policy=policy)(state, x, rows, cos, sin)

    return forward


def _layer_forward(layer: DecoderLayer, x, rows: attention.Rows, cos, sin):
    x, logits = layer(x, rows, cos, sin)
    return constrain(x, RESIDUAL), logits


class CausalLM(nnx.Module):
    """Decoder-only transformer with an LM head (tied to the embedding or separate)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        pdt = jnp.dtype(config.param_dtype)
        emb = 0.02 * jax.random.normal(rngs.params(), (config.vocab_size, config.hidden_size))
        self.embed_tokens = nnx.Param(emb.astype(pdt), logical_axes=("vocab", "embed"))
        layers = [DecoderLayer(config, i, rngs=rngs) for i in range(config.num_layers)]
        if config.scan_layers:  # stacked per kind, run by one scan (dpojax.models.scan)
            self.layers = None
            self.layer_stack = nnx.List(stack_layers(layers, config.scan_period()[0]))
        else:
            self.layers = nnx.List(layers)
            self.layer_stack = None
        self.norm = RMSNorm(
            config.hidden_size,
            eps=config.rms_norm_eps,
            dtype=jnp.dtype(config.dtype),
            param_dtype=pdt,
            plus_one=config.norm_plus_one,
        )
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            head = 0.02 * jax.random.normal(rngs.params(), (config.vocab_size, config.hidden_size))
            self.lm_head = nnx.Param(head.astype(pdt), logical_axes=("vocab", "embed"))

    def layer_list(self) -> list[DecoderLayer]:
        """The decoder layers in order, one module each (slices of the stacked parameters when
        the layers are scanned)."""
        if self.layer_stack is None:
            return list(self.layers)
        return unstacked_layers(self.layer_stack)

    def lm_head_weight(self) -> jax.Array:
        """The output projection [V, D] (the embedding when tied)."""
        return (self.embed_tokens if self.lm_head is None else self.lm_head)[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., V] from hidden states [..., D] (soft-capped when the family
        does)."""
        w = self.lm_head_weight().astype(hidden.dtype)
        flat = hidden.reshape(-1, hidden.shape[-1])  # a 2-D dot, as in `Dense`
        logits = jnp.einsum("nd,vd->nv", flat, w, preferred_element_type=jnp.float32)
        logits = softcap(logits, self.config.final_softcap)
        return logits.reshape(*hidden.shape[:-1], w.shape[0])

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token embeddings [B, T, D] in the compute dtype (times sqrt(D) for Gemma)."""
        dtype = jnp.dtype(self.config.dtype)
        x = jnp.take(self.embed_tokens[...], tokens, axis=0).astype(dtype)
        if self.config.embed_scale:
            x = x * jnp.asarray(self.config.hidden_size**0.5, self.embed_tokens.dtype).astype(dtype)
        return x

    def rope_tables(self, positions: jax.Array) -> dict[bool, tuple[jax.Array, jax.Array]]:
        """cos / sin tables for the positions int[B, T], by layer kind (sliding or not: Gemma 3's
        sliding layers have their own RoPE base)."""
        c = self.config
        dtype = jnp.dtype(c.dtype)
        inv_freq = rope_inv_freq(c.rotary_dim, c.rope_theta, c.rope_params)
        tables = {False: rope_cos_sin(positions, inv_freq, dtype)}
        if c.sliding_rope_theta is not None:
            local = rope_inv_freq(c.rotary_dim, c.sliding_rope_theta, {"rope_type": "default"})
            tables[True] = rope_cos_sin(positions, local, dtype)
        else:
            tables[True] = tables[False]
        return tables

    def __call__(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        parts: jax.Array | None = None,
        return_hidden: bool = False,
        return_router_logits: bool = False,
    ):
        """tokens int[B, T] -> float32 logits [B, T, V] (or hidden states [B, T, D]); with
        `return_router_logits`, a pair of that and a tuple of each MoE layer's router logits
        [B * T, E].

        `positions`, `segment_ids` and `parts` (all int[B, T]) describe packed or prefix-shared
        rows (docs/layouts.md); left out, the row is one causal sequence at positions 0..T-1.
        """
        config = self.config
        b, t = tokens.shape
        ids = TokenIds.of(b, t, positions=positions, segment_ids=segment_ids, parts=parts)
        platform = config.target_platform or None
        plain = segment_ids is None and parts is None  # one causal sequence per row
        implementation = attention.choose(config, platform, length=t, plain=plain)
        # causal load balancing on split rows: the tokens in the order the context devices hold
        # them, back in row order after the last layer
        balanced = attention.balances(implementation, t, experts=bool(config.num_experts))
        if balanced:
            held = context_order(t, context_size())
            tokens = tokens[:, held]
            ids = TokenIds(*(x[:, held] for x in ids))
        rows = attention.rows(
            implementation, ids, config.sliding_window, platform=platform,
            block=config.attention_block or None, balanced=balanced,
        )  # fmt: skip
        tables = self.rope_tables(ids.positions)
        x = constrain(self.embed(tokens), RESIDUAL)
        router_logits = []
        if self.layer_stack is not None:
            policy = _REMAT_POLICIES.get(config.remat)
            remat = config.remat != "none"
            x, router_logits = run_stack(
                self.layer_stack, x, _layer_forward, tables, rows, policy, remat
            )
        else:
            forward = _layer_forward
            if config.remat != "none":
                forward = _rematerialized(_REMAT_POLICIES[config.remat])
            for layer in self.layers:
                x, logits = forward(layer, x, rows, *tables[layer.sliding])
                if logits is not None:
                    router_logits.append(logits)
        if balanced:
            x = context_to_rows(constrain(x, RESIDUAL), residual_spec(x.shape))
        x = self.norm(x)
        out = x if return_hidden else self.logits(x)
        return (out, tuple(router_logits)) if return_router_logits else out


def init_model(config: ModelConfig, seed: int = 0) -> CausalLM:
    """A randomly initialised model (normal(0.02) weights, unit norms, zero biases)."""
    return CausalLM(config, rngs=nnx.Rngs(params=seed, lora=seed + 1))


def abstract_model(config: ModelConfig) -> CausalLM:
    """The model with ShapeDtypeStruct leaves: no memory, no compute (for sharding and loading)."""
    return nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(params=0, lora=1)))


def add_lora(
    model: CausalLM,
    rank: int,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    seed: int = 0,
) -> CausalLM:
    """A model sharing `model`'s base weights with fresh LoRA adapters (lora_b = 0, so its outputs
    equal the base model's). Only the adapter factors are allocated."""
    config = model.config.replace(lora_rank=rank, lora_alpha=alpha, lora_targets=tuple(targets))
    graphdef = nnx.graphdef(abstract_model(config))

    @jax.jit
    def init_adapters():
        fresh = CausalLM(config, rngs=nnx.Rngs(params=0, lora=seed))
        return nnx.state(fresh, LoRAParam)

    lora = init_adapters()  # XLA drops the unused base initialisation
    return nnx.merge(graphdef, lora, nnx.state(model, nnx.Param))


PROJECTIONS = LORA_TARGETS  # the attention and MLP projections, the ones a base quantizes


def _tensor_name(path: tuple) -> str:
    return "/".join(map(str, path))


def is_quantized_kernel(path: tuple) -> bool:
    """Whether the parameter at `path` is a kernel that `quantize_model` stores quantized."""
    return len(path) >= 2 and path[-1] == "kernel" and path[-2] in PROJECTIONS


def check_quant_block(path: tuple, shape: tuple[int, ...], scheme: str, block: int) -> None:
    """A `ConfigProblem` naming the kernel at `path` when `block` does not cut its input size."""
    problem = quant.block_problem(shape[-2], scheme, block)
    if problem:
        raise ConfigProblem(
            f"config key 'model.quantization_block': {_tensor_name(path)} {shape}: {problem}"
        )


def quantize_model(model: CausalLM, scheme: str, block: int = 64, *, free: bool = False):
    """`model` with the kernels of its attention and MLP projections stored quantized
    (`dpojax.models.quant`: codes and scales as `QuantParam`s); embeddings, norms, biases, the LM
    head, LoRA adapters and mixture-of-experts weights are shared unchanged. With `free`, each
    float kernel's buffer is deleted once quantized (`model` is then unusable), so the float and
    quantized models are never both held. A block that does not cut a projection's input is a
    `ConfigProblem` naming the tensor."""
    if scheme == "none" or model.config.quantization != "none":
        return model
    flat = []
    fn = jax.jit(quant.quantize, static_argnums=(1, 2))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if not is_quantized_kernel(path):
            flat.append((path, var))
            continue
        check_quant_block(path, tuple(var.shape), scheme, block)
        value = var.get_value()
        codes, scales = fn(value, scheme, block)
        meta = var.get_metadata()
        flat.append((path[:-1] + ("codes",), QuantParam(codes, **meta)))
        flat.append((path[:-1] + ("scales",), QuantParam(scales, **meta)))
        if free:
            value.delete()
    config = model.config.replace(quantization=scheme, quantization_block=block)
    return nnx.merge(nnx.graphdef(abstract_model(config)), nnx.from_flat_state(flat))


def dequantize_model(model: CausalLM, dtype: str | None = None) -> CausalLM:
    """The float model of a quantized one: each projection's kernel dequantized (in float32,
    stored in `dtype`, default the parameter dtype); unchanged when not quantized."""
    config = model.config
    if config.quantization == "none":
        return model
    dtype = jnp.dtype(dtype or config.param_dtype)
    fn = jax.jit(quant.dequantize, static_argnums=(2, 3))
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    out = []
    for path, var in flat.items():
        if path[-1] == "scales":
            continue
        if path[-1] == "codes":
            scales = flat[path[:-1] + ("scales",)].get_value()
            scheme, block = config.quantization, config.quantization_block
            kernel = fn(var.get_value(), scales, scheme, block).astype(dtype)
            var = nnx.Param(kernel, **var.get_metadata())
            path = path[:-1] + ("kernel",)
        out.append((path, var))
    plain = config.replace(quantization="none")
    return nnx.merge(nnx.graphdef(abstract_model(plain)), nnx.from_flat_state(out))


def merge_lora(model: CausalLM) -> CausalLM:
    """A plain model (no adapters) whose kernels are W + lora_a @ lora_b * alpha / rank (a
    quantized base dequantized first, in the parameter dtype)."""
    model = dequantize_model(model)
    config = model.config
    if not config.lora_rank:
        return model
    plain = config.replace(lora_rank=0)
    merged = []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if isinstance(var, LoRAParam):
            continue
        value = var.get_value()
        if path[-1] == "kernel" and path[-2] in config.lora_targets:
            owner = model
            for key in path[:-1]:
                owner = owner[key] if isinstance(key, int) else getattr(owner, key)
            delta = jnp.matmul(  # batched over the stacked layers' axis when scanned
                owner.lora_a[...].astype(jnp.float32), owner.lora_b[...].astype(jnp.float32)
            )
            value = (value.astype(jnp.float32) + delta * owner.lora_scale).astype(value.dtype)
        merged.append((path, var.replace(value)))
    return nnx.merge(nnx.graphdef(abstract_model(plain)), nnx.from_flat_state(merged))
