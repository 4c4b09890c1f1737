"""From a validated config to the objects a job needs: mesh, models, data, step settings,
optimizer and batch iterators. Pure composition: no training, no files written."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import jax

from dpojax.config import Config
from dpojax.data.layouts import Buckets, bucket_lengths
from dpojax.data.pair_files import iter_pairs, read_pairs
from dpojax.data.pipeline import BatchIterator
from dpojax.data.problems import ReadSummary
from dpojax.data.shapes import RecordShape, read_chat_template
from dpojax.data.token_cache import tokenize_pairs_cached
from dpojax.data.tokenize import (
    ChatTemplateError,
    TokenizedPair,
    TokenizeResult,
    tokenize_pairs,
)
from dpojax.data.unpaired import UNPAIRED_COLUMN_KEYS, holds_pairs, read_unpaired, unpair
from dpojax.data.unpaired_tokens import tokenize_unpaired
from dpojax.hardware.chips import Chip, chip_for
from dpojax.models import add_lora, from_pretrained
from dpojax.models.sharding import make_mesh
from dpojax.train.batches import micro_batch_pairs
from dpojax.train.hosts import SINGLE, DataPartition
from dpojax.train.kto import KTO_LOSS_TYPES, UNPAIRED_LOSS_TYPES, balance_warning
from dpojax.train.loss_settings import parse_loss_types
from dpojax.train.optim import make_optimizer
from dpojax.train.reference_choice import reference_choice
from dpojax.train.state import StepConfig

log = logging.getLogger(__name__)


def mesh_from_config(config: Config):
    m = config.mesh
    return make_mesh(m.data, m.fsdp, m.tensor, context=m.context)


def router_aux_coef(config: Config, model_config=None) -> float:
    """loss.router_aux_loss_coef, or (when it is negative) the policy's own: its
    router_aux_loss_coef when its config.json sets output_router_logits, else 0 (TRL's rule)."""
    coef = float(config.loss.router_aux_loss_coef)
    if coef >= 0:
        return coef
    if model_config is None or not model_config.output_router_logits:
        return 0.0
    return float(model_config.router_aux_loss_coef)


def step_config(config: Config, model_config=None) -> StepConfig:
    """The static step settings from the config (its loss group as it is); the policy's
    `model_config` decides the default weight of a mixture of experts' auxiliary loss."""
    loss = config.loss
    return StepConfig(
        reference=reference_choice(config.reference),
        loss=loss,
        vocab_chunk=config.train.vocab_chunk or None,
        skip_nonfinite=config.train.nonfinite == "skip",
        router_aux_coef=router_aux_coef(config, model_config),
        token_metrics=bool(config.train.token_metrics) and loss.types[0] not in UNPAIRED_LOSS_TYPES,
        nll_prompt="orpo" in loss.types and bool(loss.orpo_nll_prompt),
    )


def optimizer(config: Config, total_steps: int):
    """(optax optimizer, learning-rate schedule) from `optim.*` for a run of `total_steps`."""
    o = config.optim
    return make_optimizer(
        o.learning_rate,
        schedule=o.schedule,
        warmup_steps=o.warmup_steps or int(o.warmup_ratio * total_steps),
        total_steps=total_steps,
        min_lr_ratio=o.min_lr_ratio,
        weight_decay=o.weight_decay,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        max_grad_norm=o.max_grad_norm or None,
        name=o.name,
    )


def compute_dtype(config: Config, platform: str | None = None, chip: Chip | None = None) -> str:
    """`model.dtype`, with "auto" resolved for `platform` (default: JAX's default backend):
    bfloat16 on TPUs and GPUs (float16 on a `chip` without bfloat16, such as a T4), float32 on
    CPUs. The loss, log-softmax and norms are computed in float32 whatever it is."""
    if config.model.dtype != "auto":
        return config.model.dtype
    platform = platform or jax.default_backend()
    if platform == "cpu":
        return "float32"
    if chip is None and platform == jax.default_backend():  # this process's own devices
        chip = chip_for(jax.devices()[0].device_kind)
    return chip.half_dtype if chip is not None else "bfloat16"


def _from_pretrained(config: Config, path: str, mesh, **kw):
    """`from_pretrained` of the checkpoint at `path` with the model settings the policy and a
    separate reference share (dtypes, attention, layout, scan, mesh, quantization: a reference
    is quantized as the policy's base is, as read); `kw` what differs."""
    m = config.model
    return from_pretrained(
        path,
        compute_dtype(config),
        param_dtype=m.param_dtype,
        attention=m.attention,
        attention_block=m.attention_block,
        row_layout=config.data.layout,
        scan_layers=m.scan_layers,
        mesh=mesh,
        quantization=m.quantization,  # quantized as read: no float model (docs/quantization.md)
        quantization_block=m.quantization_block,
        **kw,
    )


def load_policy(config: Config, mesh, path: str | None = None):
    """(policy, tokenizer): the HF model at `path` (default model.path; a local directory or a
    Hub id), with LoRA when enabled and the tokenizer's chat template replaced by
    data.chat_template when set."""
    model, tokenizer = _from_pretrained(
        config, path or config.model.path, mesh, remat=config.model.remat
    )
    template = read_chat_template(config.data.chat_template)
    if template is not None:
        tokenizer.chat_template = template
    if config.lora.rank > 0:
        model = add_lora(
            model, config.lora.rank, config.lora.alpha, tuple(config.lora.targets), config.seed
        )
    return model, tokenizer


def load_reference(config: Config, mesh):
    """A separate reference model when reference.path is set (else None: the initial policy);
    no remat (it takes no gradients)."""
    if not config.reference.path:
        return None
    model, _ = _from_pretrained(config, config.reference.path, mesh, tokenizer=False)
    return model


def record_shape(config: Config) -> RecordShape:
    """Column names and system prompt of the data (`data.columns.*`, `data.system_prompt`)."""
    columns = config.data.columns
    columns = dataclasses.asdict(columns) if dataclasses.is_dataclass(columns) else dict(columns)
    return RecordShape.create(columns, config.data.system_prompt)


def chat_template_kwargs(config: Config) -> dict[str, Any]:
    return json.loads(config.data.chat_template_kwargs or "{}")


def eval_source(config: Config, train: bool) -> tuple[str, str] | None:
    """(path, split) of the evaluation pairs: data.eval_path (split data.eval_split), else
    data.eval_split of data.train_path; a job that does not train evaluates the training pairs
    when neither is set. None: no evaluation."""
    d = config.data
    if d.eval_path:
        return d.eval_path, d.eval_split
    if d.eval_split and d.train_path:
        return d.train_path, d.eval_split
    if not train and d.train_path:
        return d.train_path, d.train_split
    return None


def load_pairs(
    config: Config,
    path: str,
    tokenizer,
    cache_dir: str | os.PathLike | None = None,
    split: str = "",
) -> list[TokenizedPair]:
    """Reads and tokenizes the pairs of `split` of `path` (a file, a folder or a Hub dataset),
    through the token cache in `cache_dir` (None: no cache). With data.streaming the records are
    read one by one and tokenized in chunks, without the token cache."""
    d = config.data
    if unpaired_loss(config):
        return load_unpaired(config, path, tokenizer, split)
    kwargs = dict(format=d.format, split=split or None, subset=d.subset or None)
    kwargs["shape"] = record_shape(config)
    tokenize = dict(
        max_length=d.max_length,
        truncation_mode=d.truncation_mode,
        chat_template_kwargs=chat_template_kwargs(config),
    )
    shown = path + (f" ({split})" if split else "")
    try:
        if d.streaming:
            result, summary = _streamed_pairs(path, tokenizer, kwargs, tokenize, strict=d.strict)
            hit = False
        else:
            pairs, summary = read_pairs(path, strict=d.strict, **kwargs)
            log.info("%s", summary)
            if not pairs:
                raise ValueError(f"{shown}: no usable preference pairs ({summary})")
            result, hit = tokenize_pairs_cached(pairs, tokenizer, cache_dir=cache_dir, **tokenize)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{shown}: {e}") from None
    log.info("%s: %s%s", shown, result, " (token cache hit)" if hit else "")
    if not result.pairs:
        raise ValueError(f"{shown}: every pair was dropped in tokenization ({result})")
    return result.pairs


def unpaired_loss(config: Config) -> bool:
    """Whether the loss (alone, by the config checks) trains on unpaired examples."""
    return parse_loss_types(config.loss.type)[0] in UNPAIRED_LOSS_TYPES


def load_unpaired(config: Config, path: str, tokenizer, split: str = "") -> list[TokenizedPair]:
    """The unpaired examples of `split` of `path` (kto, apo_zero_unpaired, bco) tokenized as
    pairs of (own completion, KL completion) (`dpojax.data.unpaired_tokens`; bco uses no KL
    completion, and TRL's balance warning is KTO's only): TRL unpaired records with
    data.format auto or unpaired; with trl or customizer, preference pairs unpaired as TRL does.
    With data.format auto, a source whose first record has no label is unpaired too (as TRL's
    KTOTrainer does). The KL completions rotate within runs of one micro-batch (train.batch_size /
    train.grad_accum: TRL's per_device_train_batch_size). No token cache."""
    d, t = config.data, config.train
    read = dict(split=split or None, subset=d.subset or None, strict=d.strict)
    shown = path + (f" ({split})" if split else "")
    columns = {k: v for k, v in dict(record_shape(config).columns).items()}
    columns = {k: v for k, v in columns.items() if k in UNPAIRED_COLUMN_KEYS}
    paired = d.format in ("trl", "customizer") or (
        d.format == "auto"
        and holds_pairs(path, split=read["split"], subset=read["subset"], columns=columns)
    )
    if paired:
        pairs, summary = read_pairs(path, format=d.format, shape=record_shape(config), **read)
        examples = unpair(pairs)
    else:
        examples, summary = read_unpaired(
            path, columns=columns, system_prompt=d.system_prompt, **read
        )
    log.info("%s", summary)
    if not examples:
        raise ValueError(f"{shown}: no usable unpaired examples ({summary})")
    desirable = sum(e.label for e in examples)
    kto = parse_loss_types(config.loss.type)[0] in KTO_LOSS_TYPES
    warning = kto and balance_warning(
        desirable,
        len(examples) - desirable,
        config.loss.desirable_weight,
        config.loss.undesirable_weight,
    )
    if warning:
        log.warning("%s: %s", shown, warning)
    try:
        result = tokenize_unpaired(
            examples,
            tokenizer,
            kl_batch_size=max(micro_batch_pairs(t.batch_size, t.grad_accum), 1),
            max_length=d.max_length,
            truncation_mode=d.truncation_mode,
            chat_template_kwargs=chat_template_kwargs(config),
        )
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{shown}: {e}") from None
    log.info("%s: %s", shown, result)
    if not result.pairs:
        raise ValueError(f"{shown}: every example was dropped in tokenization ({result})")
    return result.pairs


def _streamed_pairs(path: str, tokenizer, read: dict, tokenize: dict, *, strict: bool, chunk=4096):
    """(TokenizeResult, ReadSummary) of a streamed source, tokenized `chunk` pairs at a time."""
    summary = ReadSummary(path)
    result = TokenizeResult([])
    batch: list[tuple[int, Any]] = []

    def flush():  # pair ids count the kept pairs, as in the prepared path
        ids, pairs = zip(*batch, strict=True)
        part = tokenize_pairs(list(pairs), tokenizer, pair_ids=list(ids), **tokenize)
        result.pairs.extend(part.pairs)
        for reason, dropped in part.dropped.items():
            result.dropped.setdefault(reason, []).extend(dropped)
        result.boundary_merges += part.boundary_merges
        result.truncated += part.truncated
        batch.clear()

    for pair_id, (_, pair) in enumerate(iter_pairs(path, summary, streaming=True, **read)):
        batch.append((pair_id, pair))
        if len(batch) == chunk:
            flush()
    if batch:
        flush()
    summary.finish(strict)
    log.info("%s", summary)
    return result, summary


def buckets(config: Config, data_parallel: int = 1) -> Buckets:
    """Row lengths: `data.row_lengths`, by default powers of two from 16, up to the longest row a
    layout can need (max_length per sequence; twice that for a prefix-shared prompt with two
    completions), which is always included; row counts rounded to a multiple of the
    data-parallel devices."""
    d = config.data
    lengths = bucket_lengths(d.layout, d.max_length, d.row_lengths)
    return Buckets(lengths=lengths, row_bits=d.row_bits, row_multiple=data_parallel)


def batch_iterator(
    config: Config,
    pairs: Sequence[TokenizedPair],
    *,
    batch_pairs: int,
    shuffle: bool,
    num_epochs: int | None,
    pad_id: int,
    data_parallel: int = 1,
    partition: DataPartition = SINGLE,
) -> BatchIterator:
    """Batches of `batch_pairs` pairs of `partition`'s slice of each global batch (this
    process's: `dpojax.train.hosts.data_partition`), with row counts a multiple of
    `data_parallel` (the partition's data-parallel devices)."""
    return BatchIterator(
        pairs,
        batch_pairs=batch_pairs,
        layout=config.data.layout,
        buckets=buckets(config, data_parallel),
        seed=config.seed,
        shuffle=shuffle,
        num_epochs=num_epochs,
        process_index=partition.index,
        process_count=partition.count,
        packing=config.data.packing,
        pad_id=pad_id,
        group_size=config.data.group_size,
    )
