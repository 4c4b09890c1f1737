"""Validation of a whole config, once, before any compute: `validate(config)` returns one line
per problem, each naming the key and the fix (the per-key type and choice checks are
`check_keys`; these are the checks across keys, paths and devices)."""

from __future__ import annotations

import json
import os

import ml_collections

from dpojax import schema
from dpojax.collect.gate import Gate
from dpojax.collect.workflow import RoundRank, option_problems, workflow_class
from dpojax.config.ranges import range_problems
from dpojax.config.tree import check_keys
from dpojax.customizer.client.settings import settings_problems
from dpojax.data.layouts import LAYOUTS, bucket_lengths, layout_record
from dpojax.data.shapes import read_chat_template
from dpojax.hardware import gpu_targets
from dpojax.models.attention import SPLIT_ROW_IMPLEMENTATIONS
from dpojax.models.hub import is_hub_id, push_problems
from dpojax.models.model_config import CUDNN_LAYOUTS, LORA_TARGETS
from dpojax.train.batches import indivisible, micro_batch_pairs
from dpojax.train.fit import parse_auto_fit
from dpojax.train.kto import UNPAIRED_LOSS_TYPES, check_kto_batch_size
from dpojax.train.loss_settings import LossSettings, parse_loss_types
from dpojax.train.losses import LOSS_TYPES
from dpojax.train.profile import parse_profile_steps
from dpojax.train.tracking import parse_report_to


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None) -> list[str]:
    """Every problem with `config`, one line each (empty when the config is usable)."""
    errors = check_keys(config)
    if errors:
        return errors
    errors += range_problems(dict(schema.leaves(config)))
    errors += _path_errors(config)
    errors += _training_errors(config)
    errors += _callback_errors(config)
    errors += _cudnn_errors(config)
    collects = config.mode == "submit" and not config.data.train_path  # collects, then submits
    if config.mode in ("collect", "loop") or collects:
        errors += _collect_errors(config)
    if config.mode == "submit":
        errors += _customizer_errors(config)
    local = config.mode != "plan" or config.plan.target == "local"
    errors += _mesh_errors(config, num_devices if local else None)
    if config.mode == "train":
        errors += push_problems(config.export.push_to_hub)
    return errors


def _plan_errors(c: ml_collections.ConfigDict) -> list[str]:
    errors = []
    source = c.plan.model_config or c.model.path
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    if not source:
        errors.append(
            "mode 'plan' needs config key 'model.path' (a directory with config.json; no weights "
            "needed) or 'plan.model_config'"
        )
    elif not os.path.isfile(path):
        errors.append(f"config key 'plan.model_config' / 'model.path': no config.json at {source}")
    if c.plan.target.startswith("gpu:"):
        try:
            gpu_targets.parse(c.plan.target)
        except gpu_targets.GpuTargetError as e:
            errors.append(f"config key 'plan.target': {e}")
    elif c.plan.target != "local" and not c.plan.target.startswith("tpu:"):
        errors.append(
            f"config key 'plan.target' must be 'local', 'tpu:<topology>' (e.g. tpu:v5e:2x2) or "
            f"'gpu:<chip>:<gpus>' (e.g. gpu:h100:8), got {c.plan.target!r}"
        )
    return errors


def _path_errors(c: ml_collections.ConfigDict) -> list[str]:
    if c.mode == "plan":
        return _plan_errors(c)
    errors = []
    if not c.model.path and c.mode not in ("collect", "loop", "submit"):
        errors.append(
            "config key 'model.path' is required: a local Hugging Face model directory or a Hub "
            "id (org/name)"
        )
    for key in ("model.path", "reference.path"):
        path = c.model.path if key == "model.path" else c.reference.path
        if path and not os.path.isdir(path) and not is_hub_id(path):
            errors.append(
                f"config key '{key}': {path} is neither a directory nor a Hub id (org/name or "
                "org/name@revision)"
            )
    if c.mode == "evaluate" and not (c.data.eval_path or c.data.train_path):
        errors.append("mode 'evaluate' needs config key 'data.eval_path' (or data.train_path)")
    if c.mode == "train" and not c.data.train_path:
        errors.append("config key 'data.train_path' is required for mode 'train'")
    for key in ("train_path", "eval_path") if c.mode != "export" else ():  # export reads none
        path = c.data[key]
        if path and not os.path.exists(path) and not is_hub_id(path):
            errors.append(
                f"config key 'data.{key}': {path} does not exist (and is not a Hub dataset id "
                "org/name)"
            )
    return errors + _chat_errors(c)


