"""A few steps on a tiny local model: what the tests run.

    python -m dpojax.main --config configs/tiny_test.py --workdir runs/tiny_test \
        --config.model.path=runs/tiny-llama --config.data.train_path=pairs.jsonl

Make the model with `python -m dpojax.models.tiny --out runs/tiny-llama`.
"""

from dpojax.config import default_config


def get_config():
    config = default_config()
    config.data.max_length = 64
    config.optim.learning_rate = 1e-3
    config.optim.schedule = "constant"
    config.train.steps = 6
    config.train.batch_size = 4
    config.train.eval_batch_size = 4
    config.train.eval_every = 3
    config.train.progress = False
    config.checkpoint.every_steps = 2
    config.checkpoint.async_save = True
    config.mesh.data = 1
    return config
