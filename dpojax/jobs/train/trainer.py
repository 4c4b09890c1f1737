"""`Trainer`: what a train, evaluate or export job holds for its whole run — the mesh, the policy
and reference, the tokenized pairs, the optimizer and the jitted steps — and the operations on a
train state that those jobs share (batches, evaluation, export)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dpojax.config import Config
from dpojax.data.pipeline import BatchIterator, StepBatches
from dpojax.jobs import build
from dpojax.jobs.phases import PhaseTimes
from dpojax.jobs.workdir import replaced_dir
from dpojax.models import attention, merge_lora, save_pretrained
from dpojax.models.peft import save_lora_adapter
from dpojax.train.batches import micro_batch_pairs
from dpojax.train.hosts import data_partition
from dpojax.train.kto import finalize_unpaired
from dpojax.train.losses import finalize_metrics
from dpojax.train.reference import attach_reference, precomputed_reference
from dpojax.train.state import TrainState, create_train_state, policy_model
from dpojax.train.step import Stepper

log = logging.getLogger(__name__)


class StepperCache:
    """The last `Stepper` built, by what its jitted steps depend on: the model's structure, the
    step config, the mesh, the optimizer settings and the run's step count. A `loop` holds one
    for its rounds, which build a Trainer each with all of these unchanged: reusing the Stepper
    reuses its compiled steps, so a round compiles nothing (on a CPU the compilation cache still
    took ~0.5 s a shape to load). One at a time: a new key replaces the last."""

    def __init__(self):
        self.key: tuple | None = None
        self.stepper: Stepper | None = None

    def get(self, key: tuple) -> Stepper | None:
        return self.stepper if self.stepper is not None and self.key == key else None

    def put(self, key: tuple, stepper: Stepper) -> None:
        self.key, self.stepper = key, stepper


class Trainer:
    """Built once per job from a validated config (`train=False`: evaluate / export, which read
    no training data and take one "step"; `data=False`: export, which reads no pairs at all)."""

    def __init__(
        self,
        config: Config,
        workdir: str | Path,
        *,
        train: bool,
        data: bool = True,
        times: PhaseTimes | None = None,
        steppers: StepperCache | None = None,
    ):
        """`times` gets the reading and tokenizing of the pairs as its phase "tokenization";
        `steppers`: jitted steps an earlier job of the same settings built (a loop's rounds)."""
        self.config = config
        times = times or PhaseTimes()
        self.workdir = Path(workdir)
        self.mesh = build.mesh_from_config(config)
        # This process reads its data partition's share of every batch (all of it in one process).
        self.partition = data_partition(self.mesh)
        # the batch is split over data x fsdp; the context axis splits each row's length
        self.data_parallel = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        self.policy, self.tokenizer = build.load_policy(config, self.mesh)
        self.attention = attention.describe(self.policy.config, context=self.mesh.shape["context"])
        log.info("attention: %s", self.attention)
        self.is_lora = self.policy.config.lora_rank > 0
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.step_cfg = build.step_config(config, self.policy.config)
        t, d = config.train, config.data
        self.micro_pairs = micro_batch_pairs(t.batch_size, t.grad_accum, self.partition.count)
        self.eval_pairs_per_batch = max(
            micro_batch_pairs(t.eval_batch_size, 1, self.partition.count), 1
        )
        if jax.process_count() > 1:
            log.info(
                "%d of %d devices here; data partition %d of %d: %d of %d pairs per micro-batch",
                jax.local_device_count(),
                jax.device_count(),
                self.partition.index,
                self.partition.count,
                self.micro_pairs,
                micro_batch_pairs(t.batch_size, t.grad_accum),
            )
        cache = (d.token_cache_dir or self.workdir / "token_cache") if d.token_cache else None
        with times.phase("tokenization"):
            self.train_pairs = (
                build.load_pairs(config, d.train_path, self.tokenizer, cache, d.train_split)
                if train and d.train_path
                else []
            )
            self.eval_pairs = []
            if data and (source := build.eval_source(config, train)) is not None:
                path, split = source
                self.eval_pairs = build.load_pairs(config, path, self.tokenizer, cache, split)
        self.steps_per_epoch = max(math.ceil(len(self.train_pairs) / t.batch_size), 1)
        self.total_steps = (t.steps or t.epochs * self.steps_per_epoch) if train else 1
        self.optimizer, self.schedule = build.optimizer(config, self.total_steps)
        reference = self._reference()
        self.graphdef, state = create_train_state(
            self.policy, self.optimizer, self.step_cfg, reference=reference
        )
        key = (
            self.graphdef,
            self.step_cfg,
            self.is_lora,
            self.mesh,
            repr(config.optim),
            self.total_steps,
        )
        steppers = steppers or StepperCache()
        self.stepper = steppers.get(key)
        if self.stepper is None:
            self.stepper = Stepper(
                self.graphdef,
                self.optimizer,
                self.schedule,
                self.step_cfg,
                self.is_lora,
                mesh=self.mesh,
            )
            steppers.put(key, self.stepper)
        else:  # the same optimizer settings and step count: an equivalent optimizer
            self.optimizer, self.schedule = self.stepper.optimizer, self.stepper.schedule
        self.state = self.stepper.shard_state(state)

    def batches(
        self, pairs, *, shuffle: bool, epochs: int | None, batch_pairs: int
    ) -> BatchIterator:
        return build.batch_iterator(
            self.config,
            pairs,
            batch_pairs=batch_pairs,
            shuffle=shuffle,
            num_epochs=epochs,
            pad_id=self.pad_id,
            data_parallel=self.data_parallel // self.partition.count,
            partition=self.partition,
        )

    def train_batches(self) -> StepBatches:
        """The endless, resumable iterator of training steps: each item is one optimizer step's
        `train.grad_accum` micro-batches."""
        micro = self.batches(
            self.train_pairs,
            shuffle=self.config.data.shuffle,
            epochs=None,
            batch_pairs=self.micro_pairs,
        )
        return StepBatches(micro, self.config.train.grad_accum)

    def _precompute(self, model, pairs, split: str):
        c = self.config

        def batches_for(subset):
            return self.batches(subset, shuffle=False, epochs=1, batch_pairs=self.micro_pairs)

        def one_pass():
            return batches_for(pairs)

        settings = {
            "max_length": c.data.max_length,
            "truncation_mode": c.data.truncation_mode,
            "split": split,
            "num_pairs": len(pairs),
        }
        chosen, rejected, cached = precomputed_reference(
            model,
            one_pass,
            max(p.pair_id for p in pairs) + 1,
            cache_dir=Path(self.step_cfg.reference.cache_dir or self.workdir / "reference_cache"),
            data_fingerprint=one_pass().content,
            settings=settings,
            vocab_chunk=c.train.vocab_chunk or None,
            mesh=self.mesh,
            ld_alpha=self.step_cfg.ld_alpha,
            pairs=pairs,
            batches_for=batches_for,
        )
        log.info("reference log-probs for %s: %s", split, "cache hit" if cached else "computed")
        return chosen, rejected

    def _reference(self):
        """The separate reference model the state holds (reference.path), or None: the initial
        policy, or no reference (a reference-free loss, or a `PrecomputedReference`, whose
        log-probs this computes into `reference_logps`)."""
        self.reference_logps = {}
        if self.step_cfg.reference_free:  # no reference to load or run
            return None
        reference = build.load_reference(self.config, self.mesh)
        if self.step_cfg.reference.runs_forward:
            return reference
        # Without reference.path the reference is the initial policy: LoRA adapters start at
        # zero, so merging them gives the base model. A quantized base is run as it is (its
        # zero adapters add exactly 0): merging would hold the whole dequantized model.
        ref_model = reference
        if ref_model is None:
            quantized = self.policy.config.quantization != "none"
            ref_model = self.policy if quantized else merge_lora(self.policy)
        self.reference_logps = {
            split: self._precompute(ref_model, pairs, split)
            for split, pairs in (("train", self.train_pairs), ("eval", self.eval_pairs))
            if pairs
        }
        return None

    def with_reference(self, batch: dict, split: str) -> dict:
        """`batch` with its precomputed reference log-probs attached (reference.type=precomputed)."""
        if split in self.reference_logps:
            return attach_reference(batch, *self.reference_logps[split])
        return batch

    def train_step(self, state: TrainState, batch: dict):
        return self.stepper.train(state, self.with_reference(batch, "train"))

    def evaluate(self, state: TrainState) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Metrics and per-pair results over the eval pairs (one pass, no shuffling)."""
        sums, rows = None, []
        batch_pairs = self.eval_pairs_per_batch
        for batch in self.batches(
            self.eval_pairs, shuffle=False, epochs=1, batch_pairs=batch_pairs
        ):
            out = jax.device_get(self.stepper.evaluate(state, self.with_reference(batch, "eval")))
            sums = out["sums"] if sums is None else jax.tree.map(np.add, sums, out["sums"])
            rows += [
                {
                    "pair_id": int(pair_id),
                    "policy_chosen_logp": float(out["policy_chosen_logps"][i]),
                    "policy_rejected_logp": float(out["policy_rejected_logps"][i]),
                    "ref_chosen_logp": float(out["ref_chosen_logps"][i]),
                    "ref_rejected_logp": float(out["ref_rejected_logps"][i]),
                    "loss": float(out["losses"][i]),
                }
                for i, pair_id in enumerate(out["pair_ids"])
                if pair_id >= 0
            ]
        finalize = finalize_unpaired if self.step_cfg.unpaired else finalize_metrics
        metrics = {k: float(v) for k, v in finalize(sums).items()}
        return metrics, sorted(rows, key=lambda r: r["pair_id"])

    def export(self, state: TrainState, directory: Path) -> None:
        """The policy of `state` as an HF directory (LoRA merged; the adapter in `adapter/`).
        With LoRA and `export.merged=False`, the adapter alone in PEFT's format (PEFT loads the
        folder on `model.path`), with the tokenizer."""
        model = policy_model(self.graphdef, state, self.is_lora)
        with replaced_dir(directory) as tmp:  # a kill mid-export leaves the previous export
            if self.is_lora and not self.config.export.merged:
                save_lora_adapter(model, tmp, base_model=self.config.model.path)
                if jax.process_index() == 0:
                    self.tokenizer.save_pretrained(str(tmp))
                return
            save_pretrained(model, self.tokenizer, tmp, dtype=self.config.export.dtype or None)
            if self.is_lora:  # every process gathers the adapters; process 0 writes them
                save_lora_adapter(model, tmp / "adapter", base_model=self.config.model.path)