def _chat_errors(c: ml_collections.ConfigDict) -> list[str]:
    errors = []
    try:
        kwargs = json.loads(c.data.chat_template_kwargs or "{}")
    except ValueError as e:
        kwargs, errors = None, [f"config key 'data.chat_template_kwargs' is not valid JSON: {e}"]
    if kwargs is not None and not isinstance(kwargs, dict):
        errors.append("config key 'data.chat_template_kwargs' must be a JSON object")
    try:
        read_chat_template(c.data.chat_template)
    except ValueError as e:
        errors.append(f"config key 'data.chat_template': {e}")
    return errors


def _reference_errors(c: ml_collections.ConfigDict) -> list[str]:
    """The reference's keys against the loss (reference-free or not) and each other."""
    errors = []
    without_reference = schema.frozen_view(LossSettings, c.loss).without_reference
    if without_reference and c.reference.path:
        errors.append(
            "config key 'reference.path' is set but the loss is reference-free (loss.reference_free"
            "=True, or loss.type orpo / cpo): no reference is loaded or run; leave reference.path "
            "empty"
        )
    if c.reference.sync_every and c.reference.type == "precomputed":
        errors.append(
            "config key 'reference.sync_every' (TR-DPO) moves the reference during training, but "
            "reference.type=precomputed computes its log-probs once before: use frozen or "
            "lora_base, or set reference.sync_every=0"
        )
    if c.reference.sync_every and without_reference:
        errors.append(
            "config key 'reference.sync_every' (TR-DPO) is set but the loss is reference-free "
            "(no reference to sync): set reference.sync_every=0"
        )
    if c.reference.type == "lora_base" and c.reference.path:
        errors.append("config key 'reference.path' must be empty with reference.type=lora_base")
    return errors


def _training_errors(c: ml_collections.ConfigDict) -> list[str]:
    errors = []
    if c.reference.type == "lora_base" and c.lora.rank <= 0:
        errors.append(
            "config key 'reference.type' is 'lora_base' but LoRA is off: set lora.rank > 0, or use "
            "reference.type=frozen"
        )
    errors += _lora_target_errors(c) + _quantization_errors(c)
    if not c.export.merged and c.lora.rank <= 0:
        errors.append(
            "config key 'export.merged' is False but LoRA is off (lora.rank is 0): without "
            "adapters the export is the whole model; set export.merged=True or lora.rank > 0"
        )
    if not c.export.merged and c.mode == "loop":
        errors.append(
            "config key 'export.merged' is False, but mode 'loop' plays each round with the "
            "round's exported model: leave it True"
        )
    if c.export.step and c.mode != "export":
        errors.append(
            f"config key 'export.step' ({c.export.step}) picks the checkpoint of mode 'export'; "
            f"mode '{c.mode}' exports its own final state: leave it at 0"
        )
    errors += _reference_errors(c)
    if c.model.attention_block % 128:
        errors.append(
            "config key 'model.attention_block' must be 0 (the TPU generation's block) or a "
            f"multiple of 128, got {c.model.attention_block}"
        )
    if c.train.steps == 0 and c.train.epochs == 0:
        errors.append("set config key 'train.steps' > 0 or 'train.epochs' > 0")
    if c.train.batch_size % max(c.train.grad_accum, 1):
        errors.append(
            f"config key 'train.batch_size' ({c.train.batch_size}) must be divisible by "
            f"train.grad_accum ({c.train.grad_accum})"
        )
    try:
        parse_report_to(c.train.report_to)
    except ValueError as e:
        errors.append(f"config key 'train.report_to': {e}")
    for key, parse in (("auto_fit", parse_auto_fit), ("profile_steps", parse_profile_steps)):
        try:
            parse(c.train[key])
        except ValueError as e:
            errors.append(f"config key 'train.{key}': {e}")
    lengths = c.data.row_lengths
    if not (
        all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)
        and list(lengths) == sorted(set(lengths))
    ):
        errors.append(
            f"config key 'data.row_lengths' must be increasing positive ints, e.g. (24, 48), "
            f"got {lengths!r}"
        )
    for key in ("row_bits", "group_size"):
        if c.data[key] < 0:
            errors.append(f"config key 'data.{key}' must be >= 0, got {c.data[key]}")
    if c.data.group_size and c.data.layout != "grouped":
        errors.append(
            f"config key 'data.group_size' applies to data.layout='grouped' only (the layout is "
            f"{c.data.layout!r}); set it to 0 or use the grouped layout"
        )
    types = parse_loss_types(c.loss.type)
    if c.loss.weights and len(c.loss.weights) != len(types):
        errors.append(
            f"config key 'loss.weights' has {len(c.loss.weights)} entries for {len(types)} loss types"
        )
    bad = [t for t in types if t not in LOSS_TYPES + UNPAIRED_LOSS_TYPES]
    if bad or not types:
        errors.append(
            f"config key 'loss.type': unknown loss {bad or c.loss.type!r}; choose from "
            f"{', '.join(sorted(LOSS_TYPES + UNPAIRED_LOSS_TYPES))}"
        )
    return errors + _unpaired_errors(c, types) + _bco_errors(c, types)


