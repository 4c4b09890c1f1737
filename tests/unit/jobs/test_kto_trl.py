"""KTO trained for 10 steps by dpojax and by TRL 1.16's KTOTrainer from the same tiny llama, the
same unpaired records in the same order (no shuffling), batches of 8 with TRL's KL completions
(rotated within each batch), AdamW at a constant learning rate: the per-step losses agree within
1e-4 relative (issue 49's must-show)."""

from __future__ import annotations

import json

import pytest

from dpojax import api

# TRL 1.16's KTOConfig and KTOTrainer use transformers' deprecated gradient-checkpointing names.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

STEPS, BATCH, LR, BETA = 10, 8, 1e-3, 0.1


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from dpojax.models.tiny import make_tiny_checkpoint

    base = tmp_path_factory.mktemp("kto_trl")
    model = make_tiny_checkpoint(base / "model", "llama", seed=0)
    rows = [
        {
            "prompt": f"{i} + {i % 5} =",
            "completion": f" {i + i % 5}" if i % 3 else " 0",
            "label": i % 3 != 0,
        }
        for i in range(16)
    ]
    (base / "unpaired.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return base, model, rows


def _trl_losses(model_dir, rows, out_dir, loss_type: str, accum: int) -> list[float]:
    """TRL's loss at each step: the mean of its micro-batches' (all full)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    torch.manual_seed(0)
    losses: list[float] = []

    class Recording(KTOTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            value = loss[0] if isinstance(loss, tuple) else loss
            if model.training:
                losses.append(float(value.detach()))
            return loss

    args = KTOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=accum,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        beta=BETA,
        loss_type=loss_type,
        max_length=64,
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Recording(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    trainer.train()
    return [sum(losses[i : i + accum]) / accum for i in range(0, len(losses), accum)]


def _dpojax_losses(base, model, work, loss_type: str, accum: int) -> list[float]:
    from tests.helpers.repo_files import load_file

    config = load_file("configs/tiny_test.py").get_config()
    config.model.path = str(model)
    config.model.dtype = "float32"
    config.data.train_path = str(base / "unpaired.jsonl")
    config.data.shuffle = False
    config.data.max_length = 64
    config.loss.type, config.loss.beta = loss_type, BETA
    config.optim.name, config.optim.learning_rate = "adamw", LR
    config.optim.schedule, config.optim.warmup_steps = "constant", 0
    config.optim.weight_decay, config.optim.max_grad_norm = 0.0, 1.0
    config.train.steps, config.train.batch_size = STEPS, BATCH * accum
    config.train.grad_accum = accum
    config.train.eval_batch_size, config.train.eval_every = BATCH, 0
    config.train.report_plots = False
    config.mesh.data = -1
    config.export.enabled = False
    config.checkpoint.every_steps = 100
    api.train(config, work)
    return [r["loss"] for r in api.metrics(work, "train")]


@pytest.mark.slow
@pytest.mark.parametrize("loss_type, accum", [("kto", 1), ("apo_zero_unpaired", 1), ("kto", 2)])
def test_ten_kto_steps_equal_trl_step_by_step(assets, tmp_path, loss_type, accum):
    """With accumulation (the last case) a step is two micro-batches of 8, each with its own KL
    completions and KL estimate, as TRL's."""
    base, model, rows = assets
    trl = _trl_losses(model, rows, tmp_path / "trl", loss_type, accum)
    ours = _dpojax_losses(base, model, tmp_path / "dpojax", loss_type, accum)
    assert len(trl) == len(ours) == STEPS
    assert ours == pytest.approx(trl, rel=1e-4)
    assert ours[-1] < ours[0]
