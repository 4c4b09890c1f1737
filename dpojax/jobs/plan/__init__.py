"""The plan job (`mode = "plan"`): compile the recipe's real step ahead of time for a TPU slice,
NVIDIA GPUs or this process's devices, and report per-device memory, FLOPs, bytes, every
collective (`comm_audit`) and a roofline with a communication term — before renting anything.

    python -m dpojax.main --config configs/llama1b_tpu.py --config.mode=plan \
        --config.plan.target=tpu:v5e:2x2
    JAX_PLATFORMS=cpu python -m dpojax.main --config configs/llama8b_h100.py --config.mode=plan \
        --config.plan.target=gpu:h100:8

Nothing is allocated: the model comes from a config.json alone (`model.path` or
`plan.model_config`), the state from `jax.eval_shape`, the batch from synthetic pairs laid out by
the real batch code at the recipe's shape. A compile that runs out of device memory is a
"does not fit" row with the compiler's figures, never a crash. `plan.search` tries the nearest
changes (`candidates`: remat, a larger fsdp axis, the context axis, more micro-batches,
bf16 parameters) and ranks them; `plan.longest_row` searches the row length (`longest`).
Writes WORKDIR/plan.json (docs/plan.md explains every figure) and prints a table.

Why one module of this length: the job builds one compile (abstract state, synthetic batch, the
jitted steps) and reads its figures; the candidates, the longest row, the attention figures, the
communication audit and the table are the package's other modules (`candidates`, `longest`,
`attention`, `comm_audit`, `table`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dpojax.config import Config
from dpojax.data.tokenize import TokenizedPair
from dpojax.hardware import gpu_targets
from dpojax.hardware.chips import Chip, chip_for, gpu_memory_fraction
from dpojax.jobs import build
from dpojax.jobs.plan import attention as plan_attention
from dpojax.jobs.plan import comm_audit
from dpojax.jobs.plan import longest as plan_longest
from dpojax.jobs.plan.candidates import (
    Candidate,
    PlanError,
    Target,
    candidate_config,
    candidates,
    target_block,
)
from dpojax.jobs.plan.table import format_table
from dpojax.jobs.train.bounds import check_sizes
from dpojax.models import ModelConfig, attention, read_config
from dpojax.models.attention.pallas import kernel_block
from dpojax.models.scan import STACK
from dpojax.models.scan import resolve as resolve_scan
from dpojax.models.sharding import MESH_AXES, make_mesh
from dpojax.runtime import prepare_tpu_compile_host
from dpojax.train import aot
from dpojax.train.batches import micro_batch_pairs, pad_batch, stack_micro_batches
from dpojax.train.flops import batch_work, recompute_flops, step_flops
from dpojax.train.reference import attach_reference
from dpojax.train.step import Stepper

log = logging.getLogger(__name__)

# TPU generations whose chips present one device per chip only in the "megacore" configuration.
MEGACORE = ("v4", "v5p")


def resolve_target(spec: str) -> Target:
    """'local' (this process's devices), 'tpu:<topology>' (abstract TPU devices) or
    'gpu:<chip>:<n>' (compile-only NVIDIA GPUs, `gpu_targets`)."""
    if spec == "local":
        devices = jax.devices()
        kind = devices[0].device_kind
        return Target("local", devices, chip_for(kind), devices[0].platform)
    kind, _, topology = spec.partition(":")
    if kind == "gpu":
        try:
            devices, chip = gpu_targets.devices(spec)
        except gpu_targets.GpuTargetError as e:
            raise PlanError(str(e)) from None
        return Target(spec, devices, chip, "gpu")
    if kind != "tpu" or not topology:
        raise PlanError(
            f"plan.target {spec!r}: use 'local', 'tpu:<topology>' (e.g. tpu:v5e:2x2) or "
            "'gpu:<chip>:<gpus>' (e.g. gpu:h100:8)"
        )
    generation = topology.split(":")[0].split("-")[0]
    prepare_tpu_compile_host(topology)
    try:
        importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        raise PlanError(
            "plan.target=tpu:... needs libtpu (XLA's TPU compiler) on this host: "
            "pip install -e '.[tpu-plan]'"
        ) from None
    from jax.experimental import topologies

    kwargs = {"chip_config_name": "megacore"} if generation in MEGACORE else {}
    kwargs.update(_single_host_bounds(topology))
    try:
        desc = topologies.get_topology_desc(topology, "tpu", **kwargs)
    except Exception as e:  # libtpu raises its own types for an unknown topology
        raise PlanError(f"plan.target {spec!r}: libtpu does not know this topology ({e})") from None
    return Target(spec, list(desc.devices), chip_for(generation), "tpu")


def _single_host_bounds(topology: str) -> dict:
    """libtpu's default host holds a 2x2x1 block of chips, so a slice with fewer chips than that
    (`v5e:1x1`, one chip as Colab and single-chip VMs rent) needs its own host bounds."""
    dims = [int(d) for d in topology.split(":")[-1].split("x") if d.isdigit()]
    if not dims or math.prod(dims) >= 4:
        return {}
    return {"chips_per_host_bounds": tuple((dims + [1, 1, 1])[:3])}


def model_config(
    config: Config,
    platform: str,
    candidate: Candidate,
    row_length: int,
    chip: Chip | None = None,
) -> ModelConfig:
    """The planned model: its config.json with the recipe's dtypes, the candidate's remat and
    parameter dtype, the attention implementation "auto" means on the target, and the Pallas
    kernels' block of the target's TPU generation (`chip`)."""
    implementation = candidate.attention or config.model.attention
    if implementation == "auto" and chip is not None and not chip.fused_attention:
        implementation = "flash"  # a GPU before Ampere: no cuDNN fused attention
    planned = read_config(
        planned_model_dir(config),
        dtype=build.compute_dtype(config, platform, chip),
        param_dtype=candidate.param_dtype,
        remat=candidate.remat,
        attention=implementation,
        row_layout=config.data.layout,
        target_platform=platform,
        attention_block=(
            candidate.attention_block or config.model.attention_block or target_block(chip)
        ),
    )
    scan = resolve_scan(
        config.model.scan_layers, planned.scan_period()[0], platform, remat=planned.remat
    )
    # rows split over a context axis run what `auto` picks for them there (cuDNN: flash)
    chosen = attention.split_rows_choice(
        planned.attention, attention.choose(planned, platform, row_length), candidate.mesh[2]
    )
    return planned.replace(
        scan_layers=scan,
        attention=chosen,
        quantization=config.model.quantization,  # the state then holds the codes and scales
        quantization_block=config.model.quantization_block,
    )


def planned_model_dir(config: Config) -> Path:
    """The folder of the planned model's config.json: `plan.model_config` (the file or its
    folder), else model.path."""
    path = Path(config.plan.model_config or config.model.path)
    return path.parent if path.name == "config.json" else path


def synthetic_pairs(config: Config, count: int) -> list[TokenizedPair]:
    """`count` pairs of the recipe's longest sequences: `data.max_length` tokens each, of which
    `plan.completion_fraction` are completion."""
    length = config.data.max_length
    completion = min(max(1, round(config.plan.completion_fraction * length)), length - 1)
    prompt = length - completion
    return [
        TokenizedPair(
            prompt_ids=np.full(prompt, 3, np.int32),
            chosen_ids=np.full(completion, 4, np.int32),
            rejected_ids=np.full(completion, 5, np.int32),
            chosen_prompt_len=prompt,
            rejected_prompt_len=prompt,
            pair_id=i,
            group=i,
        )
        for i in range(count)
    ]


def host_batch(
    config: Config, pairs_per_micro: int, micro: int, data_parallel: int
) -> dict[str, np.ndarray]:
    """A batch of `micro` micro-batches as the real layout code builds it, padded to
    `plan.rows` x `plan.row_length` when those are set."""
    pairs = synthetic_pairs(config, pairs_per_micro * micro)
    batches = build.batch_iterator(
        config,
        pairs,
        batch_pairs=pairs_per_micro,
        shuffle=False,
        num_epochs=1,
        pad_id=0,
        data_parallel=data_parallel,
    )
    built = [next(batches) for _ in range(micro)]
    rows = max(b["tokens"].shape[0] for b in built)
    length = max(b["tokens"].shape[1] for b in built)
    for key, want, have in (
        ("plan.rows", config.plan.rows, rows),
        ("plan.row_length", config.plan.row_length, length),
    ):
        if want and want < have:
            raise PlanError(
                f"config key '{key}' is {want}, but the recipe's batches need {have} "
                f"(data.layout={config.data.layout}, data.max_length={config.data.max_length}, "
                f"{pairs_per_micro} pairs per micro-batch); raise it or leave it 0"
            )
    rows, length = max(rows, config.plan.rows), max(length, config.plan.row_length)
    return stack_micro_batches([pad_batch(b, rows, length) for b in built])


def _roofline(result: dict[str, Any], chip: Chip | None) -> None:
    """Adds the step-time and MFU bounds of `result` on `chip`: compute time at the chip's peak
    FLOP/s for the model FLOPs plus what the remat policy reruns, memory time at its HBM bandwidth
    for the larger of XLA's bytes accessed (where its cost analysis gives them; loop bodies
    counted once) and the HLO's bytes with loop trip counts applied (`memory_traffic`),
    communication time for the bytes the audit counts at the chip's interconnect (within a host
    or slice) and DCN (across hosts) bandwidths. The bound assumes the three overlap perfectly;
    `step_seconds_serial` that none does."""
    if chip is None:
        return
    model = result["model_flops_per_device"] / chip.bf16_flops
    executed = model + result.get("recompute_flops_per_device", 0.0) / chip.bf16_flops
    terms = {"compute": executed}
    hbm = max(result.get("compiled_bytes_per_device") or 0, result["train"].get("hlo_bytes") or 0)
    if hbm:
        terms["memory"] = hbm / chip.hbm_bandwidth
    audit = result["train"].get("communication") or {}
    per_axis = _communication_seconds(audit, chip)
    if audit.get("moved_bytes_per_link"):
        terms["communication"] = sum(per_axis.values())
    bound = max(terms.values())
    result["roofline"] = {
        **{f"{name}_seconds": value for name, value in terms.items()},
        "communication_seconds_per_axis": per_axis,
        "step_seconds_bound": bound,
        "step_seconds_serial": sum(terms.values()),
        "mfu_bound": model / bound if bound else None,
        "bound_by": max(terms, key=terms.get),
    }


def _communication_seconds(audit: dict, chip: Chip) -> dict[str, float]:
    """Per mesh axis (the audit's labels: `fsdp`, `context`, `data+fsdp`, ...) the seconds its
    collectives' bytes take on their link (the chip's interconnect within a host or slice, DCN
    across hosts); their sum is the roofline's communication term."""
    bandwidths = {"local": chip.link_bandwidth, "dcn": chip.dcn_bandwidth}
    seconds: dict[str, float] = {}
    for e in audit.get("collectives", []):
        moved, bandwidth = e["moved_bytes_per_device"], bandwidths[e["link"]]
        time = (moved / bandwidth if bandwidth else float("inf")) if moved else 0.0
        seconds[e["axes"]] = seconds.get(e["axes"], 0.0) + time
    return seconds


