"""The train state and the step's static settings.

`TrainState` holds everything a step reads and writes; `StepConfig` the settings that are fixed
for a run (the reference, the loss and its options). The reference is a typed choice
(`dpojax.train.reference_choice`):

  FrozenReference       a separate copy of parameters (the initial policy or another
                        checkpoint), no gradient, no optimizer state
  LoraBaseReference     the policy is base + LoRA adapters and only the adapters train; the
                        reference is the base (adapters off)
  PrecomputedReference  the batch carries `ref_chosen_logps` / `ref_rejected_logps` [k, P]

TR-DPO (the reference's `sync`): every N steps the step mixes the reference toward the
policy, ref = alpha * policy + (1 - alpha) * ref (`sync_reference`). A frozen reference mixes its
weights; a LoRA policy's reference also holds a snapshot of the adapters (`ref_adapters`, mixed
factor by factor; they start as the initial adapters, so lora_base starts at the base). A
reference that moves is part of every checkpoint (`TrainState.ref_moves`).

`state_shardings` places every leaf on a mesh from the parameters' logical axes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpojax.models.layers import LoRAParam
from dpojax.models.sharding import DEFAULT_RULES, MeshAxes, spec_for
from dpojax.models.transformer import CausalLM
from dpojax.train.kto import RUNNING_MOMENTS, UNPAIRED_LOSS_TYPES, RunningMoments
from dpojax.train.loss_settings import LossSettings
from dpojax.train.loss_terms import NLL_LOSSES
from dpojax.train.reference_choice import (
    FrozenReference,
    LoraBaseReference,
    PrecomputedReference,
    Reference,
)


@flax.struct.dataclass
class TrainState:
    """Everything a step reads and writes. `params` are the trainable parameters (all of them, or
    the LoRA adapters); `frozen` the rest of the policy; `ref` the frozen reference parameters
    (None for lora_base and precomputed); `ref_adapters` the reference's LoRA adapters under
    TR-DPO (None otherwise: the reference runs with the adapters off). `moments`: bco's running
    reward moments (`dpojax.train.kto.RunningMoments`; None for every other loss), saved in
    checkpoints when present. `ref_moves`: TR-DPO mixes the reference during training, so
    checkpoints hold it."""

    step: jax.Array
    params: nnx.State
    frozen: nnx.State
    ref: nnx.State | None
    opt_state: Any
    ref_adapters: nnx.State | None = None
    moments: RunningMoments | None = None
    ref_moves: bool = flax.struct.field(pytree_node=False, default=False)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of the step. `loss` is the config's loss group as it is (the loss types and
    their hyperparameters, LD-DPO's `ld_alpha` and WPO's `use_weighting` among them)."""

    reference: Reference = FrozenReference()
    loss: LossSettings = LossSettings()
    vocab_chunk: int | None = 4096
    skip_nonfinite: bool = False
    # Weight of the mixture-of-experts load-balancing loss added to the policy's loss (0: off).
    router_aux_coef: float = 0.0
    # The policy's token metrics (entropy, mean_token_accuracy, logits/chosen, logits/rejected),
    # from the log-prob pass over the vocabulary (forward.TOKEN_METRICS).
    token_metrics: bool = False
    # The NLL terms (sft, orpo, cpo) average the log-probs of the chosen sequences' prompt and
    # completion tokens, as TRL's ORPOTrainer (loss.orpo_nll_prompt); the LM head then runs on
    # every position of the rows (no score slots). Only orpo's steps set it.
    nll_prompt: bool = False

    def __post_init__(self):
        if not isinstance(
            self.reference, FrozenReference | LoraBaseReference | PrecomputedReference
        ):
            raise TypeError(f"reference must be a reference_choice record, got {self.reference!r}")
        if self.reference.sync is not None and self.reference_free:
            raise ValueError(
                "reference syncing (TR-DPO) needs a reference, but the loss is reference-free"
            )

    @property
    def reference_free(self) -> bool:
        """The loss takes the reference log-probs as 0 (`loss.reference_free`): no reference
        parameters are held and no reference pass is compiled or run."""
        return self.loss.without_reference

    @property
    def reference_forward(self) -> bool:
        """A step runs the reference model's forward pass: not for a precomputed reference (its
        log-probs ride in the batch) nor for a reference-free loss (its log-probs are 0)."""
        return self.reference.runs_forward and not self.reference_free

    @property
    def unpaired(self) -> bool:
        """The loss is an unpaired one (kto, apo_zero_unpaired, bco): batches carry `labels`
        and each "pair" is an example's completion and its KL completion (`dpojax.train.kto`)."""
        return self.loss.types[0] in UNPAIRED_LOSS_TYPES

    @property
    def running_moments(self) -> bool:
        """The loss keeps running reward moments in the train state (bco)."""
        return self.loss.types[0] in RUNNING_MOMENTS

    @property
    def needs_sft_tokens(self) -> bool:
        """Whether a loss holds TRL `sft`'s NLL (sft, orpo, cpo), a token mean over the step."""
        return bool(set(self.loss.types) & NLL_LOSSES)

    @property
    def ld_alpha(self) -> float | None:
        """LD-DPO's weight of the tokens past the shorter completion; None for DPO (1)."""
        return None if self.loss.ld_alpha == 1.0 else float(self.loss.ld_alpha)


