"""The configurations a plan compiles (`dpojax.jobs.plan`): the recipe's own and, with
`plan.search`, the nearest changes that save memory or time (remat, fsdp, the context axis,
micro-batches, bf16 parameters, the attention implementations and Pallas blocks); the target
they are compiled for and the mesh sizes a recipe takes on it."""

from __future__ import annotations

import dataclasses

import numpy as np

from dpojax import schema
from dpojax.config import Config
from dpojax.config.checks import context_errors
from dpojax.errors import ConfigProblem
from dpojax.hardware.chips import DEVICE_KINDS, Chip
from dpojax.jobs import build
from dpojax.models import attention
from dpojax.models.attention.pallas import BLOCK_CHOICES, DEFAULT_BLOCK, chip_block
from dpojax.models.model_config import CUDNN_LAYOUTS
from dpojax.train.batches import indivisible, micro_batch_pairs


class PlanError(ConfigProblem):
    """A plan that cannot be made (unknown target, no libtpu, a mesh the target cannot hold)."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    devices: list
    chip: Chip | None
    platform: str


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration the plan compiles: the recipe's own, or a change of it."""

    label: str
    remat: str
    mesh: tuple[int, int, int, int]  # (data, fsdp, context, tensor)
    grad_accum: int
    param_dtype: str
    attention: str = ""  # "": the recipe's model.attention
    attention_block: int = 0  # the Pallas kernels' block; 0: the target TPU generation's


def target_block(chip: Chip | None) -> int:
    """The Pallas kernels' block on `chip` (0 where it is no TPU: the kernels do not run there)."""
    return chip_block(DEVICE_KINDS.get(chip.name)) if chip and chip.kind == "tpu" else 0


