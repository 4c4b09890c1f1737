"""DPO of an 8B-class Llama (Llama 3.1 8B dimensions) on one 8x H100 VM.

Plan it before renting (no weights and no GPU needed: the plan compiles for 8 H100s on any host
with `pip install -e ".[gpu-plan]"`; on the VM itself add --config.plan.target=local):

    python -m dpojax.main --config configs/llama8b_h100.py \
        --workdir runs/plan_8b_h100 --config.mode=plan

then train with your checkpoint and pairs:

    python -m dpojax.main --config configs/llama8b_h100.py --workdir runs/llama8b \
        --config.model.path=/models/Llama-3.1-8B-Instruct \
        --config.data.train_path=pairs/train.jsonl --config.data.eval_path=pairs/val.jsonl

32 pairs of up to 2,048 tokens per sequence a step, bf16 compute with float32 master weights,
parameters, optimizer state and reference sharded over the 8 GPUs (fsdp), full remat. Install with
`pip install -e ".[cuda]"`. docs/plan.md has its plan.
"""

from pathlib import Path

from dpojax.config import default_config


def get_config():
    config = default_config()
    config.model.dtype = "bfloat16"
    config.model.param_dtype = "float32"
    config.model.remat = "full"
    config.plan.model_config = str(Path(__file__).parent / "models" / "llama-3.1-8b")
    config.plan.target = "gpu:h100:8"
    config.data.max_length = 2048
    config.data.layout = "padded"
    config.train.batch_size = 32
    config.train.eval_batch_size = 32
    config.train.epochs = 1
    config.train.eval_every = 200
    config.optim.learning_rate = 5e-7
    config.optim.warmup_ratio = 0.1
    config.loss.beta = 0.1
    config.mesh.data = 1
    config.mesh.fsdp = 8
    config.mesh.tensor = 1
    config.checkpoint.every_steps = 200
    return config
