"""DPO of a 1B-class Llama (Llama 3.2 1B dimensions) on a TPU v5e slice (4 chips, v5e:2x2).

Plan it on any machine first (no TPU, no weights: the architecture comes from
configs/models/llama-3.2-1b/config.json; needs `pip install -e ".[tpu-plan]"`):

    python -m dpojax.main --config configs/llama1b_tpu.py --workdir runs/plan_1b \
        --config.mode=plan --config.plan.target=tpu:v5e:2x2

then train on the slice with your checkpoint and pairs:

    python -m dpojax.main --config configs/llama1b_tpu.py --workdir gs-fuse-or-nfs/llama1b \
        --config.model.path=/models/Llama-3.2-1B-Instruct \
        --config.data.train_path=pairs/train.jsonl --config.data.eval_path=pairs/val.jsonl

8 pairs of up to 2,048 tokens per sequence a step, bf16 compute with float32 master weights,
parameters and optimizer state sharded over the 4 chips (fsdp). docs/plan.md has the plan's
figures for this recipe (memory per chip for each remat policy, FLOPs, roofline).
"""

from pathlib import Path

from dpojax.config import default_config


def get_config():
    config = default_config()
    config.model.dtype = "bfloat16"
    config.model.param_dtype = "float32"
    config.model.remat = "full"
    config.plan.model_config = str(Path(__file__).parent / "models" / "llama-3.2-1b")
    config.plan.target = "tpu:v5e:2x2"
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