def _step_batches(c: Config, data_parallel: int) -> tuple[dict, dict | None]:
    """The candidate's train batch and, where the recipe evaluates or precomputes the reference
    (a pass of the eval step), its eval batch; with a precomputed reference both carry its
    log-probs, as the steps then read them from the batch."""
    micro_pairs = micro_batch_pairs(c.train.batch_size, c.train.grad_accum)
    train_batch = host_batch(c, micro_pairs, c.train.grad_accum, data_parallel)
    precomputed = c.reference.type == "precomputed"
    eval_batch = None
    if precomputed or build.eval_source(c, train=True) is not None:
        eval_batch = host_batch(c, c.train.eval_batch_size, 1, data_parallel)
        eval_batch = {k: v[0] for k, v in eval_batch.items()}
    if precomputed:
        train_batch, eval_batch = (
            b if b is None else attach_reference(b, *[np.zeros(b["pair_ids"].max() + 1)] * 2)
            for b in (train_batch, eval_batch)
        )
    return train_batch, eval_batch


def compile_candidate(
    config: Config,
    target: Target,
    candidate: Candidate,
    attention_cores: dict | None = None,
    every_implementation: bool = False,
    programs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Compiles the candidate's train step (and eval step, where the recipe evaluates or
    precomputes the reference) and returns its figures. With `attention_cores` (a cache shared
    by the candidates) the attention kernel is compiled alone too (`attention_kernel`) and, with
    `every_implementation`, each other implementation's (`attention_implementations`). Each
    compiled step's executable is added to `programs` by its `aot.program_key`."""
    c = candidate_config(config, candidate)
    data, fsdp, context, tensor = candidate.mesh
    mesh = make_mesh(data, fsdp, tensor, context=context, devices=target.devices)
    data_parallel = candidate.mesh[0] * candidate.mesh[1]
    train_batch, eval_batch = _step_batches(c, data_parallel)
    needs_eval = eval_batch is not None
    row_length = int(train_batch["tokens"].shape[-1])
    mcfg = model_config(c, target.platform, candidate, row_length, target.chip)
    step_cfg = build.step_config(c, mcfg)
    # The run's step count where the recipe sets it: the schedule is part of the program, so
    # auto-fit's executable is then the one the run would compile (`aot.program_key`).
    optimizer, schedule = build.optimizer(c, c.train.steps or 1000)
    lora = (c.lora.rank, c.lora.alpha, tuple(c.lora.targets)) if c.lora.rank > 0 else None
    graphdef, state = aot.abstract_state(mcfg, optimizer, step_cfg, lora=lora)
    stepper = Stepper(graphdef, optimizer, schedule, step_cfg, lora is not None, mesh=mesh)
    tokens, pairs, scored, flops = _step_work(c, mcfg, step_cfg, train_batch)
    rerun = recompute_flops(mcfg, tokens, pairs, mcfg.remat, mcfg.attention)
    devices = len(target.devices)
    result: dict[str, Any] = {
        "label": candidate.label,
        "remat": candidate.remat,
        "mesh": dict(zip(MESH_AXES, candidate.mesh, strict=True)),
        "grad_accum": candidate.grad_accum,
        "param_dtype": candidate.param_dtype,
        "compute_dtype": mcfg.dtype,
        "attention": mcfg.attention,
        # the Pallas kernels' query/key block (None for the other implementations)
        "attention_block": kernel_block(row_length, mcfg.attention_block or None, interpret=False)
        if mcfg.attention == "pallas"
        else None,
        "scan_layers": mcfg.scan_layers,
        "batch": {
            "layout": c.data.layout,
            "pairs_per_step": c.train.batch_size,
            "micro_batches": c.train.grad_accum,
            "rows": int(train_batch["tokens"].shape[1]),
            "row_length": int(train_batch["tokens"].shape[2]),
            "tokens": tokens,
            "scored_tokens": scored,
        },
        "state_bytes_per_device": aot.state_bytes(stepper, state),
        "model_flops_per_step": flops,
        "model_flops_per_device": flops / devices,
        "recompute_flops_per_device": rerun / devices,
    }
    lowered = aot.lower_steps(stepper, state, train_batch, eval_batch)
    batches = [train_batch["tokens"].shape[1:]] + (
        [eval_batch["tokens"].shape] if needs_eval else []
    )
    layout = _layout(stepper, state, batches, over_dcn=target.platform == "gpu")
    for name, step in lowered.items():
        result[name] = _step_figures(
            step, target, layout, result["state_bytes_per_device"], programs
        )
    train = result["train"]
    result["fits"] = all(result[name]["fits"] for name in lowered)
    result["compiled_bytes_per_device"] = train.get("compiled_bytes")
    _roofline(result, target.chip)
    if attention_cores is not None:
        setting = plan_attention.AttentionSetting(
            mcfg,
            mesh,
            target.platform,
            train_batch["tokens"].shape,
            step_cfg.reference_forward,
            devices,
        )
        plan_attention.step_figures(result, setting, attention_cores, (tokens, pairs, scored))
        if every_implementation:
            result["attention_implementations"] = [
                plan_attention.step_figures(
                    {}, setting, attention_cores, (tokens, pairs, scored), name
                )
                for name in attention.IMPLEMENTATIONS
            ]
        _context_overlap(result)
    return result