def _unpaired_errors(c: ml_collections.ConfigDict, types: tuple[str, ...]) -> list[str]:
    """The unpaired losses (kto, apo_zero_unpaired, bco) against the other keys."""
    unpaired = [t for t in types if t in UNPAIRED_LOSS_TYPES]
    if not unpaired:
        if c.data.format == "unpaired":
            return [
                "config key 'data.format' is 'unpaired' (prompt, completion, label records) but "
                f"loss.type {c.loss.type!r} is a paired loss: use loss.type kto, "
                "apo_zero_unpaired or bco, or a pair format"
            ]
        return []
    if len(types) > 1:
        return [
            f"config key 'loss.type': {unpaired[0]!r} is an unpaired loss and cannot be combined "
            f"with other losses ({c.loss.type!r}); give it alone"
        ]
    loss_type = types[0]
    errors = []
    micro = micro_batch_pairs(c.train.batch_size, c.train.grad_accum)
    try:
        check_kto_batch_size(loss_type, micro)
    except ValueError as e:
        errors.append(
            f"config keys 'train.batch_size' / 'train.grad_accum': {e} (the examples of one "
            "micro-batch, train.batch_size / train.grad_accum)"
        )
    refused = {
        "reference.sync_every": (c.reference.sync_every > 0, "must be 0 (no TR-DPO)"),
        "loss.reference_free": (c.loss.reference_free, "must be False"),
        "loss.ld_alpha": (c.loss.ld_alpha != 1.0, "must be 1"),
        "loss.use_weighting": (c.loss.use_weighting, "must be False"),
        "loss.weights": (bool(c.loss.weights), "must be ()"),
        "data.streaming": (c.data.streaming, "must be False"),
        "mode": (
            c.mode == "submit",
            "cannot be 'submit' (a Customizer DPO job takes pairs)",
        ),
    }
    for key, (bad, need) in refused.items():
        if bad:
            errors.append(
                f"config key '{key}' {need} with loss.type {loss_type!r} (not supported for the "
                "unpaired losses)"
            )
    return errors


def _bco_errors(c: ml_collections.ConfigDict, types: tuple[str, ...]) -> list[str]:
    """bco weighs its examples equally (TRL's BCOConfig has no desirable / undesirable
    weights): other weights would be ignored."""
    if types != ("bco",):
        return []
    return [
        f"config key 'loss.{key}' must be 1 with loss.type 'bco' (bco weighs every example "
        f"equally), got {c.loss[key]}"
        for key in ("desirable_weight", "undesirable_weight")
        if c.loss[key] != 1.0
    ]


def _callback_errors(c: ml_collections.ConfigDict) -> list[str]:
    """The built-in callbacks of a training run need evaluation pairs."""
    if c.mode not in ("train", "loop"):
        return []
    evaluates = c.data.eval_path or (c.data.eval_split and c.data.train_path)
    errors = []
    for key in ("early_stopping_patience", "log_completions_every"):
        if c.train[key] and not evaluates:
            errors.append(
                f"config key 'train.{key}' ({c.train[key]}) needs evaluation pairs: set "
                "data.eval_path (or data.eval_split), or set it to 0"
            )
    return errors


