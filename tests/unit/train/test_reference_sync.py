"""TR-DPO: the reference moves toward the policy every N steps (`reference.sync_every`,
`reference.sync_alpha`), for a frozen reference (its weights) and lora_base (a snapshot of the
adapters), and a checkpoint holds the moved reference so that a resume is exact."""

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpojax.models import add_lora, init_model
from dpojax.models.tiny import tiny_config
from dpojax.train.checkpoint import Checkpointer
from dpojax.train.loss_settings import LossSettings
from dpojax.train.optim import make_optimizer
from dpojax.train.reference_choice import (
    FrozenReference,
    LoraBaseReference,
    PrecomputedReference,
    Sync,
    reference_choice,
)
from dpojax.train.state import StepConfig, create_train_state, sync_reference
from tests.unit.train.test_step import _batch, _setup

CASES = ("frozen", "frozen_lora", "lora_base")


def _model(case: str, seed: int = 0):
    model = init_model(tiny_config("llama", vocab_size=64), seed=seed)
    return model if case == "frozen" else add_lora(model, rank=4, alpha=8.0, seed=1)


def _cfg(case: str, every: int, alpha: float) -> StepConfig:
    return StepConfig(
        loss=LossSettings(type="sigmoid", beta=0.1),
        reference=(LoraBaseReference if case == "lora_base" else FrozenReference)(
            sync=Sync(every, alpha) if every else None
        ),
    )


def _flat(tree) -> dict:
    if tree is None:
        return {}
    return {p: np.array(v.get_value()) for p, v in nnx.to_flat_state(tree)}


def _mixed(ref: dict, target: dict, alpha: float) -> dict:
    """The formula, in numpy float32: (1 - alpha) * ref + alpha * target."""
    return {
        p: (np.float32(1.0 - alpha) * r + np.float32(alpha) * target[p]).astype(r.dtype)
        for p, r in ref.items()
    }


def _assert_trees_close(got: dict, want: dict, rtol: float = 1e-6) -> None:
    assert got.keys() == want.keys() and got
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=rtol, atol=1e-7, err_msg=str(path))


@pytest.mark.parametrize("case", CASES)
def test_the_reference_mixes_at_every_nth_step_only(case):
    model = _model(case)
    tx, _ = make_optimizer(1e-3, schedule="constant", max_grad_norm=1.0, name="adamw")
    cfg = _cfg(case, every=3, alpha=0.25)
    _, state = create_train_state(model, tx, cfg)
    assert state.ref_moves
    assert (state.ref is None) == (case == "lora_base")
    assert (state.ref_adapters is None) == (case == "frozen")
    # a policy that moved: every trainable leaf shifted, so a mix is visible everywhere
    moved = jax.tree.map(lambda v: v + 0.5, state.params)
    state = state.replace(params=moved)
    ref0, adapters0 = _flat(state.ref), _flat(state.ref_adapters)
    for step in (1, 2, 4):  # not a multiple of 3: nothing moves
        out = sync_reference(state.replace(step=jnp.asarray(step)), cfg, case != "frozen")
        _assert_trees_close(_flat(out.ref), ref0, rtol=0) if ref0 else None
        _assert_trees_close(_flat(out.ref_adapters), adapters0, 0) if adapters0 else None
    out = sync_reference(state.replace(step=jnp.asarray(6)), cfg, case != "frozen")
    if case == "frozen":  # the weights mix with the policy's
        _assert_trees_close(_flat(out.ref), _mixed(ref0, _flat(moved), 0.25))
    if case == "frozen_lora":  # the base with the policy's base (equal here), adapters too
        _assert_trees_close(_flat(out.ref), _mixed(ref0, _flat(state.frozen), 0.25))
    if case != "frozen":
        _assert_trees_close(_flat(out.ref_adapters), _mixed(adapters0, _flat(moved), 0.25))
    # without syncing nothing of this is held
    _, plain = create_train_state(_model(case), tx, _cfg(case, every=0, alpha=0.25))
    assert not plain.ref_moves and plain.ref_adapters is None


def test_syncing_needs_a_reference_that_is_run():
    """A precomputed reference has no TR-DPO setting at all (its log-probs are fixed); the config's
    keys asking for one are refused by name, and a reference-free loss refuses a syncing one."""
    assert "sync" not in {f.name for f in dataclasses.fields(PrecomputedReference)}
    keys = SimpleNamespace(type="precomputed", path="", cache_dir="", sync_every=2, sync_alpha=0.6)
    with pytest.raises(ValueError, match="'reference.sync_every' \\(TR-DPO\\)"):
        reference_choice(keys)
    keys.sync_every, keys.cache_dir = 0, "/cache"
    assert reference_choice(keys) == PrecomputedReference()
    assert reference_choice(keys).cache_dir == "/cache"
    with pytest.raises(ValueError, match="TR-DPO"):
        StepConfig(loss=LossSettings(type="orpo"), reference=FrozenReference(sync=Sync(2)))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["frozen", "lora_base"])