def _context_overlap(result: dict[str, Any]) -> None:
    """On a mesh with a context axis: how much of the axis's communication (every collective
    whose axes include `context`: the K/V gathers and their reduce-scatters, the weights' FSDP
    gathers over fsdp x context) the attention compute can hide, the roofline's
    `context_overlap`: its seconds on the link, the attention's compute seconds (the compute term
    times the attention's share of the model FLOPs) and `hideable_share` = min(1, attention /
    communication). A bound: it assumes each collective runs beside some attention of its pass
    (the next layer's K/V gather during this layer's attention), as XLA's scheduler may do."""
    roofline = result.get("roofline")
    share = ((result.get("attention_kernel") or {}).get("share") or {}).get("model_flops")
    if not roofline or share is None:
        return
    per_axis = roofline.get("communication_seconds_per_axis") or {}
    seconds = sum(v for axes, v in per_axis.items() if "context" in axes.split("+"))
    if not seconds:
        return
    attention_seconds = roofline["compute_seconds"] * share
    roofline["context_overlap"] = {
        "communication_seconds": seconds,
        "attention_compute_seconds": attention_seconds,
        "hideable_share": min(1.0, attention_seconds / seconds),
    }


def _layout(stepper: Stepper, state, batches: list, over_dcn: bool) -> comm_audit.Layout:
    """The audit's view of the program: the mesh, each device's host where hosts talk over DCN
    (GPU hosts; a TPU slice's hosts share its ICI), the global (rows, length) of each model call
    (none when the batch is not split: then no collective can gather it) and the parameters'
    shapes, whole and per device."""
    mesh = stepper.mesh
    sharded = aot.with_shardings(state, stepper.pin_state_shardings(state))
    weights = set()
    trees = (sharded.params, sharded.frozen, sharded.ref, sharded.ref_adapters)
    for keys, leaf in jax.tree_util.tree_leaves_with_path(trees):
        shapes = {tuple(leaf.shape), tuple(leaf.sharding.shard_shape(leaf.shape))}
        if STACK in jax.tree_util.keystr(keys):  # scanned layers: one scan step's slice too
            shapes |= {shape[1:] for shape in shapes}
        weights.update(shapes)
    split = mesh.shape["data"] * mesh.shape["fsdp"] > 1
    return comm_audit.Layout(
        mesh_shape=dict(mesh.shape),
        hosts=tuple(d.process_index for d in mesh.devices.flat) if over_dcn else (),
        token_shapes=tuple((int(r), int(n)) for r, n in batches) if split else (),
        weight_shapes=frozenset(weights),
    )


