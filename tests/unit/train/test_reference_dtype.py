"""The frozen reference is kept in the compute dtype on accelerators and as the policy's own dtypes
on a CPU."""

import jax
import jax.numpy as jnp
import optax
import pytest

from dpojax.models import init_model
from dpojax.models.tiny import tiny_config
from dpojax.train.state import StepConfig, create_train_state


def _ref_dtypes(platform: str, param_dtype: str = "float32"):
    config = tiny_config("llama", dtype="bfloat16", param_dtype=param_dtype)
    config = config.replace(target_platform=platform)
    _, state = jax.eval_shape(
        lambda: create_train_state(init_model(config), optax.adam(1e-3), StepConfig())
    )
    return {leaf.dtype for leaf in jax.tree.leaves(state.ref)}, {
        leaf.dtype for leaf in jax.tree.leaves(state.params)
    }


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_reference_in_the_compute_dtype_on_accelerators(platform):
    ref, params = _ref_dtypes(platform)
    assert ref == {jnp.dtype("bfloat16")} and params == {jnp.dtype("float32")}


def test_reference_keeps_the_policy_dtypes_on_cpu():
    ref, params = _ref_dtypes("cpu")
    assert ref == params == {jnp.dtype("float32")}


def test_reference_is_a_copy_even_in_the_same_dtype():
    config = tiny_config("llama", dtype="bfloat16", param_dtype="bfloat16").replace(
        target_platform="tpu"
    )
    _, state = create_train_state(init_model(config), optax.adam(1e-3), StepConfig())
    for ref, param in zip(jax.tree.leaves(state.ref), jax.tree.leaves(state.params), strict=True):
        assert (
            ref.dtype == param.dtype
            and ref.unsafe_buffer_pointer() != param.unsafe_buffer_pointer()
        )
