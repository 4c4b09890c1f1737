"""KTO, apo_zero_unpaired and BCO end to end on the tiny model: unpaired records (prompt,
completion, label) train, the loss falls, TRL's metric names are logged, and a resumed run
continues exactly where the first one stopped (BCO: with its running reward moments)."""

from __future__ import annotations

import json
import math

import numpy as np
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


def _final_arrays(work):
    """{path: array} of the run's last checkpoint (its saved state, restored without a
    template)."""
    import orbax.checkpoint as ocp

    from dpojax.train.checkpoint import STATE_ITEM

    folder = work / "checkpoints"
    step = max(int(p.name) for p in folder.iterdir() if p.name.isdigit())
    tree = ocp.StandardCheckpointer().restore((folder / str(step) / STATE_ITEM).absolute())
    return {"/".join(map(str, k)): np.asarray(v) for k, v in _flatten(tree)}


def _flatten(tree, prefix=()):
    if not isinstance(tree, dict):
        return [(prefix, tree)]
    return [kv for k, v in tree.items() for kv in _flatten(v, (*prefix, k))]


def _running_means(rows):
    """δ after each step recomputed from the logged rewards: the mean of every reward so far
    (TRL's RunningMoments from mean 0, count 1e-24; one micro-batch a step)."""
    total, count, out = 0.0, 1e-24, []
    for r in rows:
        for side in ("chosen", "rejected"):
            total += r[f"rewards/{side}"] * r[f"count/{side}"]
            count += r[f"count/{side}"]
        out.append(total / count)
    return out


@pytest.mark.slow
def test_bco_trains_its_delta_is_the_running_mean_and_it_resumes_exactly(assets, tmp_path):
    """bco: the loss falls; the logged δ is the running mean of all rewards logged so far; the
    final evaluation uses the last δ without updating it; a run stopped at step 3 and resumed
    logs the same losses and δ and ends with the same weights and moments as an uninterrupted
    one (moments saved and restored)."""

    def config():
        c = _config(assets, "bco", steps=6)
        c.data.eval_path = c.data.train_path
        return c

    whole = tmp_path / "whole"
    assert api.train(config(), whole)["step"] == 6
    rows = list(api.metrics(whole, "train"))
    losses = [r["loss"] for r in rows]
    assert losses[-1] < losses[0] - 1e-3, losses
    assert "kl" not in rows[0] and rows[0]["delta"] == 0.0  # policy == reference at step 1
    deltas = [r["delta"] for r in rows]
    assert deltas == pytest.approx(_running_means(rows), rel=1e-4, abs=1e-6)
    (evaluated,) = api.metrics(whole, "eval")
    assert evaluated["delta"] == pytest.approx(deltas[-1], rel=1e-6)
    final = _final_arrays(whole)
    assert final["moments/mean"] == pytest.approx(deltas[-1], rel=1e-6)
    assert final["moments/count"] == pytest.approx(6 * 8)

    class StopEarly:
        name = "stop_early"

        def on_step_end(self, step, metrics):
            return api.STOP if step == 2 else None  # read a step late: the run ends at 3

    part = tmp_path / "part"
    assert api.train(config(), part, callbacks=[StopEarly()])["step"] == 3
    api.train(config(), part)
    resumed = {r["step"]: r for r in api.metrics(part, "train")}
    assert sorted(resumed) == list(range(1, 7))
    for row in rows[3:]:
        for name in ("loss", "delta"):
            assert resumed[row["step"]][name] == pytest.approx(row[name], rel=1e-5), name
    again = _final_arrays(part)
    assert sorted(again) == sorted(final)
    for name, value in final.items():
        np.testing.assert_allclose(again[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