def test_after_n_steps_the_reference_is_the_mix_and_the_step_runs_it(case):
    stepper, state = _setup(_model(case), cfg=_cfg(case, every=2, alpha=0.4))
    ref0 = _flat(state.ref if case == "frozen" else state.ref_adapters)
    state, _ = stepper.train(state, _batch(seed=0))
    # step 1: not a sync step
    _assert_trees_close(_flat(state.ref if case == "frozen" else state.ref_adapters), ref0, 0)
    state, _ = stepper.train(state, _batch(seed=1))
    policy = _flat(state.params)
    got = _flat(state.ref if case == "frozen" else state.ref_adapters)
    _assert_trees_close(got, _mixed(ref0, policy, 0.4))

    # alpha 1 copies the policy: the next step starts with reference == policy, so the reference
    # forward (which must use the synced weights / adapters) gives the policy's log-probs
    stepper, state = _setup(_model(case), cfg=_cfg(case, every=1, alpha=1.0))
    state, _ = stepper.train(state, _batch(seed=0))
    out = jax.device_get(stepper.evaluate(state, {k: v[0] for k, v in _batch(seed=2).items()}))
    np.testing.assert_allclose(out["ref_chosen_logps"], out["policy_chosen_logps"], atol=2e-5)
    np.testing.assert_allclose(out["ref_rejected_logps"], out["policy_rejected_logps"], atol=2e-5)
    assert np.abs(out["policy_chosen_logps"] - out["ref_chosen_logps"]).max() < 2e-5


@pytest.mark.slow
@pytest.mark.parametrize("case", ["frozen_lora", "lora_base"])
def test_the_moved_reference_is_checkpointed_and_a_resume_is_exact(tmp_path, case):
    cfg = _cfg(case, every=2, alpha=0.5)
    stepper, state = _setup(_model(case), cfg=cfg)
    for i in range(2):  # step 2 syncs
        state, _ = stepper.train(state, _batch(seed=i))
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(2, state, extra={"step": 2})
        saved = set(ckpt._manager.item_metadata(2)["state"].tree)
    assert saved == {"step", "params", "opt_state", "ref_adapters"} | (
        {"ref"} if case == "frozen_lora" else set()
    )
    expected = {name: _flat(getattr(state, name)) for name in ("ref", "ref_adapters")}
    # the straight run's next two steps (step 4 syncs again)
    straight = state
    for i in (2, 3):
        straight, _ = stepper.train(straight, _batch(seed=i))

    # a fresh run from the same model (its reference adapters the initial ones) resumed
    _, template = _setup(_model(case), cfg=cfg)
    key = ("layers", 0, "self_attn", "q_proj", "lora_b")
    assert not np.array_equal(_flat(template.ref_adapters)[key], expected["ref_adapters"][key])
    restored, _ = Checkpointer(tmp_path).restore(template)
    for name, leaves in expected.items():
        _assert_trees_close(_flat(getattr(restored, name)), leaves, rtol=0) if leaves else None
    for i in (2, 3):
        restored, _ = stepper.train(restored, _batch(seed=i))
    for name in ("params", "ref", "ref_adapters"):
        want = _flat(getattr(straight, name))
        if want:
            _assert_trees_close(_flat(getattr(restored, name)), want, rtol=0)


@pytest.mark.slow
def test_the_mix_is_trls_sync_ref_model():
    """TRL's own SyncRefModelCallback mixing, on torch copies of the same weights."""
    import torch
    from trl.trainer.callbacks import SyncRefModelCallback

    model = _model("frozen")
    tx, _ = make_optimizer(1e-3, schedule="constant", max_grad_norm=1.0, name="adamw")
    cfg = _cfg("frozen", every=1, alpha=0.6)
    _, state = create_train_state(model, tx, cfg)
    rng = np.random.default_rng(0)
    moved = jax.tree.map(lambda v: v + jnp.asarray(rng.normal(size=v.shape), v.dtype), state.params)
    state = state.replace(params=moved, step=jnp.asarray(1))
    ref0, policy = _flat(state.ref), _flat(moved)
    paths = sorted(ref0, key=str)
    torch_ref = torch.nn.ParameterList([torch.nn.Parameter(torch.tensor(ref0[p])) for p in paths])
    torch_policy = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.tensor(policy[p])) for p in paths]
    )
    SyncRefModelCallback._sync_target_model(torch_policy, torch_ref, 0.6)
    ours = _flat(sync_reference(state, cfg, False).ref)
    for path, theirs in zip(paths, torch_ref, strict=True):
        np.testing.assert_allclose(ours[path], theirs.detach().numpy(), rtol=1e-6, atol=1e-7)
