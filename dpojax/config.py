"""The config tree: defaults and validation, once, before any compute.

Recipes (`configs/*.py`) start from `default_config()` and change what they need, so every key can
be overridden on the command line (`--config.optim.learning_rate=1e-5`) and a misspelt key is
refused. `validate(config)` returns one line per problem, each naming the key and the fix.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator

import ml_collections

MODES = ("train", "evaluate", "export", "collect", "loop", "submit")
LAYOUTS = ("padded", "packed", "prefix_shared", "grouped")
REFERENCE_TYPES = ("frozen", "lora_base", "precomputed")
NONFINITE = ("stop", "skip")


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mode = "train"
    c.seed = 0
    # JAX's persistent compilation cache: "" off; a relative path is under WORKDIR. Compiled steps
    # are reused by later runs and, in loop mode, by later rounds (each round builds new steps).
    c.compilation_cache_dir = ""
    # Only compilations at least this long are cached. Caching every small program too (0) cost
    # the tic-tac-toe recipe ~10 s a round on a 2-core CPU; caching only the train step (~3 s to
    # compile) saves ~2 s a round there.
    c.compilation_cache_min_seconds = 1.0

    c.model = ml_collections.ConfigDict()
    c.model.path = ""  # local HF directory of the policy
    c.model.dtype = "float32"  # compute dtype
    c.model.param_dtype = "float32"  # master weights / optimizer dtype
    c.model.remat = "none"  # none | full | dots | dots_no_batch

    c.reference = ml_collections.ConfigDict()
    c.reference.type = "frozen"  # frozen | lora_base | precomputed
    c.reference.path = ""  # default: the policy's initial weights
    c.reference.cache_dir = ""  # precomputed: default WORKDIR/reference_cache

    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 0
    c.lora.alpha = 16.0
    c.lora.targets = ("q_proj", "k_proj", "v_proj", "o_proj")

    c.data = ml_collections.ConfigDict()
    c.data.train_path = ""
    c.data.eval_path = ""
    c.data.format = "auto"  # auto | customizer | trl
    c.data.max_length = 512
    c.data.truncation_mode = "keep_start"  # keep_start | keep_end
    c.data.layout = "padded"  # padded | packed | prefix_shared | grouped
    c.data.packing = "first_fit"
    # Row lengths of the batch shapes (each batch uses the shortest that fits; packing layouts also
    # try the next). () = powers of two from 16 up to the longest row the layout can need, which
    # is always added. Short fixed-length data packs tighter with a length close to a multiple of
    # its pairs (e.g. (24, 48) for 23-token prefix-shared pairs).
    c.data.row_lengths = ()
    c.data.strict = False
    c.data.shuffle = True
    # Tokenized pairs are cached on disk (keyed by the data, the tokenizer and the settings), so a
    # resumed or repeated run skips tokenization. "" = WORKDIR/token_cache.
    c.data.token_cache = True
    c.data.token_cache_dir = ""

    c.loss = ml_collections.ConfigDict()
    c.loss.type = "sigmoid"  # a name, or several joined with "," (weights in loss.weights)
    c.loss.weights = ()
    c.loss.beta = 0.1
    c.loss.label_smoothing = 0.0
    c.loss.cdpo_smoothing = False
    c.loss.f_divergence = "reverse_kl"
    c.loss.f_alpha = 0.5
    c.loss.reference_free = False
    c.loss.ld_alpha = 1.0  # 1.0 = plain DPO
    c.loss.use_weighting = False  # WPO
    c.loss.discopop_tau = 0.05
    c.loss.preference_average_log_probs = False
    c.loss.sft_average_log_probs = False
    c.loss.preference_loss_weight = 1.0
    c.loss.sft_loss_weight = 0.0

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adamw"
    c.optim.learning_rate = 5e-7
    c.optim.schedule = "cosine"  # constant | linear | cosine
    c.optim.warmup_steps = 0
    c.optim.warmup_ratio = 0.0
    c.optim.min_lr_ratio = 0.0
    c.optim.weight_decay = 0.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.max_grad_norm = 1.0

    c.train = ml_collections.ConfigDict()
    c.train.steps = 0  # 0: run train.epochs epochs
    c.train.epochs = 1
    c.train.batch_size = 8  # pairs per optimizer step, over all hosts
    c.train.grad_accum = 1
    c.train.eval_every = 0  # 0: evaluate at the end only
    c.train.eval_batch_size = 8
    c.train.log_every = 1
    c.train.nonfinite = "stop"  # stop | skip
    c.train.vocab_chunk = 4096
    c.train.progress = True
    c.train.report_plots = True  # WORKDIR/plots/*.png in report.md (False: the tables only)

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 100
    c.checkpoint.max_to_keep = 3
    c.checkpoint.best_metric = "loss"  # an eval metric
    c.checkpoint.best_mode = "min"
    c.checkpoint.async_save = True

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1
    c.mesh.fsdp = 1
    c.mesh.tensor = 1

    c.export = ml_collections.ConfigDict()
    c.export.enabled = True
    c.export.dtype = ""  # default: the parameter dtype

    # On-policy collection (modes "collect" and "loop").
    c.collect = ml_collections.ConfigDict()
    c.collect.workflow = "tictactoe"  # built-in name or "package.module:ClassName"
    c.collect.workflow_kwargs = "{}"  # JSON keyword arguments for the workflow
    c.collect.tictactoe = ml_collections.ConfigDict()
    c.collect.tictactoe.games = 64
    c.collect.tictactoe.candidates = 8
    c.collect.tictactoe.opponent = "self"  # self | random | perfect
    c.collect.tictactoe.choose = "best"  # best | sampled
    c.collect.tictactoe.random_opening_plies = 2
    c.collect.tictactoe.style = "numbers"  # numbers | dots | grid | letters | compact
    # Keep at most as many candidates as the position has legal moves (the first ones drawn):
    # with distinct candidates, the rest can only be illegal fillers once the policy plays legally.
    c.collect.tictactoe.candidates_up_to_legal = False
    # With candidates_up_to_legal: keep at least this many candidates. 2: a position with a single
    # legal move still gets a pair (against the policy's likeliest other answer), so answering it
    # with an occupied cell gets corrected.
    c.collect.tictactoe.min_candidates = 1
    # Candidates are distinct moves: a repeat of an earlier candidate's cell (" 6" after "6") is
    # dropped and legal-looking answers are emitted in canonical form ("6"): one token per move.
    c.collect.tictactoe.distinct_moves = False
    # Probability that a decision's game goes on with a random legal move instead of the chosen
    # candidate: self-play then also visits the positions that blunders leave.
    c.collect.tictactoe.explore = 0.0
    c.collect.num_runs = 1
    c.collect.continue_on_collection_error = False
    c.collect.distinct = True  # candidates drawn without replacement
    c.collect.temperature = 1.0
    c.collect.top_k = 0
    c.collect.top_p = 1.0
    c.collect.max_new_tokens = 4  # per candidate
    c.collect.eval_max_new_tokens = 0  # greedy evaluation; 0: same as max_new_tokens
    c.collect.ttc_step_name = "dpo_candidate_move"
    c.collect.exhaustive_pairs = True
    c.collect.min_score_diff = 0.0
    c.collect.max_pairs_per_turn = 0  # 0: no cap
    c.collect.reward_from_score_diff = True
    c.collect.deduplicate_pairs = True
    c.collect.max_pairs = 0  # 0: all pairs

    c.loop = ml_collections.ConfigDict()
    c.loop.rounds = 4
    c.loop.reference = "initial"  # initial | previous
    c.loop.replay_rounds = 0  # also train on the pairs of this many previous rounds (-1: all)
    c.loop.max_train_pairs = 0  # 0: no cap on the pairs one round trains on
    # Deduplicate the replayed rounds' pairs against each other (True), or keep a pair once per
    # round that collected it (False): a replay buffer weighted by how often the policy visits
    # each position, in which one-off pairs of the first rounds fade instead of accumulating.
    c.loop.replay_dedup = True
    # Train each round on a multiple of train.batch_size pairs (a seeded sample leaves out the
    # remainder, fewer than one batch), so no round compiles a step for a last, partial batch.
    c.loop.whole_batches = False
    # A wall-clock budget (0: none): no new round starts once the time so far plus the last
    # round's duration would pass it, so the loop ends within about this many seconds.
    c.loop.max_wall_seconds = 0.0
    # The round exported as the result: the best by this metric of the workflow's evaluation, or
    # by several, comma-separated, compared in order (e.g. "losses_total,optimal_move_rate").
    c.loop.best_metric = "optimal_move_rate"
    c.loop.best_mode = "max"  # min | max, or one per metric ("min,max")
    c.loop.init_tiny_model = "llama"  # with model.path empty: a fresh random tiny model
    c.loop.init_seed = 0
    c.loop.init_model_overrides = "{}"  # JSON ModelConfig overrides for that tiny model

    # NeMo Customizer submission (mode "submit"); keys mirror NeMo Agent Toolkit's adapter.
    c.customizer = ml_collections.ConfigDict()
    c.customizer.entity_host = ""
    c.customizer.datastore_host = ""
    c.customizer.namespace = ""
    c.customizer.customization_config = ""
    c.customizer.dataset_name = "dpojax-dpo"
    c.customizer.create_namespace_if_missing = True
    c.customizer.hyperparameters = ml_collections.ConfigDict()
    c.customizer.hyperparameters.training_type = "dpo"  # dpo | sft
    c.customizer.hyperparameters.finetuning_type = "all_weights"  # all_weights | lora
    c.customizer.hyperparameters.epochs = 3
    c.customizer.hyperparameters.batch_size = 4
    c.customizer.hyperparameters.learning_rate = 5e-5
    c.customizer.hyperparameters.dpo = ml_collections.ConfigDict()
    c.customizer.hyperparameters.dpo.ref_policy_kl_penalty = 0.1
    c.customizer.hyperparameters.dpo.preference_loss_weight = 1.0
    c.customizer.hyperparameters.dpo.preference_average_log_probs = False
    c.customizer.hyperparameters.dpo.sft_loss_weight = 0.0
    c.customizer.use_full_message_history = False
    c.customizer.deploy_on_completion = False
    c.customizer.deployment_config = ml_collections.ConfigDict()
    c.customizer.deployment_config.image_name = "nvcr.io/nim/meta/llama-3.1-8b-instruct"
    c.customizer.deployment_config.image_tag = "latest"
    c.customizer.deployment_config.gpu = 1
    c.customizer.deployment_config.deployment_name = ""
    c.customizer.deployment_config.description = "Fine-tuned model deployment"
    c.customizer.poll_interval_seconds = 30.0
    c.customizer.deployment_timeout_seconds = 1800.0
    c.customizer.training_timeout_seconds = 86400.0
    c.customizer.max_consecutive_status_failures = 3
    c.customizer.hf_token = ""  # default: the HF_TOKEN environment variable
    c.customizer.wait_for_completion = True
    c.customizer.cancel_on_interrupt = "ask"
    c.customizer.cancel_on_timeout = True
    c.customizer.request_timeout_seconds = 60.0
    c.customizer.max_retries = 3
    c.customizer.retry_backoff_seconds = 0.5

    c.distributed = ml_collections.ConfigDict()
    c.distributed.initialize = "auto"  # auto | always | never
    c.distributed.coordinator_address = ""
    c.distributed.num_processes = 0
    c.distributed.process_id = -1
    return c


def _leaves(config: ml_collections.ConfigDict, prefix: str = "") -> Iterator[tuple[str, object]]:
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            yield from _leaves(value, name + ".")
        else:
            yield name, value


def check_keys(config: ml_collections.ConfigDict) -> list[str]:
    """Unknown keys and wrong types, compared with `default_config()`."""
    defaults = dict(_leaves(default_config()))
    errors = []
    for key, value in _leaves(config):
        if key not in defaults:
            close = difflib.get_close_matches(key, defaults, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            errors.append(f"config key '{key}' is unknown{hint}")
            continue
        want = defaults[key]
        ok = (
            isinstance(value, type(want))
            or (isinstance(want, float) and isinstance(value, int) and not isinstance(value, bool))
            or (isinstance(want, tuple) and isinstance(value, list))
        )
        if not ok or (isinstance(want, int) and isinstance(value, bool) != isinstance(want, bool)):
            errors.append(
                f"config key '{key}' must be {type(want).__name__}, got {type(value).__name__} "
                f"{value!r}"
            )
    return errors


def _choice(errors, config, key, choices):
    value = config
    for part in key.split("."):
        value = value[part]
    if value not in choices:
        errors.append(f"config key '{key}' must be one of {', '.join(choices)}; got {value!r}")


def validate(config: ml_collections.ConfigDict, *, num_devices: int | None = None) -> list[str]:
    """Every problem with `config`, one line each (empty when the config is usable)."""
    errors = check_keys(config)
    if errors:
        return errors
    c = config
    _choice(errors, c, "mode", MODES)
    _choice(errors, c, "reference.type", REFERENCE_TYPES)
    _choice(errors, c, "data.layout", LAYOUTS)
    _choice(errors, c, "data.truncation_mode", ("keep_start", "keep_end"))
    _choice(errors, c, "data.format", ("auto", "customizer", "trl"))
    _choice(errors, c, "train.nonfinite", NONFINITE)
    _choice(errors, c, "checkpoint.best_mode", ("min", "max"))
    _choice(errors, c, "optim.schedule", ("constant", "linear", "cosine"))
    _choice(errors, c, "optim.name", ("adamw", "adam", "sgd", "lion"))
    _choice(errors, c, "model.dtype", ("float32", "bfloat16", "float16"))
    _choice(errors, c, "model.param_dtype", ("float32", "bfloat16", "float16"))
    _choice(errors, c, "model.remat", ("none", "full", "dots", "dots_no_batch"))
    _choice(errors, c, "distributed.initialize", ("auto", "always", "never"))
    if c.export.dtype:
        _choice(errors, c, "export.dtype", ("float32", "bfloat16", "float16"))

    if c.mode == "submit":
        for key in ("entity_host", "datastore_host", "namespace", "customization_config"):
            if not c.customizer[key]:
                errors.append(f"config key 'customizer.{key}' is required for mode 'submit'")
    elif not c.model.path and c.mode not in ("collect", "loop", "submit"):
        errors.append("config key 'model.path' is required: a local Hugging Face model directory")
    elif c.model.path and not os.path.isdir(c.model.path):
        errors.append(f"config key 'model.path': {c.model.path} is not a directory")
    if c.reference.path and not os.path.isdir(c.reference.path):
        errors.append(f"config key 'reference.path': {c.reference.path} is not a directory")
    data_key = "data.train_path" if c.mode == "train" else None
    if c.mode in ("collect", "loop"):
        from dpojax.collect.tictactoe import STYLES  # numpy only, no jax
        from dpojax.collect.tictactoe_workflow import CHOICES, OPPONENTS, option_problems

        _choice(errors, c, "collect.tictactoe.opponent", OPPONENTS)
        _choice(errors, c, "collect.tictactoe.choose", CHOICES)
        if c.collect.workflow == "tictactoe":
            _choice(errors, c, "collect.tictactoe.style", STYLES)
            ttt = c.collect.tictactoe
            for name, problem in option_problems(
                explore=ttt.explore, min_candidates=ttt.min_candidates
            ):
                errors.append(f"config key 'collect.tictactoe.{name}' {problem}")
        _choice(errors, c, "loop.reference", ("initial", "previous"))
        try:
            from dpojax.collect.workflow import RoundRank  # no jax

            RoundRank(c.loop.best_metric, c.loop.best_mode)
        except ValueError as e:
            errors.append(f"config keys 'loop.best_metric' / 'loop.best_mode': {e}")
        for key in ("workflow_kwargs",):
            try:
                import json

                json.loads(c.collect[key] or "{}")
            except ValueError as e:
                errors.append(f"config key 'collect.{key}' must be a JSON object: {e}")
        if c.collect.num_runs < 1 or c.loop.rounds < 1:
            errors.append("config keys 'collect.num_runs' and 'loop.rounds' must be >= 1")
    if c.mode == "evaluate" and not (c.data.eval_path or c.data.train_path):
        errors.append("mode 'evaluate' needs config key 'data.eval_path' (or data.train_path)")
    if data_key and not c.data.train_path:
        errors.append(f"config key '{data_key}' is required for mode '{c.mode}'")
    for key in ("train_path", "eval_path"):
        path = c.data[key]
        if path and not os.path.exists(path):
            errors.append(f"config key 'data.{key}': {path} does not exist")

    if c.reference.type == "lora_base" and c.lora.rank <= 0:
        errors.append(
            "config key 'reference.type' is 'lora_base' but LoRA is off: set lora.rank > 0, or use "
            "reference.type=frozen"
        )
    if c.reference.type == "lora_base" and c.reference.path:
        errors.append("config key 'reference.path' must be empty with reference.type=lora_base")
    if c.lora.rank < 0:
        errors.append("config key 'lora.rank' must be >= 0")
    if c.loss.beta <= 0:
        errors.append(f"config key 'loss.beta' must be > 0, got {c.loss.beta}")
    if c.optim.learning_rate <= 0:
        errors.append("config key 'optim.learning_rate' must be > 0")
    if c.train.steps < 0 or c.train.epochs < 0 or (c.train.steps == 0 and c.train.epochs == 0):
        errors.append("set config key 'train.steps' > 0 or 'train.epochs' > 0")
    for key in ("batch_size", "grad_accum", "eval_batch_size", "log_every"):
        if c.train[key] < 1:
            errors.append(f"config key 'train.{key}' must be >= 1, got {c.train[key]}")
    if c.train.batch_size % max(c.train.grad_accum, 1):
        errors.append(
            f"config key 'train.batch_size' ({c.train.batch_size}) must be divisible by "
            f"train.grad_accum ({c.train.grad_accum})"
        )
    if c.data.max_length < 2:
        errors.append("config key 'data.max_length' must be >= 2")
    if c.loop.max_wall_seconds < 0:
        errors.append("config key 'loop.max_wall_seconds' must be >= 0 (0: no limit)")
    if c.compilation_cache_min_seconds < 0:
        errors.append("config key 'compilation_cache_min_seconds' must be >= 0")
    lengths = c.data.row_lengths
    if not (
        isinstance(lengths, (tuple, list))
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)
        and list(lengths) == sorted(set(lengths))
    ):
        errors.append(
            f"config key 'data.row_lengths' must be increasing positive ints, e.g. (24, 48), "
            f"got {lengths!r}"
        )
    if c.checkpoint.every_steps < 1 or c.checkpoint.max_to_keep < 1:
        errors.append(
            "config keys 'checkpoint.every_steps' and 'checkpoint.max_to_keep' must be >= 1"
        )
    types = [t.strip() for t in c.loss.type.split(",") if t.strip()]
    if c.loss.weights and len(c.loss.weights) != len(types):
        errors.append(
            f"config key 'loss.weights' has {len(c.loss.weights)} entries for {len(types)} loss types"
        )
    from dpojax.train.losses import LOSS_TYPES

    bad = [t for t in types if t not in LOSS_TYPES]
    if bad or not types:
        errors.append(
            f"config key 'loss.type': unknown loss {bad or c.loss.type!r}; choose from "
            f"{', '.join(sorted(LOSS_TYPES))}"
        )
    errors.extend(_mesh_errors(c, num_devices))
    return errors


def _mesh_errors(c, num_devices: int | None) -> list[str]:
    sizes = [c.mesh.data, c.mesh.fsdp, c.mesh.tensor]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        return [
            "config keys 'mesh.data', 'mesh.fsdp', 'mesh.tensor': positive sizes, at most one -1"
        ]
    if num_devices is None:
        return []
    fixed = 1
    for s in sizes:
        fixed *= s if s > 0 else 1
    if num_devices % fixed:
        return [
            f"config key 'mesh': data*fsdp*tensor sizes {sizes} do not divide the {num_devices} "
            "devices"
        ]
    data_parallel = 1
    for s in sizes[:2]:
        data_parallel *= s if s > 0 else num_devices // fixed
    micro = c.train.batch_size // max(c.train.grad_accum, 1)
    if micro % data_parallel:
        return [
            f"config key 'train.batch_size': {micro} pairs per micro-batch are not divisible by the "
            f"{data_parallel} data-parallel devices (mesh.data * mesh.fsdp); change train.batch_size "
            "or the mesh"
        ]
    return []