def _step_figures(
    step, target: Target, layout: comm_audit.Layout, state: dict, programs: dict | None = None
) -> dict:
    """Compiles one lowered step: its memory (and whether it fits the target's chip), XLA's cost
    analysis where the backend gives one, and the communication audit of its HLO; the
    executable goes to `programs` (by its key) when given."""
    try:
        compiled = aot.compile_step(step)
    except aot.OutOfMemory as e:
        # The compiler states the temporaries; the state (arguments) comes on top.
        held = sum(state.values())
        return {
            "fits": False,
            "needed_temporaries_bytes": e.needed,
            "needed_bytes": None if e.needed is None else e.needed + held,
            "available_bytes": e.available,
            "compile_seconds": e.seconds,
            "message": str(e)[:2000],
        }
    if programs is not None:
        programs[compiled.key] = compiled.executable
    m = compiled.memory
    total = m["peak"] or (m["argument"] + m["output"] - m["alias"] + m["temp"])
    usable = target.chip.usable_bytes if target.chip else None
    return {
        "fits": usable is None or total <= usable,
        "compile_seconds": compiled.seconds,
        "memory_bytes": m,
        "total_bytes": total,
        "usable_bytes": usable,
        "compiled_flops": compiled.flops,
        "compiled_bytes": compiled.bytes_accessed,
        "communication": comm_audit.audit(compiled.hlo_text, layout),
        "hlo_bytes": comm_audit.memory_traffic(compiled.hlo_text),
    }