def mesh_sizes(config: Config, devices: int) -> tuple[int, int, int, int]:
    """The recipe's (data, fsdp, context, tensor) on the target's `devices`: -1 (data, fsdp or
    tensor; the config checks refuse it for context) is the devices that remain."""
    m = config.mesh
    if m.context < 1:
        raise PlanError(f"config key 'mesh.context' must be a positive size, got {m.context}")
    sizes = [m.data, m.fsdp, m.context, m.tensor]
    fixed = int(np.prod([s for s in sizes if s > 0]))
    if devices % fixed:
        raise PlanError(
            f"config key 'mesh': data*fsdp*context*tensor sizes {sizes} do not divide the "
            f"target's {devices} devices"
        )
    return tuple(s if s > 0 else devices // fixed for s in sizes)


def candidate_config(config: Config, candidate: Candidate) -> Config:
    data, fsdp, context, tensor = candidate.mesh
    changes = {"mesh.data": data, "mesh.fsdp": fsdp, "mesh.context": context}
    return schema.replaced(
        config, {**changes, "mesh.tensor": tensor, "train.grad_accum": candidate.grad_accum}
    )


def candidates(config: Config, devices: int, target: Target | None = None) -> list[Candidate]:
    """The recipe's own configuration first, then the nearest changes that save memory: each
    remat policy, the data axis folded into fsdp, devices moved between fsdp and the context
    axis (`_context_candidates`), 2x and 4x the micro-batches at the same global
    batch, bf16 parameters; then all of them that apply, together; then, on `target`, the other
    attention implementations and the Pallas kernels' other blocks (`_attention_candidates`)."""
    mesh = mesh_sizes(config, devices)
    m = config.model
    base = Candidate("recipe", m.remat, mesh, config.train.grad_accum, m.param_dtype)
    out = [base]
    for remat in ("attention", "dots_no_batch", "dots", "full", "none"):
        if remat != base.remat:
            out.append(dataclasses.replace(base, label=f"remat={remat}", remat=remat))
    data, fsdp, context, tensor = mesh
    if data > 1:
        folded = (1, data * fsdp, context, tensor)
        out.append(dataclasses.replace(base, label=f"mesh.fsdp={data * fsdp}", mesh=folded))
    out += _context_candidates(config, base)
    for factor in (2, 4):
        accum = base.grad_accum * factor
        micro = micro_batch_pairs(config.train.batch_size, accum)
        if config.train.batch_size % accum == 0 and not indivisible(micro, data * fsdp, "pairs"):
            out.append(dataclasses.replace(base, label=f"grad_accum={accum}", grad_accum=accum))
    if base.param_dtype == "float32":
        out.append(dataclasses.replace(base, label="param_dtype=bfloat16", param_dtype="bfloat16"))
    together = dataclasses.replace(
        base,
        label="all of the above",
        remat="full",
        mesh=(1, data * fsdp, context, tensor),
        param_dtype="bfloat16",
        grad_accum=max([c.grad_accum for c in out]),
    )
    if together not in out:
        out.append(together)
    return out + _attention_candidates(config, base, target)


def _context_candidates(config: Config, base: Candidate) -> list[Candidate]:
    """Devices moved between fsdp and the context axis (docs/long_context.md): twice the recipe's
    context, from fsdp (or, where fsdp is odd, from data); and, for a recipe with a context axis,
    its context folded back into fsdp. Only where the config checks' context rule holds (every
    row length divides by 2 * context, an attention that runs split rows) and the pairs still
    split over the candidate's data x fsdp devices."""
    data, fsdp, context, tensor = base.mesh
    meshes = []
    if fsdp % 2 == 0:
        meshes.append((data, fsdp // 2, 2 * context, tensor))
    elif data % 2 == 0:
        meshes.append((data // 2, fsdp, 2 * context, tensor))
    if context > 1:
        meshes.append((data, fsdp * context, 1, tensor))
    # the pairs of a micro-batch (and of an eval batch, where the plan compiles the eval step)
    pairs = [micro_batch_pairs(config.train.batch_size, base.grad_accum)]
    if config.reference.type == "precomputed" or build.eval_source(config, train=True):
        pairs.append(config.train.eval_batch_size)
    out = []
    for mesh in meshes:
        candidate = dataclasses.replace(base, label=f"mesh.context={mesh[2]}", mesh=mesh)
        if not context_errors(candidate_config(config, candidate)) and not any(
            indivisible(n, mesh[0] * mesh[1], "pairs") for n in pairs
        ):
            out.append(candidate)
    return out


def _attention_candidates(
    config: Config, base: Candidate, target: Target | None
) -> list[Candidate]:
    """The recipe with each other attention implementation that runs on `target` (the Pallas
    kernels on TPU only), and, where the recipe runs the Pallas kernels, with each other block
    of `BLOCK_CHOICES`."""
    if target is None:
        return []
    # "auto" on GPU runs cuDNN where the layout and dtype let it (the model's head dim and
    # soft-capping may still send it to flash: then the flash candidate repeats the recipe)
    cudnn_exact = (
        (target.chip is None or target.chip.fused_attention)
        and config.data.layout in CUDNN_LAYOUTS
        and build.compute_dtype(config, target.platform, target.chip) != "float32"
    )
    recipe = attention.resolve(
        config.model.attention, target.platform, config.data.max_length, cudnn_exact=cudnn_exact
    )
    recipe = attention.split_rows_choice(config.model.attention, recipe, base.mesh[2])
    options = (["pallas"] if target.platform == "tpu" else []) + ["flash", "reference"]
    # rows split over a context axis: only the implementations that run them
    options = [a for a in options if base.mesh[2] == 1 or a in attention.SPLIT_ROW_IMPLEMENTATIONS]
    out = [
        dataclasses.replace(base, label=f"model.attention={a}", attention=a)
        for a in options
        if a != recipe
    ]
    if recipe == "pallas":
        own = config.model.attention_block or target_block(target.chip) or DEFAULT_BLOCK
        out += [
            dataclasses.replace(base, label=f"model.attention_block={b}", attention_block=b)
            for b in BLOCK_CHOICES
            if b != own
        ]
    return out
