"""DPO of an 8B-class Llama (Llama 3.1 8B dimensions) on 131,072-token rows, a TPU v5p slice of
4 chips (v5p:2x2x1).

The TPU twin of configs/llama8b_h100_128k.py: one pair a step whose rows are 131,072 tokens (the
model's `max_position_embeddings`), split over the 4 chips' `context` mesh axis (32,768 tokens of
every activation a chip); weights, gradients and optimizer state sharded over fsdp x context (4
ways). docs/long_context.md says what the axis costs.

Plan it on any machine first (compile-only; `pip install -e ".[tpu-plan]"`):

    python -m dpojax.main --config configs/llama8b_v5p_128k.py \
        --workdir runs/plan_8b_v5p_128k --config.mode=plan

then train on the slice with your checkpoint and long pairs:

    python -m dpojax.main --config configs/llama8b_v5p_128k.py --workdir gs-fuse-or-nfs/llama8b_128k \
        --config.model.path=/models/Llama-3.1-8B-Instruct \
        --config.data.train_path=pairs/train.jsonl --config.data.eval_path=pairs/val.jsonl

bf16 compute with float32 master weights, full remat, the Pallas kernels on the split rows.
"""

from pathlib import Path

from dpojax import api


def get_config():
    # llama8b_tpu.py's recipe (bf16 compute, float32 master weights, full remat) on long rows
    config = api.config(str(Path(__file__).with_name("llama8b_tpu.py")))
    config.data.max_length = 131072
    config.train.batch_size = 1
    config.train.eval_batch_size = 1
    config.mesh.data = 1
    config.mesh.fsdp = 1
    config.mesh.context = 4
    config.mesh.tensor = 1
    return config
