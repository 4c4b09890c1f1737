"""Activations keep the batch sharding of `ACTIVATION_RULES` on a (data, fsdp, tensor) mesh of 8
fake CPU devices, and pinning them changes no number."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpojax.models import init_model, named_shardings, transformer
from dpojax.models.sharding import ACTIVATION_RULES, constrain, make_mesh, spec_for
from dpojax.models.tiny import tiny_config

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def _sharded(model, mesh):
    state = nnx.state(model)
    placed = jax.device_put(nnx.state(model, nnx.Param), named_shardings(model, mesh))
    state.update(placed)
    return nnx.merge(nnx.graphdef(model), state)


def _tokens(mesh):
    return jax.device_put(_host_tokens(), NamedSharding(mesh, P(("data", "fsdp"))))


def _layer_output_specs(model, tokens, mesh, monkeypatch) -> list:
    """The sharding XLA gives every layer's output (the residual stream) in a forward pass."""
    seen = []
    original = transformer._layer_forward

    def watched(layer, x, rows, cos, sin):
        out, logits = original(layer, x, rows, cos, sin)
        jax.debug.inspect_array_sharding(out, callback=seen.append)
        return out, logits

    monkeypatch.setattr(transformer, "_layer_forward", watched)
    with jax.set_mesh(mesh):
        nnx.jit(lambda m, t: m(t, return_hidden=True))(model, tokens)
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_every_layer_output_is_sharded_over_the_batch_only(family, monkeypatch):
    """Each layer's output is split over (data, fsdp) on the batch and whole on the embedding,
    whatever layout the fsdp-sharded weights would suggest to XLA's propagation."""
    mesh = make_mesh(2, 2, 2)
    config = tiny_config(family)
    model = _sharded(init_model(config), mesh)
    specs = _layer_output_specs(model, _tokens(mesh), mesh, monkeypatch)
    assert len(specs) == config.num_layers
    want = NamedSharding(mesh, P(("data", "fsdp"), None, None))
    for i, sharding in enumerate(specs):
        assert sharding.is_equivalent_to(want, 3), f"layer {i}: {sharding}"


def test_without_the_constraints_the_layout_is_lost(monkeypatch):
    """The check above can fail: with `constrain` a no-op XLA picks another layout for some
    layer's output (the fsdp-sharded embedding dimension of the weights)."""
    mesh = make_mesh(1, 8, 1)
    model = _sharded(init_model(tiny_config("llama")), mesh)
    monkeypatch.setattr(transformer, "constrain", lambda x, names: x)
    specs = _layer_output_specs(model, _tokens(mesh), mesh, monkeypatch)
    want = NamedSharding(mesh, P(("data", "fsdp"), None, None))
    assert not all(s.is_equivalent_to(want, 3) for s in specs)


# Gemma 2's soft-capped attention runs in the reference implementation only.
@pytest.mark.parametrize(
    "family, attention",
    # The kernels' variants compile for 5-15 s each: the slow tier, on the newest JAX too (their
    # outcome follows the JAX release's Pallas); the reference variants stay in the fast loop.
    [
        (f, a)
        if a == "reference"
        else pytest.param(f, a, marks=[pytest.mark.slow, pytest.mark.newest])
        for f in ("llama", "qwen3_moe")
        for a in ("reference", "flash", "pallas")
    ]
    + [("gemma2", "reference")],
)
def test_constrained_forward_equals_single_device(family, attention):
    mesh = make_mesh(2, 2, 2)
    config = tiny_config(family, attention=attention)
    model = init_model(config)
    single = np.asarray(model(_host_tokens()))
    sharded = _sharded(model, mesh)
    with jax.set_mesh(mesh):
        logits = nnx.jit(lambda m, t: m(t))(sharded, _tokens(mesh))
    np.testing.assert_allclose(np.asarray(logits), single, atol=2e-5)


def _host_tokens():
    return jnp.asarray(np.random.default_rng(0).integers(0, 512, size=(8, 16)))


def test_constrain_is_a_no_op_without_a_mesh_and_replicates_indivisible_dimensions():
    x = jnp.ones((3, 5, 8))
    assert constrain(x, ("batch", "length", "embed")) is x
    mesh = make_mesh(2, 2, 2)
    assert spec_for(("batch", "length", "mlp"), (8, 5, 6), ACTIVATION_RULES, mesh) == P(
        ("data", "fsdp"), None, "tensor"
    )
    assert spec_for(("batch", "length", "heads"), (6, 5, 3), ACTIVATION_RULES, mesh) == P(
        None, None, None
    )