def _rank(result: dict[str, Any]) -> tuple:
    mfu = (result.get("roofline") or {}).get("mfu_bound", -1.0)
    total = (
        result["train"].get("total_bytes") or result["train"].get("needed_bytes") or float("inf")
    )
    return (not result["fits"], -mfu, total)


def versions() -> dict[str, str | None]:
    out = {}
    for name in ("jax", "jaxlib", "libtpu", "flax", "optax", "dpojax"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _usable_memory(target: Target, chip: Chip | None) -> dict[str, Any] | None:
    if chip is None:
        return None
    if chip.kind == "gpu":
        fraction, source = gpu_memory_fraction()
        return {"bytes": chip.usable_bytes, "fraction": fraction, "source": source}
    return {
        "bytes": chip.usable_bytes,
        "fraction": chip.usable_bytes / chip.hbm_bytes,
        "source": "capacity less the TPU runtime's reservation",
    }


def _platform_notes(target: Target) -> list[str]:
    if target.platform != "gpu" or target.name == "local":
        return []
    return [
        "gpu: compiled deviceless by JAX's CUDA plugin; XLA's cost analysis is not available on "
        "this path (compiled FLOPs and bytes are null; compute comes from dpojax's FLOP model and "
        "HBM traffic from the HLO's bytes), XLA does "
        "not refuse a program over the device's memory (fit is the compiled peak against the "
        "usable memory), no autotuning ran (no timing can be read from this compile) and "
        "cuDNN workspaces are not counted",
    ]


def _step_work(c, mcfg: ModelConfig, step_cfg, train_batch: dict) -> tuple:
    """(tokens, attention pairs, scored tokens, model FLOPs) of one step of `train_batch`'s
    micro-batches (`dpojax.train.flops`)."""
    work = [
        batch_work({k: v[i] for k, v in train_batch.items()}) for i in range(c.train.grad_accum)
    ]
    tokens, pairs, scored = (sum(w[j] for w in work) for j in range(3))
    flops = step_flops(
        mcfg,
        tokens,
        pairs,
        scored,
        reference_forward=step_cfg.reference_forward,
        lm_head_everywhere=step_cfg.nll_prompt,
    )
    return tokens, pairs, scored, flops


def _dtype_notes(config: Config, target: Target) -> list[str]:
    """A warning (logged, and a note of the report) where the recipe computes in bfloat16 on a
    chip whose 16-bit arithmetic is float16 only (a T4): XLA emulates bfloat16 there, so the
    roofline's peak is not what the step gets."""
    chip = target.chip
    if chip is None or chip.half_dtype == "bfloat16":
        return []
    if build.compute_dtype(config, target.platform, chip) != "bfloat16":
        return []
    note = (
        f"model.dtype='bfloat16' on {chip.name}, which has no bfloat16 arithmetic: XLA "
        f"emulates it (in float32), so the step is slower than the {chip.half_dtype} peak the "
        f"roofline assumes; model.dtype=auto computes in {chip.half_dtype} there"
    )
    log.warning("plan: %s", note)
    return [note]


def _implementation_shares(kernels: list[dict], results: list[dict]) -> list[dict]:
    """Each implementation's kernel at the recipe's shapes with its shares of the step: of the
    recipe's step, or of the candidate that changes only the implementation (`share_of` names
    it); where neither was compiled, no bytes share (the FLOP shares need no compiled step)."""
    for kernel in kernels:
        name = kernel["implementation"]
        kernel["share_of"] = None
        for r in results:
            if r["label"] in ("recipe", f"model.attention={name}") and r["attention"] == name:
                kernel["share"] = (r.get("attention_kernel") or {}).get("share")
                kernel["share_of"] = r["label"]
                break
    return kernels


def plan(config: Config, workdir: str | Path) -> dict[str, Any]:
    """Mode `plan`: see the module docstring. Returns the report also written to plan.json."""
    workdir = Path(workdir)
    # the recipe's batch is built on this host (`host_batch`): its sizes are bounded first
    check_sizes(config, planned_model_dir(config))
    target = resolve_target(config.plan.target)
    chip = chip_for(config.plan.chip) if config.plan.chip else target.chip
    target = dataclasses.replace(target, chip=chip)
    options = candidates(config, len(target.devices), target)
    if not config.plan.search:
        options = options[:1]
    results, cores = [], {}
    for i, candidate in enumerate(options[: max(1, config.plan.max_candidates)]):
        log.info("compiling %s for %s", candidate.label, target.name)
        results.append(compile_candidate(config, target, candidate, cores, i == 0))
    recipe = results[0]
    kernels = _implementation_shares(recipe.pop("attention_implementations"), results)
    longest = None
    if config.plan.longest_row:
        longest = plan_longest.longest_row(
            config,
            options[0],
            read_config(planned_model_dir(config)).max_position_embeddings,
            lambda c, candidate: compile_candidate(c, target, candidate),
        )
    results.sort(key=_rank)
    report = {
        "target": target.name,
        "platform": target.platform,
        "devices": len(target.devices),
        "chip": dataclasses.asdict(chip) if chip else None,
        "model": config.plan.model_config or config.model.path,
        "recipe_fits": recipe["fits"],
        "usable_memory": _usable_memory(target, chip),
        "candidates": results,
        "attention_implementations": kernels,
        "longest_row": longest,
        "versions": versions(),
        "notes": [
            "memory, FLOPs and bytes are per device; model FLOPs are dpojax's FLOP model "
            "(dpojax.train.flops); compiled FLOPs and bytes are XLA's cost analysis, which counts "
            "a loop body once (bytes are a lower bound)",
            "roofline: step time >= max((model + remat-recomputed FLOPs) / peak FLOP/s, compiled "
            "bytes / HBM bandwidth, audited collective bytes / interconnect bandwidth); MFU <= "
            "model FLOPs / peak FLOP/s / that bound",
            "communication: every collective of the compiled step, loop trip counts applied; "
            "bytes moved per device for bandwidth-optimal (ring) algorithms",
        ]
        + _platform_notes(target)
        + _dtype_notes(config, target),
    }
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "plan.json").write_text(json.dumps(report, indent=2, default=str))
        longest_lines = [] if longest is None else ["", *plan_longest.table(longest)]
        print("\n".join([format_table(report), *longest_lines]))
    return report
