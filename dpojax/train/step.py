"""The DPO train step: a pure function `(state, batch) -> (state, metrics)`, jitted once per shape.

Policy forward on the whole batch (chosen and rejected completions together, in any layout of
`dpojax.train.logprobs`) with gradient; reference forward outside the differentiated function
(or skipped when the batch carries precomputed reference log-probs); the preference loss; an optax
update. Every batch array has a leading micro-batch axis [k, ...]; the step scans over it and
accumulates gradients and metric *sums*, normalising by the global number of pairs, so k
micro-batches give the same update as one batch of k times the size.

Reference strategies:
  frozen       a separate copy of parameters (the initial policy or another checkpoint), no
               gradient, no optimizer state
  lora_base    the policy is base + LoRA adapters and only the adapters train; the reference is
               the base (adapters off)
  precomputed  the batch carries `ref_chosen_logps` / `ref_rejected_logps` [k, P]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpojax.models.layers import LoRAParam
from dpojax.models.sharding import DEFAULT_RULES, MeshAxes, spec_for
from dpojax.models.transformer import CausalLM
from dpojax.train.logprobs import completion_sums, token_logps
from dpojax.train.losses import finalize_metrics, preference_loss, wpo_pair_weights

REFERENCE_TYPES = ("frozen", "lora_base", "precomputed")
MODEL_KEYS = ("tokens", "positions", "segment_ids", "parts")
BATCH_AXES = ("data", "fsdp")
# The batch arrays the step reads (see dpojax.train.logprobs for their meaning).
STEP_KEYS = (
    *MODEL_KEYS,
    "pred_index",
    "completion_ids",
    "completion_pos",
    "completion_mask",
    "chosen_index",
    "rejected_index",
    "pair_mask",
    "ref_chosen_logps",
    "ref_rejected_logps",
    "score_slots",
)
# `score_slots` widths are multiples of this (fewer distinct shapes, fewer compilations).
SCORE_SLOT_MULTIPLE = 64


@flax.struct.dataclass
class TrainState:
    """Everything a step reads and writes. `params` are the trainable parameters (all of them, or
    the LoRA adapters); `frozen` the rest of the policy; `ref` the frozen reference parameters
    (None for lora_base and precomputed)."""

    step: jax.Array
    params: nnx.State
    frozen: nnx.State
    ref: nnx.State | None
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of the step. `loss` holds keyword arguments of `preference_loss` (static
    ones only: loss_type, beta, label_smoothing, f_divergence, ...)."""

    reference: str = "frozen"
    loss: tuple[tuple[str, Any], ...] = (("loss_type", "sigmoid"), ("beta", 0.1))
    vocab_chunk: int | None = 4096
    ld_alpha: float | None = None
    use_weighting: bool = False
    skip_nonfinite: bool = False

    def __post_init__(self):
        if self.reference not in REFERENCE_TYPES:
            raise ValueError(f"reference must be one of {REFERENCE_TYPES}, got {self.reference!r}")

    @classmethod
    def create(cls, loss: Mapping[str, Any] | None = None, **kw) -> StepConfig:
        items = tuple(
            sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in (loss or {}).items())
        )
        return cls(loss=items or cls.loss, **kw)

    @property
    def loss_kwargs(self) -> dict[str, Any]:
        return {
            k: list(v) if k in ("loss_type", "loss_weights") and isinstance(v, tuple) else v
            for k, v in self.loss
        }

    @property
    def needs_sft_tokens(self) -> bool:
        types = self.loss_kwargs.get("loss_type", "sigmoid")
        return "sft" in ([types] if isinstance(types, str) else types)


# ---------------------------------------------------------------------------------------------
# state


def split_policy(model: CausalLM) -> tuple[nnx.GraphDef, nnx.State, nnx.State, bool]:
    """(graphdef, trainable, frozen, is_lora): the LoRA adapters train when the model has any."""
    graphdef, lora, base = nnx.split(model, LoRAParam, nnx.Param)
    if model.config.lora_rank:
        return graphdef, lora, base, True
    return graphdef, base, lora, False


