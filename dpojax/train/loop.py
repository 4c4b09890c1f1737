"""The training loop and the evaluate / export jobs behind `python -m dpojax.main`.

A run lives in its workdir: checkpoints (orbax, resumed automatically), metrics.jsonl and
TensorBoard events, report.md with plots, and the exported HF model. SIGTERM / SIGINT save a
checkpoint and exit cleanly; a non-finite loss stops the run (keeping the last good checkpoint) or
skips the step, by config.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np

from dpojax.models import save_pretrained
from dpojax.models.peft import save_lora_adapter
from dpojax.train import setup
from dpojax.train.checkpoint import Checkpointer
from dpojax.train.losses import finalize_metrics
from dpojax.train.metrics_io import MetricsWriter
from dpojax.train.optim import make_optimizer
from dpojax.train.reference import attach_reference, precomputed_reference
from dpojax.train.report import write_report
from dpojax.train.step import Stepper, TrainState, create_train_state, policy_model

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """The loss or the gradients became NaN or infinite."""


class _StopSignal:
    """Records SIGTERM / SIGINT so the loop can checkpoint at a step boundary and exit."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self  # e.g. a job thread of the Customizer server: its owner handles signals
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Run:
    """Everything a train / evaluate / export job shares: models, data, step functions."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | Path, *, train: bool):
        self.config = config
        self.workdir = Path(workdir)
        self.mesh = setup.mesh_from_config(config)
        self.data_parallel = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        self.policy, self.tokenizer = setup.load_policy(config, self.mesh)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.step_cfg = setup.step_config(config)
        reference = setup.load_reference(config, self.mesh)
        t = config.train
        self.micro_pairs = t.batch_size // t.grad_accum // jax.process_count()
        d = config.data
        cache = (d.token_cache_dir or self.workdir / "token_cache") if d.token_cache else None
        self.train_pairs = (
            setup.load_pairs(config, d.train_path, self.tokenizer, cache)
            if train and d.train_path
            else []
        )
        eval_path = d.eval_path or ("" if train else d.train_path)
        self.eval_pairs = (
            setup.load_pairs(config, eval_path, self.tokenizer, cache) if eval_path else []
        )
        self.steps_per_epoch = max(math.ceil(len(self.train_pairs) / t.batch_size), 1)
        self.total_steps = (t.steps or t.epochs * self.steps_per_epoch) if train else 1
        o = config.optim
        warmup = o.warmup_steps or int(o.warmup_ratio * self.total_steps)
        self.optimizer, self.schedule = make_optimizer(
            o.learning_rate,
            schedule=o.schedule,
            warmup_steps=warmup,
            total_steps=self.total_steps,
            min_lr_ratio=o.min_lr_ratio,
            weight_decay=o.weight_decay,
            b1=o.b1,
            b2=o.b2,
            eps=o.eps,
            max_grad_norm=o.max_grad_norm or None,
            name=o.name,
        )
        self.reference_logps = {}
        if self.step_cfg.reference == "precomputed":
            ref_model = reference if reference is not None else self._initial_base()
            self.reference_logps = {
                name: self._precompute(ref_model, pairs, name)
                for name, pairs in (("train", self.train_pairs), ("eval", self.eval_pairs))
                if pairs
            }
            reference = None
        self.graphdef, state = create_train_state(
            self.policy, self.optimizer, self.step_cfg, reference=reference
        )
        self.stepper = Stepper(
            self.graphdef,
            self.optimizer,
            self.schedule,
            self.step_cfg,
            self.policy.config.lora_rank > 0,
            mesh=self.mesh,
        )
        self.state = self.stepper.shard_state(state)

    def _initial_base(self):
        from dpojax.models import merge_lora

        return merge_lora(self.policy)  # adapters start at zero: the base model

    def _iterator(self, pairs, *, shuffle: bool, epochs: int | None, batch_pairs: int):
        return setup.batch_iterator(
            self.config,
            pairs,
            batch_pairs=batch_pairs,
            shuffle=shuffle,
            num_epochs=epochs,
            pad_id=self.pad_id,
            data_parallel=self.data_parallel,
        )

    def _precompute(self, model, pairs, name):
        c = self.config
        cache = Path(c.reference.cache_dir or self.workdir / "reference_cache")
        it = self._iterator(pairs, shuffle=False, epochs=1, batch_pairs=self.micro_pairs)
        settings = {
            "max_length": c.data.max_length,
            "truncation_mode": c.data.truncation_mode,
            "split": name,
            "num_pairs": len(pairs),
        }
        chosen, rejected, cached = precomputed_reference(
            model,
            lambda: self._iterator(pairs, shuffle=False, epochs=1, batch_pairs=self.micro_pairs),
            max(p.pair_id for p in pairs) + 1,
            cache_dir=cache,
            data_fingerprint=str(it.fingerprint),
            settings=settings,
            vocab_chunk=c.train.vocab_chunk or None,
        )
        log.info("reference log-probs for %s: %s", name, "cache hit" if cached else "computed")
        return chosen, rejected

    def with_reference(self, batch: dict, split: str) -> dict:
        if split in self.reference_logps:
            return attach_reference(batch, *self.reference_logps[split])
        return batch

    def evaluate(self, state: TrainState) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Metrics and per-pair results over the eval pairs (one pass, no shuffling)."""
        sums, rows = None, []
        it = self._iterator(
            self.eval_pairs,
            shuffle=False,
            epochs=1,
            batch_pairs=self.config.train.eval_batch_size,
        )
        for batch in it:
            out = self.stepper.evaluate(state, self.with_reference(batch, "eval"))
            out = jax.device_get(out)
            sums = out["sums"] if sums is None else jax.tree.map(np.add, sums, out["sums"])
            for i, pair_id in enumerate(batch["pair_ids"]):
                if pair_id >= 0:
                    rows.append(
                        {
                            "pair_id": int(pair_id),
                            "policy_chosen_logp": float(out["policy_chosen_logps"][i]),
                            "policy_rejected_logp": float(out["policy_rejected_logps"][i]),
                            "ref_chosen_logp": float(out["ref_chosen_logps"][i]),
                            "ref_rejected_logp": float(out["ref_rejected_logps"][i]),
                            "loss": float(out["losses"][i]),
                        }
                    )
        metrics = {k: float(v) for k, v in finalize_metrics(sums).items()}
        return metrics, sorted(rows, key=lambda r: r["pair_id"])

    def export(self, state: TrainState, directory: Path) -> None:
        model = policy_model(self.graphdef, state, self.policy.config.lora_rank > 0)
        dtype = self.config.export.dtype or None
        save_pretrained(model, self.tokenizer, directory, dtype=dtype)
        if model.config.lora_rank and jax.process_index() == 0:
            save_lora_adapter(model, directory / "adapter", base_model=self.config.model.path)