def split_policy(model: CausalLM) -> tuple[nnx.GraphDef, nnx.State, nnx.State, bool]:
    """(graphdef, trainable, frozen, is_lora): the LoRA adapters train when the model has any."""
    graphdef, lora, base = nnx.split(model, LoRAParam, nnx.Param)
    if model.config.lora_rank:
        return graphdef, lora, base, True
    return graphdef, base, lora, False


def _nonzero(value: jax.Array) -> bool:
    """Whether a concrete array has a non-zero entry; False for abstract values (tracers, as in
    `jax.eval_shape`), whose contents are unknown."""
    if isinstance(value, jax.core.Tracer):
        return False
    return bool(jnp.any(value != 0))


def reference_dtype(config, moves: bool = False) -> jnp.dtype | None:
    """The dtype the frozen reference's floating-point parameters are kept in: the compute dtype
    on accelerators (a frozen copy needs no float32 master: the forward pass casts every weight to
    the compute dtype anyway), None (the policy's own dtypes) on a CPU, whose runs stay exact, and
    for a reference that `moves` (TR-DPO: repeated mixing in bfloat16 would lose the small
    steps)."""
    if moves:
        return None
    platform = config.target_platform or jax.default_backend()
    return None if platform == "cpu" else jnp.dtype(config.dtype)


def _frozen_copy(value: jax.Array, dtype: jnp.dtype | None) -> jax.Array:
    """A copy of `value` (never the same buffer: the policy's is donated) in `dtype` when it is a
    floating-point array and `dtype` is given."""
    if dtype is None or not jnp.issubdtype(value.dtype, jnp.floating):
        return jnp.copy(value)
    return jnp.array(value, dtype=dtype, copy=True)


def create_train_state(
    model: CausalLM,
    optimizer: optax.GradientTransformation,
    step_config: StepConfig,
    *,
    reference: CausalLM | None = None,
) -> tuple[nnx.GraphDef, TrainState]:
    """The graph definition and initial state. For a `FrozenReference` the reference is
    `reference`'s parameters, or a copy of the initial policy parameters when None."""
    graphdef, params, frozen, is_lora = split_policy(model)
    ref = None
    sync = step_config.reference.sync
    moves = sync is not None
    if isinstance(step_config.reference, LoraBaseReference):
        if not is_lora:
            raise ValueError(
                "reference.type 'lora_base' needs a policy with LoRA adapters (set lora.rank > 0)"
            )
        nonzero = [
            "/".join(map(str, p))
            for p, v in nnx.to_flat_state(params)
            if p[-1] == "lora_b" and _nonzero(v.get_value())
        ]
        if nonzero:
            raise ValueError(
                f"LoRA reference: adapter factor lora_b must start at zero so that step 0 has "
                f"policy == reference (loss ln 2); non-zero: {nonzero[:3]}"
            )
    elif isinstance(step_config.reference, FrozenReference) and not step_config.reference_free:
        if reference is not None:
            base = nnx.split(reference, LoRAParam, nnx.Param)[2]
        else:
            base = frozen if is_lora else params
        dtype = reference_dtype(model.config, moves=moves)
        ref = jax.tree.map(lambda v: _frozen_copy(v, dtype), base)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        frozen=frozen,
        ref=ref,
        opt_state=optimizer.init(params),
        ref_adapters=jax.tree.map(jnp.copy, params) if moves and is_lora else None,
        moments=RunningMoments.initial() if step_config.running_moments else None,
        ref_moves=moves,
    )
    return graphdef, state


def _mix(ref: nnx.State, target: nnx.State, alpha: float) -> nnx.State:
    """alpha * target + (1 - alpha) * ref, leaf by leaf, in the reference's dtypes."""
    return jax.tree.map(
        lambda r, t: ((1.0 - alpha) * r + alpha * t.astype(r.dtype)).astype(r.dtype), ref, target
    )


def sync_reference(state: TrainState, cfg: StepConfig, is_lora: bool) -> TrainState:
    """TR-DPO (TRL's SyncRefModelCallback): after every `sync.every`-th step (counted by
    `state.step`, already advanced) the reference moves toward the policy. A frozen reference mixes
    its weights with the policy's (a LoRA policy's: its base, which does not train); a LoRA
    policy's reference adapters mix with the adapters, factor by factor (so the reference's
    update is not the mix of the two products B @ A; alpha = 1 copies exactly). Traced inside the
    step: a `lax.cond` on the step number, so the other steps do no work."""
    sync = cfg.reference.sync
    if sync is None:
        return state
    alpha = sync.alpha
    targets = (state.frozen if is_lora else state.params, state.params)

    def mixed(refs):
        return tuple(
            None if r is None else _mix(r, t, alpha) for r, t in zip(refs, targets, strict=True)
        )

    due = state.step % sync.every == 0
    ref, adapters = jax.lax.cond(due, mixed, lambda refs: refs, (state.ref, state.ref_adapters))
    return state.replace(ref=ref, ref_adapters=adapters)


def policy_model(graphdef: nnx.GraphDef, state: TrainState, is_lora: bool) -> CausalLM:
    if is_lora:
        return nnx.merge(graphdef, state.params, state.frozen)
    return nnx.merge(graphdef, state.frozen, state.params)


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
        ref_adapters=None
        if state.ref_adapters is None
        else param_shardings(state.ref_adapters, mesh, rules),
        moments=jax.tree.map(lambda _: replicated, state.moments),
        ref_moves=state.ref_moves,
    )