def create_train_state(
    model: CausalLM,
    optimizer: optax.GradientTransformation,
    step_config: StepConfig,
    *,
    reference: CausalLM | None = None,
) -> tuple[nnx.GraphDef, TrainState]:
    """The graph definition and initial state. For `reference="frozen"` the reference is
    `reference`'s parameters, or a copy of the initial policy parameters when None."""
    graphdef, params, frozen, is_lora = split_policy(model)
    ref = None
    if step_config.reference == "lora_base":
        if not is_lora:
            raise ValueError(
                "reference.type 'lora_base' needs a policy with LoRA adapters (set lora.rank > 0)"
            )
        nonzero = [
            "/".join(map(str, p))
            for p, v in nnx.to_flat_state(params)
            if p[-1] == "lora_b" and bool(jnp.any(v.get_value() != 0))
        ]
        if nonzero:
            raise ValueError(
                f"LoRA reference: adapter factor lora_b must start at zero so that step 0 has "
                f"policy == reference (loss ln 2); non-zero: {nonzero[:3]}"
            )
    elif step_config.reference == "frozen":
        if reference is not None:
            ref = nnx.split(reference, LoRAParam, nnx.Param)[2]
        else:
            base = frozen if is_lora else params
            ref = jax.tree.map(jnp.copy, base)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        frozen=frozen,
        ref=ref,
        opt_state=optimizer.init(params),
    )
    return graphdef, state


def policy_model(graphdef: nnx.GraphDef, state: TrainState, is_lora: bool) -> CausalLM:
    if is_lora:
        return nnx.merge(graphdef, state.params, state.frozen)
    return nnx.merge(graphdef, state.frozen, state.params)


# ---------------------------------------------------------------------------------------------
# forward


def _ld_weights(batch, counts, alpha):
    """LD-DPO token weights: 1 for the first min(nc, nr) tokens of a completion, alpha after."""
    chosen, rejected = batch["chosen_index"], batch["rejected_index"]
    partner = jnp.zeros_like(counts)
    partner = partner.at[chosen].set(counts[rejected]).at[rejected].set(counts[chosen])
    ids = jnp.maximum(batch["completion_ids"], 0)
    limit = jnp.minimum(counts, partner)[ids]
    return jnp.where(batch["completion_pos"] < limit, 1.0, alpha)


