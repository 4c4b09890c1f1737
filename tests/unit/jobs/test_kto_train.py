"""KTO and apo_zero_unpaired end to end on the tiny model: unpaired records (prompt, completion,
label) train, the loss falls, TRL's metric names are logged, and a resumed run continues exactly
where the first one stopped."""

from __future__ import annotations

import json
import math

import pytest

from dpojax import api


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from dpojax.models.tiny import make_tiny_checkpoint

    base = tmp_path_factory.mktemp("kto")
    model = make_tiny_checkpoint(base / "model", "llama", seed=0)
    rows = [
        {"prompt": f"q{i}?", "completion": f" {'yes' if i % 3 else 'no'} {i}", "label": i % 3 != 0}
        for i in range(16)
    ]
    (base / "unpaired.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return base, model


def _config(assets, loss_type="kto", **train):
    from tests.helpers.repo_files import load_file

    base, model = assets
    config = load_file("configs/tiny_test.py").get_config()
    config.model.path = str(model)
    config.data.train_path = str(base / "unpaired.jsonl")
    config.loss.type = loss_type
    config.loss.beta = 0.5
    config.optim.learning_rate = 1e-2
    config.train.batch_size = config.train.eval_batch_size = 8  # over the 8 test devices
    config.train.report_plots = False
    config.train.eval_every = 0
    config.mesh.data = -1
    config.export.enabled = False
    config.checkpoint.every_steps = 100
    for key, value in train.items():
        config.train[key] = value
    return config


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_unpaired_losses_train_and_fall(assets, tmp_path, loss_type):
    work = tmp_path / "run"
    config = _config(assets, loss_type, steps=8, report_plots=True)
    config.data.eval_path = config.data.train_path
    summary = api.train(config, work)
    assert summary["status"] == "completed" and summary["step"] == 8
    rows = list(api.metrics(work, "train"))
    assert [r["step"] for r in rows] == list(range(1, 9))
    for name in ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen"):
        assert all(math.isfinite(r[name]) for r in rows), name
    losses = [r["loss"] for r in rows]
    assert losses[-1] < losses[0] - 1e-3, losses
    (evaluated,) = api.metrics(work, "eval")
    assert evaluated["step"] == 8 and math.isfinite(evaluated["loss"])
    assert evaluated["count/chosen"] + evaluated["count/rejected"] == 16
    if loss_type == "apo_zero_unpaired":
        assert all(r["kl"] == 0 for r in rows)


@pytest.mark.slow
def test_a_resumed_kto_run_matches_an_uninterrupted_one(assets, tmp_path):
    whole = tmp_path / "whole"
    api.train(_config(assets, steps=6), whole)
    part = tmp_path / "part"

    class StopEarly:
        name = "stop_early"

        def on_step_end(self, step, metrics):
            return api.STOP if step == 2 else None  # read a step late: the run ends at 3

    first = api.train(_config(assets, steps=6), part, callbacks=[StopEarly()])
    assert first["step"] == 3
    api.train(_config(assets, steps=6), part)
    expected = {r["step"]: r["loss"] for r in api.metrics(whole, "train")}
    resumed = {r["step"]: r["loss"] for r in api.metrics(part, "train")}
    assert sorted(resumed) == list(range(1, 7))
    for step in range(4, 7):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5), step


@pytest.mark.slow
def test_kto_with_a_precomputed_reference_in_the_grouped_layout_matches_padded(assets, tmp_path):
    """reference.type=precomputed (cached own and KL completions' log-probs) and data.layout
    grouped give the first steps' losses of the padded layout's frozen reference (no shuffling,
    so both see the same examples in the same micro-batches)."""
    runs = {}
    for name, layout, reference in (
        ("want", "padded", "frozen"),
        ("got", "grouped", "precomputed"),
    ):
        config = _config(assets, steps=2)
        config.data.shuffle = False
        config.data.layout, config.reference.type = layout, reference
        api.train(config, tmp_path / name)
        runs[name] = {r["step"]: r for r in api.metrics(tmp_path / name, "train")}
    assert list(runs["got"]) == [1, 2]
    assert any((tmp_path / "got" / "reference_cache").glob("*.npz"))
    for step in (1, 2):
        for key in ("loss", "kl", "rewards/chosen", "logps/rejected"):
            want = runs["want"][step][key]
            assert runs["got"][step][key] == pytest.approx(want, rel=1e-4, abs=1e-5), (step, key)
