"""DPO on a Hugging Face model (a local directory or a Hub id) and preference pairs (a pair file,
a dataset folder or a Hub dataset id, in any TRL shape or the Customizer form).

    python -m dpojax.main --config configs/train_pairs.py --workdir runs/my_dpo \
        --config.model.path=/models/Qwen2.5-0.5B-Instruct \
        --config.data.train_path=pairs/train.jsonl --config.data.eval_path=pairs/val.jsonl

    python -m dpojax.main --config configs/train_pairs.py --workdir runs/hh \
        --config.model.path=Qwen/Qwen2.5-0.5B-Instruct --config.data.train_path=Anthropic/hh-rlhf \
        --config.data.eval_split=test

Common overrides: --config.loss.beta=0.1 --config.optim.learning_rate=5e-7
--config.train.batch_size=32 --config.train.grad_accum=4 --config.model.dtype=bfloat16
--config.lora.rank=16 --config.reference.type=lora_base --config.mesh.fsdp=-1 --config.mesh.data=1
"""

from dpojax.config import default_config


def get_config():
    config = default_config()
    config.data.max_length = 1024
    config.data.layout = "padded"
    config.optim.learning_rate = 5e-7
    config.optim.warmup_ratio = 0.1
    config.train.epochs = 1
    config.train.batch_size = 32
    config.train.eval_every = 100
    config.checkpoint.every_steps = 200
    return config
