"""What the compiled CPU step holds at its peak: micro-batches divide it, rematerialized scanned
layers cut it."""

import jax
import pytest

from dpojax.models import init_model
from dpojax.models.tiny import tiny_config
from dpojax.train.loss_settings import LossSettings
from dpojax.train.optim import make_optimizer
from dpojax.train.state import StepConfig, create_train_state
from dpojax.train.step import Stepper
from tests.helpers.synthetic import copy_task, micro_batches, padded_batch

VOCAB = 64
ROWS = 512  # tokens per row: activations well above the parameters and optimizer state
DIMS = dict(hidden_size=128, intermediate_size=512, num_layers=4)


def _temp_bytes(model, micro: int, pairs: int = 8) -> int:
    cfg = StepConfig(loss=LossSettings(type="sigmoid", beta=0.1))
    tx, sched = make_optimizer(1e-3, schedule="constant", max_grad_norm=1.0, name="adamw")
    graphdef, state = create_train_state(model, tx, cfg)
    stepper = Stepper(graphdef, tx, sched, cfg, model.config.lora_rank > 0)
    triples = copy_task(pairs, 0, VOCAB)
    per = pairs // micro
    batch = micro_batches(
        [padded_batch(triples[i * per : (i + 1) * per], ROWS) for i in range(micro)]
    )
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
    compiled = stepper.lower(state, abstract).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _model(remat="none", scan=False):
    return init_model(
        tiny_config("llama", vocab_size=VOCAB, remat=remat, scan_layers=scan, **DIMS), seed=0
    )


@pytest.mark.slow
@pytest.mark.newest
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU scheduler's behaviour")
def test_two_micro_batches_halve_the_steps_temporaries():
    """Every micro-batch runs inside the scan: with the first one peeled off before a scan of one
    iteration, XLA saw two straight-line micro-batches, interleaved them, and k=2 held as much as
    k=1 (0.87 against 0.89 GiB for 8 pairs of 512 tokens, docs/benchmarks.md)."""
    one = _temp_bytes(_model(), micro=1)
    two = _temp_bytes(_model(), micro=2)
    four = _temp_bytes(_model(), micro=4)
    assert two < 0.65 * one, (one, two)
    assert four < 0.65 * two, (two, four)


@pytest.mark.slow
@pytest.mark.newest
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU scheduler's behaviour")
def test_scanned_rematerialized_layers_hold_the_least_on_cpus():
    """Looped, jax 0.10.2's XLA CPU scheduler recomputes every layer at the start of the backward
    pass and defers the weight gradients, so full remat held nearly as much as none (510 against
    577 MB here); jax 0.12's keeps the loop's remat (226 MB). Scanned (model.scan_layers "auto"
    under remat on CPUs), each layer is recomputed and differentiated in its turn, the least
    with either (179 MB on jax 0.12)."""
    looped_none = _temp_bytes(_model("none", scan=False), micro=1)
    looped_full = _temp_bytes(_model("full", scan=False), micro=1)
    scanned_full = _temp_bytes(_model("full", scan=True), micro=1)
    sizes = (looped_none, looped_full, scanned_full)
    assert scanned_full < 0.5 * looped_none and scanned_full <= looped_full, sizes
