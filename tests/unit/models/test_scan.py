"""Scanned decoder layers (`model.scan_layers`): the same numbers as the per-layer loop (logits,
DPO losses and gradients, float32), and every format around the model unchanged: HF and PEFT
files, the KV-cache sampler, checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpojax.models import (
    abstract_model,
    add_lora,
    from_pretrained,
    init_model,
    merge_lora,
    save_pretrained,
)
from dpojax.models.decode import decode_step, init_cache, prefill
from dpojax.models.families import ModelConfigError
from dpojax.models.peft import lora_tensors
from dpojax.models.safetensors_io import load_tensors
from dpojax.models.scan import STACK, layer_path, resolve, scan_period
from dpojax.models.sharding import DEFAULT_RULES, partition_specs
from dpojax.models.tiny import TINY_FAMILIES, make_tiny_checkpoint, tiny_config
from dpojax.train.checkpoint import Checkpointer, CheckpointError

VOCAB = 64
PAIR = ("sliding_attention", "full_attention")
# Each tiny preset with layers whose kinds repeat with a period below the layer count: Gemma's
# sliding / global alternation over 4 layers, Qwen3-MoE's dense / MoE alternation.
SCANNABLE = {
    "gemma2": dict(num_layers=4, layer_types=PAIR * 2),
    "gemma3": dict(num_layers=4, layer_types=PAIR * 2),
    "qwen3_moe": dict(num_layers=4, mlp_only_layers=(), decoder_sparse_step=2),
}
# remat inside the scanned body (compared with the loop without remat)
REMAT = {"gemma2": "full", "qwen3": "dots", "gemma3": "attention", "llama": "dots_no_batch"}


def _configs(family, **kw):
    overrides = {**SCANNABLE.get(family, {}), **kw}
    plain = tiny_config(family, vocab_size=VOCAB, **overrides)
    return plain, plain.replace(scan_layers=True)


def _per_layer(model) -> dict:
    """{unscanned path: value} of every variable of `model`, scanned or not."""
    out = {}
    config = model.config
    period = config.scan_period()[0] if config.scan_layers else 1
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = np.asarray(var.get_value())
        if path[0] == STACK:
            for g in range(value.shape[0]):
                out[layer_path(path, g, period)] = value[g]
        else:
            out[path] = value
    return out


def _assert_same_params(scanned, plain):
    a, b = _per_layer(scanned), _per_layer(plain)
    assert a.keys() == b.keys()
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))


def _tokens(batch=2, length=12, seed=0):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, VOCAB)


def test_period_of_each_layer_pattern_and_the_choice():
    assert tiny_config("llama").scan_period() == (1, "")
    assert tiny_config("gemma2", **SCANNABLE["gemma2"]).scan_period() == (2, "")
    gemma3_1b = tiny_config(
        "gemma3", num_layers=26, layer_types=((PAIR[0],) * 5 + (PAIR[1],)) * 4 + PAIR
    )
    period, why = gemma3_1b.scan_period()
    assert period == 0 and "period that divides 26" in why
    assert scan_period(12, [0, 0, 0, 0, 0, 1] * 2) == (6, "")
    assert scan_period(1, [0])[0] == 0
    with pytest.raises(ModelConfigError, match="cannot scan its layers.*scan_layers=false"):
        tiny_config("qwen3_moe", scan_layers=True)  # [moe, dense, moe]
    assert resolve("auto", 1, "cpu") is False
    # CPUs scan rematerialized layers: the loop lets XLA hoist the recomputation
    assert resolve("auto", 1, "cpu", remat="dots") is True
    assert resolve("auto", 1, "cpu", remat="full") is True
    assert resolve("auto", 0, "cpu", remat="full") is False
    assert resolve("auto", 1, "tpu") is True and resolve("auto", 1, "gpu") is True
    assert resolve("auto", 0, "tpu") is False
    assert resolve("true", 1, "cpu") is True and resolve("false", 1, "tpu") is False
    with pytest.raises(ValueError, match="scan_layers must be one of"):
        resolve("yes", 1, "cpu")


def test_stacked_parameters_and_sharding_axes():
    _, cfg = _configs("gemma2")
    model = abstract_model(cfg)
    assert model.layers is None and len(model.layer_stack) == 2
    q = model.layer_stack[0].self_attn.q_proj.kernel
    assert q.shape == (2, 64, 4 * 32)
    assert q.get_metadata()["logical_axes"] == ("layers", "embed", "heads")
    assert [layer.sliding for layer in model.layer_stack] == [True, False]
    specs = partition_specs(model, DEFAULT_RULES)
    # the embedding dimension is split over fsdp and context together (docs/long_context.md)
    assert specs["layer_stack"][0]["self_attn"]["q_proj"]["kernel"] == jax.sharding.PartitionSpec(
        None, ("fsdp", "context"), "tensor"
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_scanned_logits_losses_and_grads_equal_the_layer_loop(family):
    plain_cfg, scan_cfg = _configs(family)
    scan_cfg = scan_cfg.replace(remat=REMAT.get(family, "none"))
    plain, scanned = init_model(plain_cfg, seed=3), init_model(scan_cfg, seed=3)
    _assert_same_params(scanned, plain)  # the same initialisation, stacked
    tokens = _tokens()
    moe = plain_cfg.num_experts > 0

    @jax.jit
    def loss_and_grads(model, tokens):
        def loss(model):
            logits, router = model(tokens, return_router_logits=True)
            logps = jax.nn.log_softmax(logits)
            picked = jnp.take_along_axis(logps[:, :-1], tokens[:, 1:, None], -1)[..., 0]
            # a DPO-shaped loss: -log sigmoid(beta * (row 0 - row 1)) on summed log-probs
            margin = 0.1 * (picked[0].sum() - picked[1].sum())
            return -jax.nn.log_sigmoid(margin), (logits, router)

        return nnx.value_and_grad(loss, has_aux=True)(model)

    (loss_p, (logits_p, router_p)), grads_p = loss_and_grads(plain, tokens)
    (loss_s, (logits_s, router_s)), grads_s = loss_and_grads(scanned, tokens)
    np.testing.assert_allclose(logits_s, logits_p, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss_s, loss_p, rtol=1e-6, atol=1e-6)
    assert len(router_s) == len(router_p) == (2 if moe else 0)
    for a, b in zip(router_s, router_p, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    ga = _per_layer(nnx.merge(nnx.graphdef(scanned), grads_s))
    gb = _per_layer(nnx.merge(nnx.graphdef(plain), grads_p))
    for path in gb:
        np.testing.assert_allclose(ga[path], gb[path], rtol=1e-4, atol=1e-6, err_msg=str(path))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "phi3", "qwen3_moe"])
def test_hf_round_trip_with_scanned_layers(tmp_path, family):
    """A scanned model reads an HF directory (per-layer tensors, fused Phi-3 projections, MoE
    experts) into its stacks and writes the same tensors back."""
    overrides = SCANNABLE.get(family, {})
    path = make_tiny_checkpoint(tmp_path / "hf", family, seed=2, **overrides)
    plain, _ = from_pretrained(path, tokenizer=False)
    scanned, _ = from_pretrained(path, tokenizer=False, scan_layers=True)
    assert scanned.config.scan_layers and not plain.config.scan_layers
    _assert_same_params(scanned, plain)
    tokens = _tokens(length=10)
    np.testing.assert_allclose(scanned(tokens), plain(tokens), rtol=1e-5, atol=1e-5)
    save_pretrained(scanned, None, tmp_path / "out")
    before = load_tensors(path / "model.safetensors")
    after = load_tensors(tmp_path / "out" / "model.safetensors")
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    auto, _ = from_pretrained(path, tokenizer=False, scan_layers="auto")
    assert not auto.config.scan_layers  # off on CPUs


def _same_adapters(plain, scanned, seed=0):
    """Non-zero lora_b factors, the same per layer in both models."""
    rng = np.random.default_rng(seed)
    period = scanned.config.scan_period()[0]
    for path, var in nnx.to_flat_state(nnx.state(scanned, nnx.Param)):
        if path[-1] != "lora_b":
            continue
        value = rng.normal(0, 0.01, var.get_value().shape).astype(np.float32)
        var.set_value(jnp.asarray(value))
        for g in range(value.shape[0]):
            owner = plain
            for key in layer_path(path, g, period)[:-1]:
                owner = owner[key] if isinstance(key, int) else getattr(owner, key)
            owner.lora_b.set_value(jnp.asarray(value[g]))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_lora_and_peft_export_with_scanned_layers(family):
    plain_cfg, scan_cfg = _configs(family)
    targets = ("q_proj", "v_proj", "up_proj")
    plain = add_lora(init_model(plain_cfg, seed=0), rank=2, alpha=4.0, targets=targets, seed=5)
    scanned = add_lora(init_model(scan_cfg, seed=0), rank=2, alpha=4.0, targets=targets, seed=5)
    _same_adapters(plain, scanned)
    _assert_same_params(scanned, plain)
    tokens = _tokens()
    np.testing.assert_allclose(scanned(tokens), plain(tokens), rtol=1e-5, atol=1e-5)
    expected, got = lora_tensors(plain), lora_tensors(scanned)
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    merged = merge_lora(scanned)
    assert merged.config.scan_layers and merged.config.lora_rank == 0
    _assert_same_params(merged, merge_lora(plain))


@pytest.mark.slow
def test_kv_cache_decoding_with_scanned_layers():
    plain_cfg, scan_cfg = _configs("gemma3")
    plain, scanned = init_model(plain_cfg, seed=4), init_model(scan_cfg, seed=4)
    tokens, lengths = _tokens(length=7, seed=2), jnp.array([7, 5])

    @jax.jit
    def run(model):
        cache = init_cache(model.config, 2, 12)
        logits, cache = prefill(model, tokens, lengths, cache)
        out = [logits]
        for _ in range(3):
            logits, cache = decode_step(model, jnp.argmax(logits, -1).astype(jnp.int32), cache)
            out.append(logits)
        return jnp.stack(out)

    np.testing.assert_allclose(run(scanned), run(plain), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_checkpoint_round_trip_and_a_scan_mismatch(tmp_path):
    from tests.unit.train.test_step import _batch, _setup

    _, scan_cfg = _configs("llama")
    stepper, state = _setup(init_model(scan_cfg, seed=0))
    state, _ = stepper.train(state, _batch(seed=0))
    expected = [np.array(x) for x in jax.tree.leaves((state.step, state.params, state.opt_state))]
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        assert ckpt.save(1, state, extra={})
        _, template = _setup(init_model(scan_cfg, seed=9))
        restored, _ = ckpt.restore(template)
        got = jax.tree.leaves((restored.step, restored.params, restored.opt_state))
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
        _, unscanned = _setup(init_model(scan_cfg.replace(scan_layers=False), seed=9))
        with pytest.raises(CheckpointError, match="set model.scan_layers=true"):
            ckpt.restore(unscanned)