def score_slots(completion_ids: np.ndarray, multiple: int = SCORE_SLOT_MULTIPLE) -> np.ndarray:
    """Each row's scored positions (`completion_ids >= 0`), in order, padded with -1: int32
    [..., R, S] for `completion_ids` [..., R, L]. S is the most any row has, rounded up to a
    multiple of `multiple` and at most L.

    With them (batch key `score_slots`) the step runs the LM head and the log-softmax over S slots
    per row instead of L: prompt tokens are never scored, and on agent data (long prompts, short
    completions) they are most of the row."""
    scored = np.asarray(completion_ids) >= 0
    length = scored.shape[-1]
    most = int(scored.sum(-1).max(initial=0))
    width = min(length, max(multiple, -(-most // multiple) * multiple))
    order = np.argsort(~scored, axis=-1, kind="stable")[..., :width]
    return np.where(np.take_along_axis(scored, order, -1), order, -1).astype(np.int32)


def with_score_slots(batch: Mapping[str, Any]) -> dict[str, Any]:
    """`batch` plus `score_slots` (see `score_slots`) when they are fewer than the row length;
    `batch` unchanged when every slot would be kept."""
    slots = score_slots(batch["completion_ids"])
    if slots.shape[-1] >= np.shape(batch["completion_ids"])[-1]:
        return dict(batch)
    return {**batch, "score_slots": slots}


def step_arrays(batch: Mapping[str, Any]) -> dict[str, jax.Array]:
    """The arrays of a host batch that the step reads (`STEP_KEYS`), with `score_slots` added
    when the batch has none (see `with_score_slots`)."""
    if "score_slots" not in batch:
        batch = with_score_slots(batch)
    return {k: jnp.asarray(v) for k, v in batch.items() if k in STEP_KEYS}


def _scored_view(batch: Mapping[str, jax.Array]) -> Mapping[str, jax.Array]:
    """The per-token arrays at the batch's `score_slots` ([R, S] instead of [R, L]); the batch
    itself when it has none."""
    if "score_slots" not in batch:
        return batch
    slots = batch["score_slots"]
    index = jnp.maximum(slots, 0)
    view = dict(batch)
    for key in ("tokens", "pred_index", "completion_ids", "completion_pos"):
        if key in batch:
            taken = jnp.take_along_axis(batch[key], index, axis=1)
            view[key] = jnp.where(slots >= 0, taken, -1) if key.startswith("completion") else taken
    return view


def completion_logps(
    model: CausalLM, batch: Mapping[str, jax.Array], cfg: StepConfig
) -> dict[str, jax.Array]:
    """Per-completion log-prob sums and token counts [C] (and WPO log-weights) for one batch.
    The model runs on the whole rows; the LM head only on the batch's `score_slots` if any."""
    num_completions = _num_completions(batch)
    hidden = model(
        batch["tokens"],
        positions=batch["positions"],
        segment_ids=batch["segment_ids"],
        parts=batch["parts"],
        return_hidden=True,
    )
    batch = _scored_view(batch)
    out = token_logps(
        hidden,
        model.lm_head_weight(),
        batch["tokens"],
        batch["pred_index"],
        vocab_chunk=cfg.vocab_chunk,
        with_log_sum_p_sq=cfg.use_weighting,
    )
    lp, lsq = out if cfg.use_weighting else (out, None)
    _, counts = completion_sums(jnp.zeros_like(lp), batch["completion_ids"], num_completions)
    weighted = lp
    if cfg.ld_alpha is not None:
        weighted = lp * _ld_weights(batch, counts, cfg.ld_alpha)
    sums, _ = completion_sums(weighted, batch["completion_ids"], num_completions)
    result = {"sums": sums, "counts": counts}
    if lsq is not None:
        wsum, _ = completion_sums(
            jax.lax.stop_gradient(lp - lsq), batch["completion_ids"], num_completions
        )
        result["wpo_log_w"] = wsum / jnp.maximum(counts, 1.0)
    return result


def _num_completions(batch) -> int:
    """Static number of completion slots: the length of `completion_mask` [C] when the batch has
    one (grouped layouts), else 2 per pair."""
    if "completion_mask" in batch:
        return int(batch["completion_mask"].shape[-1])
    return 2 * batch["chosen_index"].shape[-1]


def pair_losses(
    policy: Mapping[str, jax.Array],
    ref_chosen: jax.Array,
    ref_rejected: jax.Array,
    batch: Mapping[str, jax.Array],
    cfg: StepConfig,
    sft_tokens_per_pair: jax.Array | None,
):
    """(per-pair losses, metric sums) from per-completion policy results and reference logps."""
    ci, ri = batch["chosen_index"], batch["rejected_index"]
    kwargs = cfg.loss_kwargs
    weights = None
    if cfg.use_weighting:
        w = jnp.exp(policy["wpo_log_w"])
        weights = wpo_pair_weights(w[ci], w[ri])
    if sft_tokens_per_pair is not None:
        kwargs["sft_tokens_per_pair"] = sft_tokens_per_pair
    return preference_loss(
        policy["sums"][ci],
        policy["sums"][ri],
        ref_chosen,
        ref_rejected,
        chosen_lengths=policy["counts"][ci],
        rejected_lengths=policy["counts"][ri],
        pair_mask=batch["pair_mask"],
        weights=weights,
        metrics_as_sums=True,
        **kwargs,
    )


# ---------------------------------------------------------------------------------------------
# the step


def _micro(batch: Mapping[str, jax.Array], i) -> dict[str, jax.Array]:
    return {k: v[i] for k, v in batch.items()}


def reference_logps(
    graphdef: nnx.GraphDef,
    state: TrainState,
    batch: Mapping[str, jax.Array],
    cfg: StepConfig,
    is_lora: bool,
) -> tuple[jax.Array, jax.Array]:
    """Reference sequence log-probs (chosen, rejected) [P] of one micro-batch, no gradient."""
    if cfg.reference == "precomputed":
        return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
    # Adapters off: LoRA factors zero (a policy without LoRA has an empty adapter state).
    adapters_off = jax.tree.map(jnp.zeros_like, state.params) if is_lora else state.frozen
    base = state.frozen if cfg.reference == "lora_base" else state.ref
    model = nnx.merge(graphdef, adapters_off, base)
    ref_cfg = dataclasses.replace(cfg, use_weighting=False)
    out = jax.lax.stop_gradient(completion_logps(model, batch, ref_cfg))
    return out["sums"][batch["chosen_index"]], out["sums"][batch["rejected_index"]]


def train_step(
    state: TrainState,
    batch: Mapping[str, jax.Array],
    *,
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule | None,
    cfg: StepConfig,
    is_lora: bool,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update from a batch with a leading micro-batch axis [k, ...]."""
    num_micro = batch["pair_mask"].shape[0]
    total_pairs = jnp.maximum(batch["pair_mask"].sum(), 1.0)
    sft_tokens = None
    if cfg.needs_sft_tokens:
        chosen_tokens = 0.0
        for i in range(num_micro):
            mb = _micro(batch, i)
            _, counts = completion_sums(
                jnp.zeros(mb["tokens"].shape), mb["completion_ids"], _num_completions(mb)
            )
            chosen_tokens += (counts[mb["chosen_index"]] * mb["pair_mask"]).sum()
        sft_tokens = chosen_tokens / total_pairs

    def loss_fn(params, mb, ref_c, ref_r):
        model = policy_model(graphdef, state.replace(params=params), is_lora)
        policy = completion_logps(model, mb, cfg)
        per_pair, sums = pair_losses(policy, ref_c, ref_r, mb, cfg, sft_tokens)
        sums["tokens"] = (mb["segment_ids"] > 0).sum().astype(jnp.float32)
        return per_pair.sum() / total_pairs, sums

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def accumulate(carry, mb):
        grads, sums = carry
        ref_c, ref_r = reference_logps(graphdef, state, mb, cfg, is_lora)
        (_, mb_sums), mb_grads = grad_fn(state.params, mb, ref_c, ref_r)
        grads = jax.tree.map(jnp.add, grads, mb_grads)
        sums = mb_sums if sums is None else jax.tree.map(jnp.add, sums, mb_sums)
        return grads, sums

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    first = _micro(batch, 0)
    grads, sums = accumulate((zeros, None), first)
    if num_micro > 1:
        rest = {k: v[1:] for k, v in batch.items()}
        (grads, sums), _ = jax.lax.scan(
            lambda c, mb: (accumulate(c, mb), None), (grads, sums), rest
        )

    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    metrics = finalize_metrics(sums)
    metrics["tokens"] = sums["tokens"]
    metrics["pairs"] = sums["count"]
    metrics["grad_norm"] = grad_norm
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    metrics["nonfinite"] = (~finite).astype(jnp.float32)
    if schedule is not None:
        metrics["learning_rate"] = schedule(state.step)
    new_state = state.replace(step=state.step + 1, params=new_params, opt_state=opt_state)
    if cfg.skip_nonfinite:
        new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
    return new_state, metrics


def eval_step(
    state: TrainState,
    batch: Mapping[str, jax.Array],
    *,
    graphdef: nnx.GraphDef,
    cfg: StepConfig,
    is_lora: bool,
) -> dict[str, jax.Array]:
    """Per-pair log-probs and losses of one batch (no micro-batch axis) and metric sums."""
    ref_c, ref_r = reference_logps(graphdef, state, batch, cfg, is_lora)
    policy = completion_logps(policy_model(graphdef, state, is_lora), batch, cfg)
    per_pair, sums = pair_losses(policy, ref_c, ref_r, batch, cfg, None)
    ci, ri = batch["chosen_index"], batch["rejected_index"]
    return {
        "policy_chosen_logps": policy["sums"][ci],
        "policy_rejected_logps": policy["sums"][ri],
        "ref_chosen_logps": ref_c,
        "ref_rejected_logps": ref_r,
        "losses": per_pair,
        "sums": sums,
    }


# ---------------------------------------------------------------------------------------------
# jit + sharding


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(tree: nnx.State, mesh: Mesh, rules: Mapping[str, MeshAxes]) -> nnx.State:
    """NamedSharding for every Variable of a State, from its logical axes."""
    return jax.tree.map(
        lambda v: v.replace(
            NamedSharding(
                mesh, spec_for(v.get_metadata().get("logical_axes"), v.shape, rules, mesh)
            )
        ),
        tree,
        is_leaf=_is_variable,
    )


def state_shardings(
    state: TrainState,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rules: Mapping[str, MeshAxes] = DEFAULT_RULES,
) -> TrainState:
    """Shardings of every leaf of the train state: parameters (and optimizer moments shaped like
    them) from logical axes, everything else replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    params = param_shardings(state.params, mesh, rules)
    opt = optax.tree_map_params(
        optimizer,
        lambda _, s: s,
        state.opt_state,
        params,
        transform_non_params=lambda _: replicated,
        is_leaf=_is_variable,
    )
    return TrainState(
        step=replicated,
        params=params,
        frozen=param_shardings(state.frozen, mesh, rules),
        ref=None if state.ref is None else param_shardings(state.ref, mesh, rules),
        opt_state=opt,
    )


def batch_sharding(batch: Mapping[str, Any], mesh: Mesh, *, micro_axis: bool = True) -> dict:
    """Batch arrays sharded over (data, fsdp) on the row / pair axis."""
    lead = (None,) if micro_axis else ()
    return {k: NamedSharding(mesh, PartitionSpec(*lead, BATCH_AXES)) for k in batch}


def check_batch_divisible(batch: Mapping[str, Any], mesh: Mesh, *, micro_axis: bool = True):
    n = mesh.shape["data"] * mesh.shape["fsdp"]
    axis = 1 if micro_axis else 0
    for k, v in batch.items():
        if v.shape[axis] % n:
            raise ValueError(
                f"batch array {k!r} has {v.shape[axis]} rows, not divisible by the {n} "
                "data-parallel devices (mesh.data * mesh.fsdp); change train.batch_size or the mesh"
            )


@dataclasses.dataclass
class Stepper:
    """The jitted train and eval steps for one model / optimizer / config, optionally sharded."""

    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule | None
    cfg: StepConfig
    is_lora: bool
    mesh: Mesh | None = None
    rules: Mapping[str, MeshAxes] = dataclasses.field(default_factory=lambda: dict(DEFAULT_RULES))

    def __post_init__(self):
        self._train_fn = functools.partial(
            train_step,
            graphdef=self.graphdef,
            optimizer=self.optimizer,
            schedule=self.schedule,
            cfg=self.cfg,
            is_lora=self.is_lora,
        )
        self._eval_fn = functools.partial(
            eval_step, graphdef=self.graphdef, cfg=self.cfg, is_lora=self.is_lora
        )
        self._train = jax.jit(self._train_fn, donate_argnums=0)
        self._eval = jax.jit(self._eval_fn)

    def shard_state(self, state: TrainState) -> TrainState:
        """Places the state on the mesh (no-op without one) and pins the step's output state to
        the same shardings, so that consecutive steps never recompile."""
        if self.mesh is None:
            return state
        shardings = state_shardings(state, self.optimizer, self.mesh, self.rules)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        self._train = jax.jit(
            self._train_fn, donate_argnums=0, out_shardings=(shardings, replicated)
        )
        return jax.device_put(state, shardings)

    def _put(self, batch, micro_axis):
        batch = step_arrays(batch)
        if self.mesh is None:
            return batch
        check_batch_divisible(batch, self.mesh, micro_axis=micro_axis)
        return jax.device_put(batch, batch_sharding(batch, self.mesh, micro_axis=micro_axis))

    def train(self, state: TrainState, batch: Mapping[str, Any]):
        """One update; `batch` arrays have a leading micro-batch axis."""
        with _mesh_context(self.mesh):
            return self._train(state, self._put(batch, True))

    def evaluate(self, state: TrainState, batch: Mapping[str, Any]):
        with _mesh_context(self.mesh):
            return self._eval(state, self._put(batch, False))

    def train_cache_size(self) -> int:
        return self._train._cache_size()


def _mesh_context(mesh: Mesh | None):
    import contextlib

    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
