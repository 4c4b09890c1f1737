"""The config tree: one typed source of truth for every key.

Each group of keys is a frozen dataclass whose fields carry the default, the allowed choices
(imported from the module that owns them) and a one-line doc (`dpojax.schema`). A workflow's own
options join the tree as `collect.<workflow>.*` (see `dpojax.collect.workflow`), and the
`customizer.*` keys are the Customizer client's settings (`dpojax.customizer.client.settings`),
the `loss.*` keys the loss's (`dpojax.train.loss_settings`), the `model.*` and `lora.*` keys the
models' (`dpojax.models.model_settings`), ranges on the fields.
The tree names no workflow: a recipe that collects sets `collect.workflow` and `loop.best_metric`
(configs/tictactoe.py).

Why one module of this length: it is the tree of every key, one dataclass per group in the order
docs/config.md shows them; the groups whose code owns them live beside that code
(`LossSettings` in `dpojax.train.loss_settings`, `ModelSettings` and `LoraSettings` in
`dpojax.models.model_settings`, `CustomizerSettings` in the Customizer client).
"""

from __future__ import annotations

import dataclasses

import ml_collections

from dpojax import schema
from dpojax.collect.workflow import (
    LOOP_REFERENCES,
    option_keys,
    registered_workflows,
    workflow_class,
)
from dpojax.config.modes import MODES
from dpojax.customizer.client.settings import CustomizerSettings
from dpojax.data.layouts import LAYOUTS, PACKINGS
from dpojax.data.pair_files import READ_FORMATS
from dpojax.data.tokenize import TRUNCATION_MODES
from dpojax.models.model_config import DTYPES
from dpojax.models.model_settings import LoraSettings, ModelSettings
from dpojax.models.tiny import TINY_FAMILIES
from dpojax.runtime import DISTRIBUTED_INIT
from dpojax.schema import group, options, setting
from dpojax.train.checkpoint import BEST_MODES, ON_CORRUPT
from dpojax.train.loss_settings import LossSettings
from dpojax.train.optim import OPTIMIZERS, SCHEDULES
from dpojax.train.reference_choice import REFERENCE_TYPES
from dpojax.train.step import NONFINITE_POLICIES


@dataclasses.dataclass(frozen=True)
class ReferenceSettings:
    """The reference model of the preference loss."""

    type: str = setting(
        "frozen",
        "frozen: a copy of the initial policy (or reference.path); lora_base: the policy's "
        "base under LoRA; precomputed: log-probs computed once before training.",
        choices=REFERENCE_TYPES,
    )
    path: str = setting(
        "",
        "A separate reference model (local HF directory or Hub id); default: the policy.",
    )
    cache_dir: str = setting(
        "",
        "Where precomputed reference log-probs are cached; default WORKDIR/reference_cache (in "
        "a loop with loop.reference=initial: the loop's, shared by its rounds).",
    )
    sync_every: int = setting(
        0,
        "TR-DPO (TRL sync_ref_model / ref_model_sync_steps): every N optimizer steps the "
        "reference moves toward the policy, ref = alpha * policy + (1 - alpha) * ref (frozen: its "
        "weights; lora_base: a snapshot of the adapters, factor by factor); 0: off.",
    )
    sync_alpha: float = setting(
        0.6, "TR-DPO's mixing weight alpha (TRL ref_model_mixup_alpha); 1: hard copy."
    )


@dataclasses.dataclass(frozen=True)
class ColumnSettings:
    """Dataset column names, when they differ from TRL's (docs/data.md#record-shapes)."""

    prompt: str = setting("", "Column holding the prompt ('' = prompt).")
    chosen: str = setting("", "Column holding the chosen completion ('' = chosen).")
    rejected: str = setting("", "Column holding the rejected completion ('' = rejected).")
    tools: str = setting("", "Column holding per-record tool schemas ('' = tools).")
    chat_template_kwargs: str = setting(
        "", "Column holding per-record chat-template arguments ('' = chat_template_kwargs)."
    )