def _quantization_errors(c: ml_collections.ConfigDict) -> list[str]:
    """A quantized base only under LoRA, an even nf4 block, no TR-DPO mixing of quantized
    codes."""
    scheme = c.model.quantization
    if scheme == "none":
        return []
    errors = []
    if c.lora.rank <= 0:
        errors.append(
            f"config key 'model.quantization' is {scheme!r} but LoRA is off (lora.rank is 0): a "
            "quantized base is frozen, so full fine-tuning cannot train it; set lora.rank > 0 or "
            "model.quantization=none"
        )
    if scheme == "nf4" and c.model.quantization_block % 2:
        errors.append(
            f"config key 'model.quantization_block' ({c.model.quantization_block}) must be even "
            "with model.quantization=nf4 (two 4-bit codes per byte)"
        )
    if c.reference.sync_every and c.reference.type == "frozen":
        errors.append(
            "config key 'reference.sync_every' (TR-DPO) would mix a frozen reference's quantized "
            "codes (model.quantization); use reference.type=lora_base, or model.quantization=none"
        )
    return errors


def _lora_target_errors(c: ml_collections.ConfigDict) -> list[str]:
    """lora.targets, where LoRA is on: projection names the model knows, at least one."""
    if c.lora.rank <= 0:
        return []
    targets = list(c.lora.targets)
    bad = [t for t in targets if t not in LORA_TARGETS]
    if bad or not targets:
        what = "is empty"
        if bad:
            names = ", ".join(map(repr, bad))
            what = f"{names} {'is not a projection' if len(bad) == 1 else 'are not projections'}"
        return [
            f"config key 'lora.targets': {what}; choose from {', '.join(LORA_TARGETS)} (e.g. "
            "--config.lora.targets=\"('q_proj','v_proj')\")"
        ]
    return []


def _cudnn_errors(c: ml_collections.ConfigDict) -> list[str]:
    """model.attention=cudnn where the config alone shows it cannot run exactly: a layout cuDNN's
    masks do not express, float32, a plan for another platform. The model's own limits (head
    dim, soft-capping) are checked when it is loaded, the platform when the run starts."""
    if c.model.attention != "cudnn":
        return []
    errors = []
    if c.data.layout not in CUDNN_LAYOUTS:
        errors.append(
            f"config key 'model.attention' is 'cudnn', which expresses data.layout="
            f"{'/'.join(CUDNN_LAYOUTS)} only (per-row sequence lengths), not "
            f"{c.data.layout!r}: use model.attention=flash (or auto, which picks it there)"
        )
    if c.model.dtype == "float32":
        errors.append(
            "config key 'model.attention' is 'cudnn', which takes bfloat16 or float16: set "
            "model.dtype=bfloat16 (or auto), or use model.attention=flash"
        )
    if c.mode == "plan" and c.plan.target != "local" and not c.plan.target.startswith("gpu:"):
        errors.append(
            f"config key 'model.attention' is 'cudnn', an NVIDIA GPU kernel, but plan.target is "
            f"{c.plan.target!r}: use auto (or pallas/flash)"
        )
    return errors


def _collect_errors(c: ml_collections.ConfigDict) -> list[str]:
    errors = []
    if not c.collect.workflow:
        return [
            f"config key 'collect.workflow' is required for mode '{c.mode}'"
            + (" without data.train_path" if c.mode == "submit" else "")
            + ": a registered workflow name (e.g. tictactoe) or 'package.module:ClassName'"
        ]
    if c.mode == "loop" and not c.loop.best_metric:
        errors.append(
            "config key 'loop.best_metric' is required for mode 'loop': the evaluation "
            "metric(s) of the workflow that pick the exported round (e.g. optimal_move_rate)"
        )
    try:
        factory = workflow_class(c.collect.workflow)
    except ValueError as e:
        return [f"config key 'collect.workflow': {e}"]
    options = c.collect.get(c.collect.workflow)
    if options is not None:
        prefix = f"collect.{c.collect.workflow}"
        for name, problem in option_problems(factory, options.to_dict()):
            errors.append(f"config key '{prefix}.{name}' {problem}")
    try:
        RoundRank(c.loop.best_metric, c.loop.best_mode)
    except ValueError as e:
        errors.append(f"config keys 'loop.best_metric' / 'loop.best_mode': {e}")
    errors += _gate_errors(c)
    try:
        json.loads(c.collect.workflow_kwargs or "{}")
    except ValueError as e:
        errors.append(f"config key 'collect.workflow_kwargs' must be a JSON object: {e}")
    return errors