def _host_metrics(metrics) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


def train(
    config: ml_collections.ConfigDict,
    workdir: str | Path,
    *,
    callback: Callable[[int, int, dict[str, float], dict[str, float] | None], None] | None = None,
) -> dict[str, Any]:
    """Trains (resuming from the workdir's latest checkpoint) and returns the final summary.

    `callback(step, total_steps, train_metrics, eval_metrics_or_None)` runs after every step (e.g.
    progress reporting for the Customizer server); an exception it raises ends the run."""
    workdir = Path(workdir)
    is_main = jax.process_index() == 0
    if is_main:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    run = Run(config, workdir, train=True)
    t, c = config.train, config.checkpoint
    has_eval = bool(run.eval_pairs)
    ckpt = Checkpointer(
        workdir / "checkpoints",
        max_to_keep=c.max_to_keep,
        best_metric=c.best_metric if has_eval else None,
        best_mode=c.best_mode,
        async_save=c.async_save,
    )
    it = run._iterator(
        run.train_pairs, shuffle=config.data.shuffle, epochs=None, batch_pairs=run.micro_pairs
    )
    state, start = run.state, 0
    if ckpt.latest_step() is not None:
        state, extra = ckpt.restore(state)
        it.restore(extra["data"])
        start = int(extra["step"])
        log.info("resumed from %s at step %d", ckpt.directory, start)
    writer = MetricsWriter(workdir, enabled=is_main, resume_step=start)
    progress = _progress(t.progress and is_main, start, run.total_steps)
    last_saved, status = start, "completed"
    step, final_eval, eval_step = start, None, None
    try:
        with _StopSignal() as stop:
            while step < run.total_steps:
                t0 = time.perf_counter()
                batch = setup.stack_micro_batches([next(it) for _ in range(t.grad_accum)])
                new_state, metrics = run.stepper.train(state, run.with_reference(batch, "train"))
                metrics = _host_metrics(metrics)
                if metrics["nonfinite"] and t.nonfinite == "stop":
                    raise NonFiniteError(
                        f"non-finite loss or gradient at step {step + 1} (loss {metrics['loss']}, "
                        f"grad_norm {metrics['grad_norm']}); the last good checkpoint is step "
                        f"{last_saved} in {ckpt.directory}; lower optim.learning_rate or set "
                        "train.nonfinite=skip"
                    )
                state, step = new_state, step + 1
                metrics["tokens_per_s"] = metrics["tokens"] / max(time.perf_counter() - t0, 1e-9)
                if step % t.log_every == 0 or step == run.total_steps:
                    writer.write(step, metrics, split="train")
                progress.update(metrics)
                eval_metrics = None
                if has_eval and t.eval_every and step % t.eval_every == 0:
                    eval_metrics, _ = run.evaluate(state)
                    writer.write(step, eval_metrics, split="eval")
                    final_eval, eval_step = eval_metrics, step
                periodic = step % c.every_steps == 0 or eval_metrics is not None
                if periodic and step < run.total_steps:  # the final save comes after the loop
                    ckpt.save(
                        step, state, extra={"step": step, "data": it.state()}, metrics=eval_metrics
                    )
                    last_saved = step
                if stop.received:
                    status = f"stopped by {stop.received}"
                    break
        if status == "completed" and has_eval and eval_step != step:
            final_eval, eval_step = run.evaluate(state)[0], step
            writer.write(step, final_eval, split="eval")
            if callback is not None:
                callback(step, run.total_steps, metrics, final_eval)
        if last_saved != step:
            ckpt.save(
                step,
                state,
                extra={"step": step, "data": it.state()},
                metrics=final_eval if eval_step == step else None,
                force=True,
            )
        ckpt.wait()
    finally:
        progress.close()
        writer.close()
    summary = {"status": status, "step": step, "total_steps": run.total_steps}
    if status == "completed":
        summary["final_eval"] = final_eval
        if config.export.enabled:
            run.export(state, workdir / "export")
            best = ckpt.best_step()
            if best is not None:
                best_state, _ = ckpt.restore(state, step=best)
                run.export(best_state, workdir / "export_best")
                summary["best_step"] = best
        if is_main:
            write_report(
                workdir,
                title="dpojax training run",
                summary=summary,
                config_text=config.to_json_best_effort(indent=2),
                plots=config.train.report_plots,
            )
    ckpt.close()
    if is_main:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("%s at step %d of %d", status, step, run.total_steps)
    return summary


