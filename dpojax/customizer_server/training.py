"""The training function of the local Customizer server's `dpojax` backend.

A customization job's hyperparameters (NeMo Customizer's DPO dialect) become a dpojax config; the
job trains with `dpojax.jobs.train.train` on the uploaded Customizer JSONL files, reports progress
through the server's callback, and leaves an HF model directory in the job's output dir.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dpojax.config import default_config, frozen, validate
from dpojax.customizer.client.settings import Hyperparameters


def job_config(
    model_dir: Path,
    train_path: Path,
    val_path: Path | None,
    workdir: Path,
    hyperparameters: Mapping[str, Any],
):
    """The dpojax config for a Customizer job (validated; raises ValueError listing problems)."""
    # A job's missing hyperparameters take the client's defaults: one set of defaults.
    defaults = Hyperparameters()
    hp = dict(hyperparameters)
    dpo = dict(hp.get("dpo") or {})
    config = default_config()
    config.model.path = str(model_dir)
    config.data.train_path = str(train_path)
    has_val = val_path is not None and Path(val_path).is_file() and Path(val_path).stat().st_size
    config.data.eval_path = str(val_path) if has_val else ""
    config.data.format = "customizer"
    config.data.max_length = int(hp.get("max_seq_length", 1024) or 1024)
    config.train.epochs = int(hp.get("epochs", defaults.epochs))
    config.train.batch_size = int(hp.get("batch_size", defaults.batch_size))
    config.train.eval_batch_size = config.train.batch_size
    config.train.progress = False
    config.optim.learning_rate = float(hp.get("learning_rate", defaults.learning_rate))
    config.optim.schedule = "constant"
    import math

    import jax

    # Data-parallel over as many devices as the batch allows, tensor-parallel over the rest.
    devices = jax.device_count()
    config.mesh.data = math.gcd(config.train.batch_size, devices)
    config.mesh.tensor = devices // config.mesh.data
    if hp.get("training_type", defaults.training_type) == "sft":
        config.loss.type = "sft"
    else:
        # Customizer: preference_average_log_probs off = TRL sigmoid, on = sigmoid_norm.
        d = defaults.dpo
        average = bool(dpo.get("preference_average_log_probs", d.preference_average_log_probs))
        config.loss.type = "sigmoid_norm" if average else "sigmoid"
        config.loss.beta = float(dpo.get("ref_policy_kl_penalty", d.ref_policy_kl_penalty))
        config.loss.preference_loss_weight = float(
            dpo.get("preference_loss_weight", d.preference_loss_weight)
        )
        config.loss.sft_loss_weight = float(dpo.get("sft_loss_weight", d.sft_loss_weight))
    if hp.get("finetuning_type", defaults.finetuning_type) == "lora":
        lora = dict(hp.get("lora") or {})
        config.lora.rank = int(lora.get("adapter_dim", 16))
        config.lora.alpha = float(lora.get("alpha") or 2 * config.lora.rank)
        config.reference.type = "lora_base"
    config.checkpoint.every_steps = 1_000_000  # the job keeps its final model only
    config.checkpoint.best_metric = "loss"
    errors = validate(config, num_devices=jax.device_count())
    if errors:
        raise ValueError("; ".join(errors))
    del workdir
    return config


def train_job(
    model_dir: Path,
    train_pairs_path: Path,
    val_pairs_path: Path | None,
    output_dir: Path,
    hyperparameters: Mapping[str, Any],
    progress_callback: Callable[[Mapping[str, Any]], None],
) -> None:
    """`TrainFn` for `DpojaxBackend`: trains and writes the model into `output_dir`. Progress is
    reported after every step (`dpojax.jobs.train.train`'s callback), so a cancel (the callback
    raising `JobCancelled`) ends the training within one step. Without validation pairs the job
    trains without evaluation."""
    from dpojax.jobs.train import train

    output_dir = Path(output_dir)
    workdir = output_dir.parent / (output_dir.name + ".dpojax_run")
    config = job_config(model_dir, train_pairs_path, val_pairs_path, workdir, hyperparameters)
    state = {"steps_per_epoch": None}

    def report(step: int, total: int, metrics: dict, eval_metrics: dict | None) -> None:
        if state["steps_per_epoch"] is None:
            state["steps_per_epoch"] = max(total // max(config.train.epochs, 1), 1)
        per_epoch = state["steps_per_epoch"]
        update: dict[str, Any] = {
            "steps_completed": step,
            "total_steps": total,
            "steps_per_epoch": per_epoch,
            "epochs_completed": min(step // per_epoch, config.train.epochs),
        }
        if metrics:  # none when a resumed run had no step left
            update["train_loss"] = metrics["loss"]
            update["train_accuracy"] = metrics["rewards/accuracies"]
        if eval_metrics is not None:
            update["val_loss"] = eval_metrics["loss"]
            update["val_accuracy"] = eval_metrics["rewards/accuracies"]
        progress_callback(update)

    config.train.eval_every = 0
    summary = train(frozen(config), workdir, callback=report)
    if summary["status"] != "completed":
        raise RuntimeError(f"training ended early: {summary['status']}")
    shutil.copytree(workdir / "export", output_dir, dirs_exist_ok=True)