def _gate_errors(c: ml_collections.ConfigDict) -> list[str]:
    try:
        gate = Gate(c.loop.gate)
    except ValueError as e:
        return [f"config key 'loop.gate': {e}"]
    if c.loop.gate_rounds < 0:
        return ["config key 'loop.gate_rounds' must be >= 0 (0: never stop on the gate)"]
    if c.loop.gate_rounds and not gate:
        return [
            "config key 'loop.gate_rounds' needs 'loop.gate': the conditions that must hold "
            "(e.g. 'optimal_move_rate>=0.95')"
        ]
    return []


def _customizer_errors(c: ml_collections.ConfigDict) -> list[str]:
    """The Customizer client's own checks of `customizer.*`, in the config's wording."""
    errors = []
    for line in settings_problems(c.customizer):
        key, _, problem = line.partition(": ")
        if problem == "is required":
            problem += " for mode 'submit'"
        errors.append(f"config key '{key}' {problem}")
    return errors


def _mesh_errors(c: ml_collections.ConfigDict, num_devices: int | None) -> list[str]:
    sizes = [c.mesh.data, c.mesh.fsdp, c.mesh.context, c.mesh.tensor]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        return [
            "config keys 'mesh.data', 'mesh.fsdp', 'mesh.context', 'mesh.tensor': positive "
            "sizes, at most one -1"
        ]
    split_errors = context_errors(c)
    if split_errors or num_devices is None:
        return split_errors
    fixed = 1
    for s in sizes:
        fixed *= s if s > 0 else 1
    if num_devices % fixed:
        return [
            f"config key 'mesh': data*fsdp*context*tensor sizes {sizes} do not divide the "
            f"{num_devices} devices"
        ]
    # the context axis splits each row's length, not the batch: the batch is split over data x fsdp
    data_parallel = 1
    for s in sizes[:2]:
        data_parallel *= s if s > 0 else num_devices // fixed
    micro = micro_batch_pairs(c.train.batch_size, c.train.grad_accum)
    errors = []
    problem = indivisible(micro, data_parallel, "pairs per micro-batch")
    if problem:
        errors.append(
            f"config key 'train.batch_size': {problem}; change train.batch_size or the mesh"
        )
    evaluates = c.data.eval_path or (c.mode == "evaluate" and c.data.train_path)
    problem = indivisible(c.train.eval_batch_size, data_parallel, "pairs per evaluation batch")
    if evaluates and problem:
        errors.append(f"config key 'train.eval_batch_size': {problem}")
    return errors


def context_errors(c: ml_collections.ConfigDict) -> list[str]:
    """mesh.context > 1 (rows split over a context axis): every row length divides by
    2 * context and an attention that runs split rows."""
    context = c.mesh.context
    if context == -1:
        return [
            "config key 'mesh.context' must be a positive size (-1, the remaining devices, is "
            "for the data, fsdp or tensor axis)"
        ]
    if context == 1:
        return []
    errors = []
    d = c.data
    lengths = bucket_lengths(d.layout, d.max_length, d.row_lengths) if d.layout in LAYOUTS else ()
    bad = [n for n in lengths if n % (2 * context)]
    if bad:
        errors.append(
            f"config key 'mesh.context' ({context}) splits each row into 2 * {context} chunks, "
            f"but the row lengths {bad} do not divide by {2 * context}: set data.row_lengths "
            f"and data.max_length (the longest row is {layout_record(d.layout).longest_row} x "
            f"data.max_length) to multiples of {2 * context}"
        )
    if c.mode == "plan" and c.plan.row_length % (2 * context):  # the rows the plan pads to
        errors.append(
            f"config key 'plan.row_length' ({c.plan.row_length}) does not divide into the "
            f"2 * {context} chunks of mesh.context={context}: use a multiple of {2 * context}"
        )
    if c.model.attention not in ("auto", *SPLIT_ROW_IMPLEMENTATIONS):
        errors.append(
            f"config key 'model.attention' is {c.model.attention!r}, which does not run rows "
            f"split over mesh.context={context} yet: use auto, flash, pallas or reference, or set "
            "mesh.context=1"
        )
    return errors