def evaluate(config: ml_collections.ConfigDict, workdir: str | Path) -> dict[str, float]:
    """Per-pair log-probs and losses of the policy (the workdir's latest checkpoint if any, else
    model.path) on data.eval_path (or data.train_path)."""
    workdir = Path(workdir)
    run = Run(config, workdir, train=False)
    state = run.state
    ckpt = Checkpointer(workdir / "checkpoints", async_save=False)
    if ckpt.latest_step() is not None:
        state, _ = ckpt.restore(state)
    ckpt.close()
    metrics, rows = run.evaluate(state)
    if jax.process_index() == 0:
        out = workdir / "evaluate"
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "pairs.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def export(config: ml_collections.ConfigDict, workdir: str | Path) -> Path:
    """Exports the workdir's latest checkpoint as an HF directory in WORKDIR/export."""
    workdir = Path(workdir)
    run = Run(config, workdir, train=False)
    ckpt = Checkpointer(workdir / "checkpoints", async_save=False)
    if ckpt.latest_step() is None:
        raise FileNotFoundError(f"{workdir / 'checkpoints'}: no checkpoint to export; train first")
    state, _ = ckpt.restore(run.state)
    ckpt.close()
    run.export(state, workdir / "export")
    return workdir / "export"


class _progress:
    """A tqdm bar showing step, loss, accuracy and tokens/s (ETA from tqdm)."""

    def __init__(self, enabled: bool, start: int, total: int):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", dynamic_ncols=True)

    def update(self, metrics: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{metrics['loss']:.4f}",
                acc=f"{metrics['rewards/accuracies']:.3f}",
                tok_s=f"{metrics['tokens_per_s']:.0f}",
                refresh=False,
            )
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def submit(config: ml_collections.ConfigDict, workdir: str | Path):
    """Submits preference pairs to NeMo Customizer (config.customizer.*): those of
    data.train_path, or, without one, pairs collected first with the configured workflow (the
    built-in tic-tac-toe by default) into WORKDIR/collect."""
    from dpojax.customizer import submit as customizer_submit
    from dpojax.data.pair_files import read_pairs

    history = None
    path = config.data.train_path
    if not path:
        from dpojax import orchestrate

        stats = orchestrate.collect(config, Path(workdir) / "collect")
        path = Path(workdir) / "collect" / "pairs.jsonl"
        history = json.loads((Path(workdir) / "collect" / "collection_history.json").read_text())
        log.info("collected %d pairs from %d events", stats["num_pairs"], stats["num_events"])
    pairs, summary = read_pairs(path, format=config.data.format, strict=config.data.strict)
    log.info("%s", summary)
    settings = config.customizer.to_dict()
    if not settings["deployment_config"]["deployment_name"]:
        settings["deployment_config"]["deployment_name"] = None
    return customizer_submit(pairs, settings, workdir=workdir, collection_history=history)
