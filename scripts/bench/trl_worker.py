"""TRL's side of the step benchmark, run in its own subprocess: Hugging Face TRL's `DPOTrainer` on
the benchmark's model and pairs (needs `pip install -e ".[bench]"`). A step is the time between two
`on_step_end` callbacks: collation, forward, backward, optimizer and logging."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from .measure import peak_rss_gb, timing_summary
from .synthetic import check_tokens, pair_texts


def _dataset(data: list[dict]):
    import datasets

    texts = [pair_texts(p) for p in data]
    return datasets.Dataset.from_dict(
        {
            "prompt": [t[0] for t in texts],
            "chosen": [t[1] for t in texts],
            "rejected": [t[2] for t in texts],
        }
    )


def _dpo_config(spec: dict, out_dir: str):
    """dpojax's benchmark settings in TRL's terms: float32, AdamW at a constant learning rate,
    grad-norm clip 1.0, sigmoid loss with beta 0.1, no gradient checkpointing, the pairs in
    order."""
    from trl import DPOConfig

    return DPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=spec["pairs_per_step"],
        max_steps=spec["warmup"] + spec["steps"],
        learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        beta=0.1,
        loss_type=["sigmoid"],
        max_length=None,
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        precompute_ref_log_probs=spec["reference"] == "precomputed",
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        logging_steps=10_000,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )


def _step_clock():
    """A callback that records when each step ends."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    return StepTimes()


def _check_trl_tokens(trainer, data: list[dict]) -> None:
    rows = trainer.train_dataset
    got = [
        (
            rows[i]["prompt_ids"] + rows[i]["chosen_ids"],
            rows[i]["prompt_ids"] + rows[i]["rejected_ids"],
            len(rows[i]["prompt_ids"]),
        )
        for i in range(len(rows))
    ]
    check_tokens(got, data, "trl")


def _first_batch_logps(trainer, pairs_per_step: int) -> dict:
    """The initial model's per-pair log-probs of the first batch (compared with dpojax's)."""
    rows = trainer.train_dataset
    batch = trainer.data_collator([rows[i] for i in range(pairs_per_step)])
    chosen, rejected = trainer.compute_ref_log_probs(trainer.model, batch)
    return dict(chosen=chosen.tolist(), rejected=rejected.tolist())


def run_trl(spec: dict) -> dict:
    """Times `DPOTrainer` on the spec's model and pairs; returns the worker's result."""
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOTrainer

    datasets.disable_progress_bars()
    os.environ.setdefault("TQDM_DISABLE", "1")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    data = json.loads(Path(spec["data_path"]).read_text())
    warmup, steps = spec["warmup"], spec["steps"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    clock = _step_clock()
    start = time.perf_counter()
    trainer = DPOTrainer(
        model=model,
        args=_dpo_config(spec, tempfile.mkdtemp(prefix="bench_trl_")),
        train_dataset=_dataset(data),
        processing_class=tokenizer,
        callbacks=[clock],
    )
    init_time = time.perf_counter() - start
    _check_trl_tokens(trainer, data)
    logps = _first_batch_logps(trainer, spec["pairs_per_step"])
    setup_time = time.perf_counter() - t0
    trainer.train()
    ends = clock.ends
    if len(ends) != warmup + steps:
        raise SystemExit(f"trl: {len(ends)} steps ran, expected {warmup + steps}")
    times = [b - a for a, b in zip(ends[warmup - 1 : -1], ends[warmup:], strict=True)]
    return dict(
        timing_summary(times),
        setup_s=setup_time,
        init_s=init_time,
        ref_precompute_s=init_time if spec["reference"] == "precomputed" else None,
        first_batch_logps=logps,
        peak_rss_gb=peak_rss_gb(),
        torch_threads=torch.get_num_threads(),
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", ""),
        torch_version=torch.__version__,
        trl_version=trl.__version__,
        transformers_version=transformers.__version__,
        attn_implementation=trainer.model.config._attn_implementation,
    )
