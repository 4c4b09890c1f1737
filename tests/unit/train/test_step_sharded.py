"""The sharded step on 8 fake CPU devices equals the single-device step."""

import jax
import numpy as np
import pytest

from dpojax.models import add_lora, init_model
from dpojax.models.sharding import make_mesh
from dpojax.train.loss_settings import LossSettings
from dpojax.train.reference_choice import FrozenReference, LoraBaseReference
from dpojax.train.state import StepConfig
from tests.unit.train.test_step import _batch, _config, _flat, _setup

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def _run(model_fn, cfg, mesh, steps=3):
    # SGD: Adam's first steps turn float noise in near-zero gradients into lr-sized differences
    stepper, state = _setup(model_fn(), cfg, lr=0.5, mesh=mesh, opt="sgd")
    history, first = [], None
    for i in range(steps):
        state, metrics = stepper.train(state, _batch(n=16, seed=10 + i, micro=2))
        history.append({k: float(v) for k, v in metrics.items()})
        first = first or _flat(state.params)
    return stepper, state, history, first


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 2, 2), (8, 1, 1)])
@pytest.mark.parametrize("lora", [False, True])
def test_sharded_step_equals_single_device(shape, lora):
    def model_fn():
        model = init_model(_config(), seed=11)
        return add_lora(model, rank=4, alpha=8.0, seed=2) if lora else model

    cfg = StepConfig(
        loss=LossSettings(type="sigmoid", beta=0.1),
        reference=LoraBaseReference() if lora else FrozenReference(),
    )
    _, single_state, single, single_first = _run(model_fn, cfg, None)
    mesh = make_mesh(*shape)
    stepper, sharded_state, sharded, sharded_first = _run(model_fn, cfg, mesh)
    for i, (a, b) in enumerate(zip(single, sharded, strict=True)):
        for key in a:
            if i == 0 and key in ("rewards/accuracies", "acc"):
                continue  # policy == reference: strict > compares float noise
            assert b[key] == pytest.approx(a[key], abs=1e-5), (i, key)
    for path, value in sharded_first.items():
        np.testing.assert_allclose(value, single_first[path], atol=1e-5, err_msg=str(path))
    expected = _flat(single_state.params)
    for path, value in _flat(sharded_state.params).items():
        np.testing.assert_allclose(value, expected[path], atol=1e-5, err_msg=str(path))
    assert stepper.train_cache_size() == 1
    if not lora and shape == (2, 2, 2):
        kernel = sharded_state.params["layers"][0]["mlp"]["up_proj"]["kernel"].get_value()
        assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")


def test_batch_not_divisible_by_data_devices_is_reported():
    stepper, state = _setup(init_model(_config(), seed=1), mesh=make_mesh(8, 1, 1))
    with pytest.raises(ValueError, match="not divisible by the 8 data-parallel devices"):
        stepper.train(state, _batch(n=4))


@pytest.mark.slow
def test_optimizer_moments_are_sharded_like_their_parameters():
    stepper, state = _setup(init_model(_config(), seed=1), mesh=make_mesh(2, 2, 2))
    state, _ = stepper.train(state, _batch(n=16, micro=1))
    kernel = state.params["layers"][0]["mlp"]["up_proj"]["kernel"].get_value()
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.shape == kernel.shape]
    assert len(moments) >= 2  # adam mu and nu of this kernel (and of same-shaped ones)
    for m in moments:
        assert (
            m.sharding.spec == kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
        )


@pytest.mark.slow
def test_sharded_step_with_flash_attention_equals_the_reference_single_device():
    """The flash path under a (data, fsdp, tensor) mesh: the same metrics and updates as the
    reference attention on one device."""
    cfg = StepConfig(loss=LossSettings(type="sigmoid", beta=0.1))
    config = _config()
    _, single_state, single, _ = _run(
        lambda: init_model(config.replace(attention="reference"), seed=11), cfg, None
    )
    _, sharded_state, sharded, _ = _run(
        lambda: init_model(config.replace(attention="flash"), seed=11), cfg, make_mesh(2, 2, 2)
    )
    for a, b in zip(single[1:], sharded[1:], strict=True):
        for key in a:
            assert b[key] == pytest.approx(a[key], abs=1e-5), key
    expected = _flat(single_state.params)
    for path, value in _flat(sharded_state.params).items():
        np.testing.assert_allclose(value, expected[path], atol=1e-5, err_msg=str(path))
