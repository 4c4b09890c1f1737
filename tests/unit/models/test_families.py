"""The families added to the Llama-style decoder: Gemma 2 / Gemma 3 soft-capping and norms, Phi-3's
fused projections, Qwen3-MoE routing and its auxiliary loss, against transformers' PyTorch models
(tiny random configs), and their use in the DPO step."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpojax.models import config_to_hf, from_pretrained, init_model, save_pretrained
from dpojax.models.tiny import tiny_config
from dpojax.models.transformer import load_balancing_loss
from dpojax.train.logprobs import token_logps
from dpojax.train.loss_settings import LossSettings
from tests.helpers.synthetic import naive_token_logps
from tests.unit.models.test_parity import TOL, _tokens, _torch_logits, _torch_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_FAMILIES = ("qwen3_moe", "gemma2", "gemma3", "phi3")


def _loaded(config, tmp_path, seed=1):
    torch_model = _torch_model(config_to_hf(config), seed=seed)
    torch_model.save_pretrained(tmp_path / "hf")
    model, _ = from_pretrained(tmp_path / "hf", tokenizer=False)
    return torch_model, model


@pytest.mark.slow
def test_gemma2_soft_capping_matters_and_matches(tmp_path):
    """Caps small enough to bend the scores and logits of a tiny random model."""
    config = tiny_config("gemma2", vocab_size=128, attn_softcap=0.05, final_softcap=0.2)
    torch_model, model = _loaded(config, tmp_path)
    tokens = _tokens(128)
    ours = np.asarray(model(jnp.asarray(tokens)))
    np.testing.assert_allclose(ours, _torch_logits(torch_model, tokens), atol=TOL, rtol=0)
    assert np.abs(ours).max() <= 0.2
    # the same weights without either cap give other logits: both caps are applied
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        variant = tmp_path / key
        shutil.copytree(tmp_path / "hf", variant)
        (variant / "config.json").write_text(json.dumps({**hf_config, key: None}))
        other, _ = from_pretrained(variant, tokenizer=False)
        assert np.abs(np.asarray(other(jnp.asarray(tokens))) - ours).max() > 100 * TOL, key


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_weights_survive_transformers_round_trip(family, tmp_path):
    """transformers -> dpojax -> save -> transformers: every tensor unchanged (experts one tensor
    each, Phi-3's fused projections fused again)."""
    config = tiny_config(family, vocab_size=128)
    torch_model, model = _loaded(config, tmp_path, seed=7)
    save_pretrained(model, None, tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    original = dict(torch_model.state_dict())
    assert sorted(again.state_dict()) == sorted(original)
    for name, tensor in again.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), original[name].numpy(), err_msg=name)


@pytest.mark.slow
def test_qwen3_moe_router_logits_and_aux_loss_match_transformers(tmp_path):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    config = tiny_config("qwen3_moe", vocab_size=128)
    torch_model, model = _loaded(config, tmp_path)
    tokens = _tokens(128)
    mask = np.ones_like(tokens)
    mask[1, 17:] = 0  # padding in the second row
    with torch.no_grad():
        out = torch_model(
            torch.from_numpy(tokens),
            attention_mask=torch.from_numpy(mask),
            output_router_logits=True,
        )
    theirs = load_balancing_loss_func(
        out.router_logits, config.num_experts, config.num_experts_per_tok, torch.from_numpy(mask)
    )
    logits, router = model(jnp.asarray(tokens), return_router_logits=True)
    assert len(router) == len(out.router_logits) == 2  # layers 0 and 2; layer 1 is dense
    real = jnp.asarray(mask.reshape(-1))
    keep = mask.reshape(-1) == 1  # transformers' padded positions attend to nothing real
    for a, b in zip(router, out.router_logits, strict=True):
        np.testing.assert_allclose(np.asarray(a)[keep], b.numpy()[keep], atol=TOL, rtol=0)
    ours = load_balancing_loss(router, config.num_experts, config.num_experts_per_tok, real)
    np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-5)
    # padding's routing does not count
    rows = [r[: tokens.shape[1]] for r in router]
    first_row = load_balancing_loss(rows, config.num_experts, config.num_experts_per_tok)
    masked = jnp.asarray(np.r_[np.ones(tokens.shape[1]), np.zeros(tokens.shape[1])])
    np.testing.assert_allclose(
        float(load_balancing_loss(router, 4, 2, masked)), float(first_row), rtol=1e-6
    )


