"""Subprocess for tests/unit/train/test_checkpoint.py: saves checkpoint 1, then dies by SIGKILL while
checkpoint 2 is being saved.

    python tests/helpers/checkpoint_crash.py DIR write    # killed while 2's arrays are written
    python tests/helpers/checkpoint_crash.py DIR commit   # killed just before 2's commit rename
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np

from dpojax.models import add_lora, init_model
from dpojax.models.tiny import tiny_config
from dpojax.train.checkpoint import Checkpointer
from dpojax.train.optim import make_optimizer
from dpojax.train.reference_choice import KINDS
from dpojax.train.state import StepConfig, TrainState, create_train_state


def make_state(seed: int = 0, *, vocab_size: int = 64, lora_rank: int = 0) -> TrainState:
    """A tiny llama's initial train state (deterministic in `seed`), optionally with LoRA."""
    model = init_model(tiny_config("llama", vocab_size=vocab_size), seed=seed)
    reference = "frozen"
    if lora_rank:
        model, reference = add_lora(model, rank=lora_rank, seed=seed + 1), "lora_base"
    tx, _ = make_optimizer(1e-3, schedule="constant")
    return create_train_state(model, tx, StepConfig(reference=KINDS[reference]()))[1]


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _files_under(path: str) -> list[str]:
    return [os.path.join(root, f) for root, _, files in os.walk(path) for f in files]


def _kill_while_writing(directory: str, step: int) -> None:
    """Dies once checkpoint `step`'s temporary directory holds some written array data."""
    tmp = os.path.join(directory, f"{step}.orbax-checkpoint-tmp")
    while not any("/state/" in f and os.path.getsize(f) for f in _files_under(tmp)):
        time.sleep(0.0005)
    _kill()


def _kill_before_commit(step: int) -> None:
    """Patches orbax's atomic-rename finalisation: everything of checkpoint `step` is written, the
    process dies right before the rename that commits it."""
    from orbax.checkpoint._src.path import atomicity

    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self):
        if self.get_final().name == str(step):
            _kill()
        return await original(self)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize


def main(directory: str, mode: str) -> None:
    ckpt = Checkpointer(directory, max_to_keep=1, async_save=True)  # step 1 goes once 2 commits
    ckpt.save(1, make_state(), extra={"step": 1})
    ckpt.wait()
    if mode == "write":
        big = jnp.asarray(np.random.default_rng(0).random(32 * 2**20, np.float32))
        state = TrainState(
            step=jnp.ones((), jnp.int32), params={"w": big}, frozen={}, ref=None, opt_state=()
        )
        threading.Thread(target=_kill_while_writing, args=(directory, 2), daemon=True).start()
    else:
        state = make_state(seed=1)
        _kill_before_commit(2)
    ckpt.save(2, state, extra={"step": 2})
    ckpt.wait()
    time.sleep(30)  # not reached: the kill comes first
    sys.exit(3)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
