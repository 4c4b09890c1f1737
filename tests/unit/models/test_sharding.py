"""Logical axis annotations -> shardings on a (data, fsdp, tensor) mesh of 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dpojax.models import abstract_model, from_pretrained, init_model, partition_specs
from dpojax.models.sharding import logical_axes, make_mesh, spec_for
from dpojax.models.tiny import make_tiny_checkpoint, tiny_config

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def test_every_parameter_has_logical_axes_matching_its_rank():
    model = abstract_model(tiny_config("qwen3"))
    axes = nnx.to_flat_state(logical_axes(model))
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert len(axes) == len(params) > 0
    for path, names in axes:
        assert names is not None, path
        assert len(names) == len(params[path].shape), path


def test_partition_specs_follow_rules():
    mesh = make_mesh(2, 2, 2)
    model = abstract_model(tiny_config("llama"))
    specs = partition_specs(model, mesh=mesh)
    assert specs["embed_tokens"] == P("tensor", "fsdp")
    assert specs["layers"][0]["self_attn"]["q_proj"]["kernel"] == P("fsdp", "tensor")
    assert specs["layers"][0]["mlp"]["down_proj"]["kernel"] == P("tensor", "fsdp")
    assert specs["norm"]["weight"] == P(None)


def test_indivisible_dimension_is_replicated():
    mesh = make_mesh(1, 1, 8)
    assert spec_for(("vocab", "embed"), (1001, 64), mesh=mesh) == P(None, None)
    assert spec_for(("vocab", "embed"), (1000, 64), mesh=mesh) == P("tensor", None)
    # without a mesh, every axis of the rule (embed: fsdp and context together)
    assert spec_for(("embed", "mlp"), (64, 176)) == P(("fsdp", "context"), "tensor")


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 2, 2), (8, 1, 1), (1, 2, 4)])
def test_sharded_load_gives_same_logits_as_single_device(shape, tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "llama", seed=4)
    single, _ = from_pretrained(path, tokenizer=False)
    mesh = make_mesh(*shape)
    sharded, _ = from_pretrained(path, tokenizer=False, mesh=mesh)
    q = sharded.layers[0].self_attn.q_proj.kernel.get_value()
    assert len(q.sharding.device_set) == 8
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, size=(8, 12)))
    tokens = jax.device_put(tokens, jax.NamedSharding(mesh, P(("data", "fsdp"))))
    logits = nnx.jit(lambda m, t: m(t))(sharded, tokens)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(single(tokens)), atol=1e-5)


def test_init_under_jit_with_out_shardings_places_params():
    mesh = make_mesh(2, 2, 2)
    config = tiny_config("qwen2")
    specs = partition_specs(abstract_model(config), mesh=mesh)
    shardings = jax.tree.map(
        lambda s: jax.NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
    )

    @jax.jit
    def make():
        state = nnx.state(init_model(config, seed=0))
        return jax.lax.with_sharding_constraint(state, shardings)

    state = make()
    kernel = state["layers"][1]["mlp"]["gate_proj"]["kernel"].get_value()
    assert kernel.sharding.spec == P("fsdp", "tensor")


def test_make_mesh_fills_the_remaining_axis_and_rejects_bad_shapes():
    assert dict(make_mesh(-1, 2, 1).shape) == {"data": 4, "fsdp": 2, "context": 1, "tensor": 1}
    assert dict(make_mesh(1, 1, -1).shape) == {"data": 1, "fsdp": 1, "context": 1, "tensor": 8}
    assert dict(make_mesh(2, 1, 1, context=-1).shape) == {
        "data": 2,
        "fsdp": 1,
        "context": 4,
        "tensor": 1,
    }
    with pytest.raises(ValueError, match="cannot be split"):
        make_mesh(-1, 3, 1)
    with pytest.raises(ValueError, match="at most one"):
        make_mesh(-1, -1, 1)
    with pytest.raises(ValueError, match="= 4 but there are 8 devices"):
        make_mesh(2, 2, 1)