@pytest.mark.slow
def test_final_softcap_in_the_chunked_log_probs():
    """The step's log-probs (hidden states, chunked head) equal log-softmax of the capped
    logits, values and gradients."""
    model = init_model(tiny_config("gemma2", vocab_size=300, final_softcap=0.3), seed=0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 300, size=(2, 11)))
    pred = jnp.broadcast_to(jnp.maximum(jnp.arange(11) - 1, 0), (2, 11))
    hidden = model(tokens, return_hidden=True)
    head = model.lm_head_weight()
    naive = naive_token_logps(model(tokens), tokens, pred)
    for chunk in (None, 64):
        ours = token_logps(hidden, head, tokens, pred, vocab_chunk=chunk, cap=0.3)
        np.testing.assert_allclose(ours, naive, atol=1e-5)

    def full(h, w):
        logits = 0.3 * jnp.tanh(jnp.einsum("rld,vd->rlv", h, w) / 0.3)
        return naive_token_logps(logits, tokens, pred).sum()

    def chunked(h, w):
        return token_logps(h, w, tokens, pred, vocab_chunk=64, cap=0.3).sum()

    for a, b in zip(
        jax.grad(full, argnums=(0, 1))(hidden, head),
        jax.jit(jax.grad(chunked, argnums=(0, 1)))(hidden, head),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_moe_step_adds_the_auxiliary_loss():
    import optax

    from dpojax.train.state import StepConfig, create_train_state
    from dpojax.train.step import Stepper
    from tests.helpers.synthetic import copy_task, micro_batches, padded_batch

    batch = micro_batches([padded_batch(copy_task(4, seed=0), 12)])
    results = {}
    for coef in (0.0, 0.5):
        model = init_model(tiny_config("qwen3_moe", vocab_size=64), seed=0)  # the step donates
        cfg = StepConfig(loss=LossSettings(type="sigmoid", beta=0.1), router_aux_coef=coef)
        graphdef, state = create_train_state(model, optax.sgd(1.0), cfg)
        stepper = Stepper(graphdef, optax.sgd(1.0), None, cfg, False)
        new_state, metrics = stepper.train(state, batch)
        gate = new_state.params["layers"][0]["mlp"]["gate"]["kernel"][...]
        results[coef] = (metrics, np.asarray(gate))
    metrics, gate = results[0.5]
    assert "aux_loss" not in results[0.0][0]
    assert 1.0 <= float(metrics["aux_loss"]) <= 4.0  # E * sum f P: 1 when balanced, E at worst
    np.testing.assert_allclose(float(metrics["loss"]), float(results[0.0][0]["loss"]), rtol=1e-6)
    assert np.abs(gate - results[0.0][1]).max() > 1e-6  # the router's gradient includes it


@pytest.mark.slow
def test_moe_step_sharded_equals_single_device():
    """Experts replicated, their MLP dimension split over `tensor`, batches over data x fsdp."""
    import optax

    from dpojax.models.sharding import make_mesh
    from dpojax.train.state import StepConfig, create_train_state
    from dpojax.train.step import Stepper
    from tests.helpers.synthetic import copy_task, micro_batches, padded_batch

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    batch = micro_batches([padded_batch(copy_task(8, seed=0), 12)])
    results = []
    for mesh in (None, make_mesh(2, 2, 2)):
        model = init_model(tiny_config("qwen3_moe", vocab_size=64), seed=0)
        cfg = StepConfig(loss=LossSettings(type="sigmoid", beta=0.1), router_aux_coef=0.1)
        graphdef, state = create_train_state(model, optax.adam(1e-2), cfg)
        stepper = Stepper(graphdef, optax.adam(1e-2), None, cfg, False, mesh=mesh)
        state = stepper.shard_state(state)
        for _ in range(2):
            state, metrics = stepper.train(state, batch)
        results.append({k: float(v) for k, v in metrics.items()})
    for key in ("loss", "aux_loss", "grad_norm"):
        np.testing.assert_allclose(results[1][key], results[0][key], atol=1e-5, err_msg=key)
