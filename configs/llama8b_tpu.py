"""DPO of an 8B-class Llama (Llama 3.1 8B dimensions) on a TPU v5p slice (4 chips, v5p:2x2x1).

Plan it on any machine first (no TPU, no weights: the architecture comes from
configs/models/llama-3.1-8b/config.json; needs `pip install -e ".[tpu-plan]"`):

    python -m dpojax.main --config configs/llama8b_tpu.py --workdir runs/plan_8b \
        --config.mode=plan --config.plan.target=tpu:v5p:2x2x1

then train on the slice with your checkpoint and pairs:

    python -m dpojax.main --config configs/llama8b_tpu.py --workdir gs-fuse-or-nfs/llama8b \
        --config.model.path=/models/Llama-3.1-8B-Instruct \
        --config.data.train_path=pairs/train.jsonl --config.data.eval_path=pairs/val.jsonl

8 pairs of up to 2,048 tokens per sequence a step, bf16 compute with float32 master weights and
a frozen float32 reference, everything sharded over the chips (fsdp), full remat. docs/plan.md has
the plan's figures for this recipe.
"""

from pathlib import Path

from dpojax.config import default_config


def get_config():
    config = default_config()
    config.model.dtype = "bfloat16"
    config.model.param_dtype = "float32"
    config.model.remat = "full"
    config.plan.model_config = str(Path(__file__).parent / "models" / "llama-3.1-8b")
    config.plan.target = "tpu:v5p:2x2x1"
    config.data.max_length = 2048
    config.data.layout = "padded"
    config.train.batch_size = 8
    config.train.eval_batch_size = 8
    config.train.epochs = 1
    config.train.eval_every = 200
    config.optim.learning_rate = 5e-7
    config.optim.warmup_ratio = 0.1
    config.loss.beta = 0.1
    config.mesh.data = 1
    config.mesh.fsdp = -1
    config.checkpoint.every_steps = 200
    return config
