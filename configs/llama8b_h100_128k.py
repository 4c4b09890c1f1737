"""DPO of an 8B-class Llama (Llama 3.1 8B dimensions) on 131,072-token rows, one 8x H100 VM.

Agent trajectories: one pair a step whose rows are 131,072 tokens long (the model's
`max_position_embeddings`). No device holds a whole row: the 8 GPUs form the `context` mesh axis,
each holds 16,384 tokens of every activation, and the weights, gradients and optimizer state are
sharded over fsdp x context together (8 ways). docs/long_context.md says what the axis costs.

Plan it before renting (compile-only, no GPU and no weights; `pip install -e ".[gpu-plan]"`):

    python -m dpojax.main --config configs/llama8b_h100_128k.py \
        --workdir runs/plan_8b_h100_128k --config.mode=plan

then train with your checkpoint and long pairs (prompts of agent trajectories):

    python -m dpojax.main --config configs/llama8b_h100_128k.py --workdir runs/llama8b_128k \
        --config.model.path=/models/Llama-3.1-8B-Instruct \
        --config.data.train_path=pairs/train.jsonl --config.data.eval_path=pairs/val.jsonl

bf16 compute with float32 master weights, full remat, flash attention on the split rows (cuDNN
does not run split rows). Install with `pip install -e ".[cuda]"`.
"""

from pathlib import Path

from dpojax import api


def get_config():
    # llama8b_h100.py's recipe (bf16 compute, float32 master weights, full remat) on long rows
    config = api.config(str(Path(__file__).with_name("llama8b_h100.py")))
    config.data.max_length = 131072
    config.train.batch_size = 1
    config.train.eval_batch_size = 1
    config.mesh.data = 1
    config.mesh.fsdp = 1
    config.mesh.context = 8
    config.mesh.tensor = 1
    return config