@dataclasses.dataclass(frozen=True)
class UnpairedSettings:
    """How collected TTC events become unpaired examples (modes collect and loop with an
    unpaired loss; docs/data.md#unpaired-examples)."""

    threshold: float = setting(
        0.5,
        "A candidate scoring >= threshold is desirable, any other undesirable, so single-candidate "
        "decision points count (used when top_k is 0).",
    )
    top_k: int = setting(
        0,
        "Label by rank instead: per decision point the k best candidates are desirable and the k "
        "worst, scoring below them, undesirable; 0: by threshold.",
    )


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """Preference pairs and how they become batches."""

    train_path: str = setting(
        "",
        "Training pairs: Customizer or TRL JSONL / JSON, parquet, a folder of parquet / JSON / "
        "arrow shards, a datasets save_to_disk folder, or a Hub dataset id org/name[@revision].",
    )
    eval_path: str = setting(
        "", "Evaluation pairs (same sources); empty: data.eval_split of train_path, or none."
    )
    train_split: str = setting(
        "", "Split of train_path (e.g. train_prefs, train[:2000]); '' = the only one, else train."
    )
    eval_split: str = setting(
        "",
        "Split for evaluation: of eval_path, or of train_path when eval_path is empty ('' = "
        "no evaluation then).",
    )
    subset: str = setting("", "Dataset configuration (subset) of a Hub dataset or dataset folder.")
    streaming: bool = setting(
        False,
        "Read records one by one (datasets streaming) instead of preparing the dataset first.",
    )
    columns: ColumnSettings = group(ColumnSettings)
    unpaired: UnpairedSettings = group(UnpairedSettings)
    system_prompt: str = setting(
        "", "A system message put first in conversational prompts that have none."
    )
    chat_template: str = setting(
        "",
        "Chat template replacing the tokenizer's: Jinja text, or the path of a file holding it "
        "(saved with the exported model).",
    )
    chat_template_kwargs: str = setting(
        "{}",
        'JSON object of chat-template arguments, e.g. {"enable_thinking": false} (a record\'s own '
        "chat_template_kwargs win).",
    )
    format: str = setting(
        "auto",
        "Pair file format; 'unpaired': TRL unpaired records (prompt, completion, label) for "
        "loss.type kto / apo_zero_unpaired / bco (which read auto as unpaired records, or as "
        "pairs to unpair when the first record has no label; trl / customizer pairs are "
        "unpaired).",
        choices=(*READ_FORMATS, "unpaired"),
    )
    max_length: int = setting(512, "Longest prompt + completion in tokens (longer are truncated).")
    truncation_mode: str = setting(
        "keep_start", "Which end of an over-long sequence is kept.", choices=TRUNCATION_MODES
    )
    layout: str = setting(
        "padded", "Batch layout (docs/layouts.md): all give the same log-probs.", choices=LAYOUTS
    )
    packing: str = setting(
        "first_fit", "Bin-packing rule of the packing layouts.", choices=PACKINGS
    )
    row_lengths: tuple = setting(
        (),
        "Row lengths of the batch shapes, increasing; () = powers of two from 16 up to the longest "
        "row the layout can need, which is always added.",
    )
    row_bits: int = setting(
        3,
        "Row counts of the packing layouts are rounded up to this many bits after the leading "
        "one (3: at most 12.5% extra rows); 0: powers of two (fewer shapes to compile, more "
        "padding).",
    )
    group_size: int = setting(
        0,
        "grouped layout: the most pairs of one group (a turn, or one prompt) kept together in a "
        "batch; a larger group is cut into pieces of this many, shuffled separately, so a batch "
        "sees more prompts; 0: whole groups.",
    )
    strict: bool = setting(False, "A bad record is an error (True) or skipped and counted.")
    shuffle: bool = setting(True, "Shuffle the training pairs each epoch (seeded).")
    token_cache: bool = setting(
        True, "Cache tokenized pairs on disk, keyed by data, tokenizer and settings."
    )
    token_cache_dir: str = setting("", "Token cache directory; default WORKDIR/token_cache.")


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    """The optimizer and the learning-rate schedule."""

    name: str = setting("adamw", "Optimizer.", choices=OPTIMIZERS)
    learning_rate: float = setting(5e-7, "Peak learning rate (> 0).")
    schedule: str = setting("cosine", "Decay after warmup.", choices=SCHEDULES)
    warmup_steps: int = setting(0, "Linear warmup steps (0: use warmup_ratio).")
    warmup_ratio: float = setting(0.0, "Warmup as a fraction of the total steps.")
    min_lr_ratio: float = setting(0.0, "Final learning rate as a fraction of the peak.")
    weight_decay: float = setting(0.0, "Decoupled weight decay (adamw, lion).")
    b1: float = setting(0.9, "First-moment decay.")
    b2: float = setting(0.999, "Second-moment decay.")
    eps: float = setting(1e-8, "Adam epsilon.")
    max_grad_norm: float = setting(1.0, "Global-norm gradient clipping (0: off).")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Steps, batches and logging of a training run."""

    steps: int = setting(0, "Optimizer steps; 0: run train.epochs epochs.")
    epochs: int = setting(1, "Passes over the training pairs when train.steps is 0.")
    batch_size: int = setting(8, "Pairs per optimizer step, over all hosts.")
    grad_accum: int = setting(1, "Micro-batches per step (divides train.batch_size).")
    eval_every: int = setting(0, "Evaluate every this many steps; 0: at the end only.")
    eval_batch_size: int = setting(8, "Pairs per evaluation batch, over all hosts.")
    log_every: int = setting(1, "Write training metrics every this many steps.")
    nonfinite: str = setting(
        "stop",
        "A non-finite loss, gradient or update stops the run (last good checkpoint kept) or "
        "skips the update.",
        choices=NONFINITE_POLICIES,
    )
    vocab_chunk: int = setting(
        4096, "Vocabulary chunk of the log-softmax (0: the whole vocabulary)."
    )
    token_metrics: bool = setting(
        True,
        "Log TRL's token metrics of the policy (entropy, mean_token_accuracy, logits/chosen, "
        "logits/rejected), from the log-prob pass over the vocabulary.",
    )
    progress: bool = setting(
        True,
        "Show progress (process 0): a bar on a terminal or in a notebook, else (a batch job's "
        "log) a plain line at the first and last step and every 30 s.",
    )
    auto_fit: str = setting(
        "on",
        "Before the first step, compile the step and, if it does not fit the devices' memory, "
        "take the cheapest change that fits and keeps the global batch: on (grad_accum, then "
        "model.remat, then model.param_dtype, where the config leaves them at their defaults), "
        "off, or a comma-separated list of those keys it may change even where set.",
    )
    usable_memory_gib: float = setting(
        0.0,
        "Memory per device the auto-fit check plans for; 0: the device's limit (on a CPU: 80% of "
        "the host's available memory, cgroup limit included).",
    )
    prefetch_steps: int = setting(
        2, "Steps of batches built and put on the devices ahead, on a background thread (0: off)."
    )
    profile_steps: str = setting(
        "",
        "Steps to trace with the JAX profiler, 'first:last' (e.g. 10:15); the trace (TensorBoard "
        "/ Perfetto) goes to WORKDIR/profile. '': none.",
    )
    step_timeout_seconds: float = setting(
        1800.0,
        "Multi-process runs: a step (with its evaluation and checkpoint) that takes longer stops "
        "the run with every thread's stack (a hung collective or file system); 0: off.",
    )
    report_to: str = setting(
        "tensorboard",
        "Where metrics go besides metrics.jsonl: tensorboard, wandb, mlflow (comma-separated) "
        "or none.",
    )
    project: str = setting("dpojax", "W&B project / MLflow experiment of the run.")
    run_name: str = setting("", "W&B / MLflow run name; '' = the workdir's name.")
    report_plots: bool = setting(
        True, "Draw WORKDIR/plots/*.png for report.md (False: tables only)."
    )
    early_stopping_patience: int = setting(
        0,
        "Finish the run (completed there, with its exports) after this many evaluations in a row "
        "that do not improve checkpoint.best_metric (checkpoint.best_mode) by more than "
        "train.early_stopping_threshold; needs evaluation pairs. 0: off.",
    )
    early_stopping_threshold: float = setting(
        0.0, "The least change of checkpoint.best_metric that counts as an improvement."
    )
    log_completions_every: int = setting(
        0,
        "Every this many steps, write greedy completions of the first train.log_completions_count "
        "evaluation prompts to WORKDIR/completions.jsonl (their mean length as the metric "
        "completions/mean_tokens); needs evaluation pairs. 0: off.",
    )
    log_completions_count: int = setting(4, "Evaluation prompts that the completions log samples.")
    log_completions_max_tokens: int = setting(
        32, "Tokens at most of each logged completion (greedy)."
    )


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """Orbax checkpoints in WORKDIR/checkpoints."""

    every_steps: int = setting(100, "Save every this many steps (and at the end).")
    max_to_keep: int = setting(3, "Latest checkpoints kept (plus the best one).")
    best_metric: str = setting("loss", "Evaluation metric that picks the best checkpoint.")
    best_mode: str = setting(
        "min", "Whether the best value is the lowest or highest.", choices=BEST_MODES
    )
    async_save: bool = setting(True, "Write checkpoints in the background.")
    compress: bool = setting(
        False,
        "zstd-compress the saved arrays: ~10% smaller checkpoints of float weights, but the save "
        "holds a compressed copy of the state in host memory and takes longer (docs/resume.md).",
    )
    on_corrupt: str = setting(
        "stop",
        "A latest checkpoint that fails its content checksums or cannot be read, when a run "
        "resumes or a workdir is exported or evaluated: stop (exit 3, naming the step and its "
        "files) or go back to the newest earlier step that verifies (previous; a resumed run "
        "moves the corrupt steps to checkpoints/STEP.corrupt). docs/resume.md.",
        choices=ON_CORRUPT,
    )


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    """Device mesh: data x fsdp x context x tensor (one size may be -1: the remaining devices)."""

    data: int = setting(-1, "Data-parallel axis size.")
    fsdp: int = setting(1, "Parameter-sharding (FSDP) axis size; batches are split over it too.")
    context: int = setting(
        1,
        "Context-parallel axis size: each row's length is split over it (activations; keys and "
        "values gathered for attention), and its devices are FSDP shards too; > 1 needs row "
        "lengths divisible by 2 * context and attention auto, flash, pallas or reference "
        "(docs/long_context.md).",
    )
    tensor: int = setting(1, "Tensor-parallel axis size (heads, MLP, vocabulary).")


@dataclasses.dataclass(frozen=True)
class ExportSettings:
    """The exported HF model (WORKDIR/export)."""

    enabled: bool = setting(True, "Export at the end of training.")
    dtype: str = setting("", "Export dtype; '' = the parameter dtype.", choices=("", *DTYPES))
    merged: bool = setting(
        True,
        "With LoRA, also write the merged model; False: the adapter alone in PEFT's format at the "
        "top of the export (with the tokenizer and model card; loaded on model.path), a small "
        "export as TRL saves PEFT models.",
    )
    step: int = setting(
        0,
        "mode=export: the checkpoint step to export into WORKDIR/export_step_<step> (one that "
        "checkpoint.max_to_keep kept); 0: the latest, into WORKDIR/export.",
    )
    push_to_hub: str = setting(
        "",
        "After training, upload WORKDIR/export with a model card to this Hub repository "
        "(org/name); needs HF_TOKEN or `hf auth login`.",
    )
    private: bool = setting(True, "Create the push_to_hub repository as private.")


@dataclasses.dataclass(frozen=True)
class CollectSettings:
    """On-policy collection (modes collect and loop). The workflow's own options are the keys
    `collect.<workflow>.*`."""

    workflow: str = setting(
        "", "The workflow: a registered name (e.g. tictactoe) or 'package.module:ClassName'."
    )
    workflow_kwargs: str = setting("{}", "JSON keyword arguments for the workflow.")
    num_runs: int = setting(1, "Collection runs per round.")
    continue_on_collection_error: bool = setting(
        False, "A failing run is skipped (True) or ends the collection, as in NAT."
    )
    distinct: bool = setting(True, "Candidates are drawn without replacement.")
    temperature: float = setting(1.0, "Sampling temperature of the candidates.")
    top_k: int = setting(0, "Top-k sampling (0: off).")
    top_p: float = setting(1.0, "Nucleus sampling (1: off).")
    max_new_tokens: int = setting(4, "Tokens generated per candidate.")
    eval_max_new_tokens: int = setting(
        0, "Tokens generated by the greedy evaluation; 0: max_new_tokens."
    )
    ttc_step_name: str = setting("dpo_candidate_move", "Events of this step name become pairs.")
    exhaustive_pairs: bool = setting(
        True, "Every better/worse candidate pair (NAT's exhaustive mode)."
    )
    min_score_diff: float = setting(0.0, "Smallest score difference of a pair.")
    max_pairs_per_turn: int = setting(0, "Pairs kept per turn (exhaustive mode); 0: no cap.")
    reward_from_score_diff: bool = setting(
        True, "A pair's reward is the score difference (else the chosen score)."
    )
    deduplicate_pairs: bool = setting(True, "Drop repeated pairs (NAT's key).")
    max_pairs: int = setting(
        0, "Pairs (unpaired examples with an unpaired loss) kept per round (seeded sample); 0: all."
    )
    workflows: dict = options(
        "The workflows' own options by workflow name (the keys collect.<workflow>.*)."
    )


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """Rounds of collect -> train -> evaluate (mode loop)."""

    rounds: int = setting(4, "Rounds to run.")
    reference: str = setting(
        "initial",
        "Reference of each round: the initial model, or the round's starting policy.",
        choices=LOOP_REFERENCES,
    )
    replay_rounds: int = setting(
        0, "Also train on the pairs of this many previous rounds (-1: all)."
    )
    max_train_pairs: int = setting(
        0, "Cap on the pairs (or unpaired examples) one round trains on; 0: none."
    )
    replay_dedup: bool = setting(
        True,
        "Deduplicate replayed pairs across rounds (False: a pair counts once per round that "
        "collected it, weighting positions by how often the policy visits them).",
    )
    whole_batches: bool = setting(
        False, "Train each round on a multiple of train.batch_size pairs (one step shape)."
    )
    max_wall_seconds: float = setting(
        0.0,
        "Wall-clock budget: no new round starts once the time so far plus the last round's "
        "duration would pass it; 0: none.",
    )
    gate: str = setting(
        "",
        "Quality gate: comma-separated METRIC OP NUMBER conditions on the workflow's evaluation "
        "(e.g. 'optimal_move_rate>=0.95,losses_total<=0'); the summary records the rounds that "
        "meet it and when it was first met; '': none.",
    )
    gate_rounds: int = setting(
        0, "Stop once the gate has held for this many consecutive rounds; 0: never stop on it."
    )
    best_metric: str = setting("", "Workflow metric(s) that pick the exported round, in order.")
    best_mode: str = setting("max", "min or max, or one per metric ('min,max').")
    init_tiny_model: str = setting(
        "llama",
        "Without model.path: the family of the fresh random tiny model.",
        choices=TINY_FAMILIES,
    )
    init_seed: int = setting(0, "Seed of that tiny model.")
    init_model_overrides: str = setting("{}", "JSON ModelConfig overrides for that tiny model.")
    keep_round_files: bool = setting(
        False,
        "Keep every file of finished rounds (True), or only what later rounds and the report "
        "need: pairs, events, metrics, and the exports of the best and the latest round.",
    )


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """Multi-process runs (jax.distributed)."""

    initialize: str = setting(
        "auto",
        "auto: when configured or detected (TPU pods, SLURM, MPI); always; never.",
        choices=DISTRIBUTED_INIT,
    )
    coordinator_address: str = setting("", "HOST:PORT of process 0's coordinator.")
    num_processes: int = setting(0, "Number of processes; 0: detect.")
    process_id: int = setting(-1, "This process's index; -1: detect.")
    initialization_timeout: int = setting(
        300, "Seconds a process waits for all the others to join before it gives up."
    )
    heartbeat_timeout_seconds: int = setting(
        100, "Seconds without a heartbeat after which a process counts as dead and all stop."
    )


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """Ahead-of-time plans (mode plan; docs/plan.md)."""

    target: str = setting(
        "local",
        "What to compile for: 'local' (this process's devices), 'tpu:<topology>', e.g. "
        "tpu:v5e:2x2, tpu:v5p:2x2x1, tpu:v6e:2x4 (needs the tpu-plan extra), or "
        "'gpu:<chip>:<gpus>' / 'gpu:<chip>:<hosts>x<gpus>' for a100, a100-40gb, h100, h100-pcie, "
        "h100-nvl, h200, b200, l4, t4, e.g. gpu:h100:8, gpu:h100:2x8, gpu:l4:1 (needs the gpu-plan "
        "extra; no GPU needed).",
    )
    model_config: str = setting(
        "", "A config.json (or its directory) to plan for; default: model.path's."
    )
    rows: int = setting(0, "Rows per micro-batch; 0: what the recipe's layout builds.")
    row_length: int = setting(0, "Tokens per row; 0: what the recipe's layout builds.")
    completion_fraction: float = setting(
        0.5, "Share of each data.max_length sequence that is completion (scored) tokens."
    )
    search: bool = setting(
        False,
        "Also compile the nearest changes (remat, fsdp, micro-batches, bf16 parameters) and rank "
        "them.",
    )
    max_candidates: int = setting(8, "At most this many configurations are compiled.")
    chip: str = setting(
        "",
        "Chip for the roofline (v4, v5e, v5p, v6e, a100, h100, h200); '': the target's.",
    )
    longest_row: bool = setting(
        False,
        "Also find the longest data.max_length whose step (one pair per data-parallel group, one "
        "micro-batch) fits the target: doubling from the recipe's, then bisecting on multiples "
        "of lcm(2 * mesh.context, 128) up to the model's max_position_embeddings; reports every "
        "compile (docs/plan.md).",
    )


@dataclasses.dataclass(frozen=True)
class Config:
    """Every key of a dpojax run."""

    mode: str = setting("train", "The job to run (dpojax.jobs).", choices=MODES)
    seed: int = setting(0, "Seed of data order, LoRA init and collection.")
    compilation_cache_dir: str = setting(
        "user",
        "JAX's persistent compilation cache: 'user' ($XDG_CACHE_HOME or ~/.cache, then "
        "dpojax/jax_compilation), a local folder (relative: under WORKDIR), or '' (off).",
    )
    compilation_cache_min_seconds: float = setting(
        1.0, "Only compilations at least this long are cached."
    )
    allow_config_change: bool = setting(
        False,
        "Resuming a workdir (train, loop) with settings other than its config.json: refused, "
        "naming the keys (False), or continued with the new ones, logged in "
        "config_changes.jsonl (True).",
    )
    allow_input_change: bool = setting(
        False,
        "Resuming a workdir (train) whose training data (its tokens and labels) or model or "
        "reference weights differ from those its run started with: refused, naming what changed "
        "(False), or continued on the new ones, logged in config_changes.jsonl (True).",
    )
    model: ModelSettings = group(ModelSettings)
    reference: ReferenceSettings = group(ReferenceSettings)
    lora: LoraSettings = group(LoraSettings)
    data: DataSettings = group(DataSettings)
    loss: LossSettings = group(LossSettings)
    optim: OptimSettings = group(OptimSettings)
    train: TrainSettings = group(TrainSettings)
    checkpoint: CheckpointSettings = group(CheckpointSettings)
    mesh: MeshSettings = group(MeshSettings)
    export: ExportSettings = group(ExportSettings)
    collect: CollectSettings = group(CollectSettings)
    loop: LoopSettings = group(LoopSettings)
    customizer: CustomizerSettings = group(
        CustomizerSettings, "NeMo Customizer submission (mode submit); NAT's adapter keys."
    )
    distributed: DistributedSettings = group(DistributedSettings)
    plan: PlanSettings = group(PlanSettings)


def _workflow_options() -> dict[str, type]:
    """Registered workflows that declare typed options: name -> class."""
    out = {}
    for name in registered_workflows():
        factory = workflow_class(name)
        if option_keys(factory):
            out[name] = factory
    return out


def all_keys() -> list[schema.Key]:
    """Every key of the tree, the registered workflows' options included."""
    known = list(schema.keys(Config))
    for name, factory in _workflow_options().items():
        known += schema.keys(factory, f"collect.{name}.")
    return known


def default_config() -> ml_collections.ConfigDict:
    c = schema.to_config_dict(Config)
    for name, factory in _workflow_options().items():
        c.collect[name] = schema.to_config_dict(factory)
    return c


def check_keys(config: ml_collections.ConfigDict) -> list[str]:
    """Unknown keys, wrong types and values outside their choices, one line each."""
    return schema.check_values(dict(schema.leaves(config)), all_keys())


def frozen(config: ml_collections.ConfigDict) -> Config:
    """The typed, frozen view of a validated config that every job receives (`dpojax.jobs.run`
    makes it once): the tree's dataclasses with the config's values, a workflow's own options
    (`collect.<workflow>.*`) in `collect.workflows[<workflow>]`, read-only."""
    return schema.frozen_view(Config, config)
