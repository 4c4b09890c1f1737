"""Config validation: one line per problem, naming the key and the fix."""

import ml_collections
import pytest

from dpojax.config import check_keys, default_config, validate


def _valid(tmp_path):
    config = default_config()
    (tmp_path / "model").mkdir()
    (tmp_path / "train.jsonl").write_text("{}\n")
    config.model.path = str(tmp_path / "model")
    config.data.train_path = str(tmp_path / "train.jsonl")
    return config


def test_default_recipe_with_paths_is_valid(tmp_path):
    assert validate(_valid(tmp_path), num_devices=8) == []


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: setattr(c.loss, "type", "sigmoid,bco_pair"), "loss.type"),  # weights optional
        (
            lambda c: setattr(c.loss, "weights", (1.0,)) or setattr(c.loss, "type", "sigmoid,sft"),
            "'loss.weights' has 1 entries for 2 loss types",
        ),
        (lambda c: setattr(c.reference, "type", "lora_base"), "set lora.rank > 0"),
        (lambda c: setattr(c.train, "batch_size", 6), "not divisible by the 8 data-parallel"),
        (lambda c: setattr(c.mesh, "tensor", 3), "do not divide the 8 devices"),
        (lambda c: setattr(c.loss, "beta", 0.0), "'loss.beta' must be > 0"),
        (lambda c: setattr(c.model, "attention_block", 200), "'model.attention_block' must be 0"),
        (
            lambda c: setattr(c.train, "steps", 0) or setattr(c.train, "epochs", 0),
            "train.steps' > 0 or 'train.epochs' > 0",
        ),
        (lambda c: setattr(c.data, "eval_path", "/nonexistent.jsonl"), "does not exist"),
        (lambda c: setattr(c, "mode", "serve"), "config key 'mode' must be one of"),
        (
            lambda c: (
                setattr(c, "mode", "loop")
                or setattr(c.collect, "workflow", "tictactoe")
                or setattr(c.collect.tictactoe, "style", "hex")
            ),
            "config key 'collect.tictactoe.style' must be one of",
        ),
        (
            lambda c: setattr(c.data, "row_lengths", (48, 24)),
            "'data.row_lengths' must be increasing",
        ),
        (
            lambda c: setattr(c.data, "row_lengths", (0, 24)),
            "'data.row_lengths' must be increasing",
        ),
    ],
)
def test_inconsistent_options(tmp_path, edit, message):
    config = _valid(tmp_path)
    edit(config)
    errors = validate(config, num_devices=8)
    if message == "loss.type":
        assert errors == []
        return
    assert any(message in e for e in errors), errors
    assert all("\n" not in e for e in errors)


def test_unknown_keys_and_types_are_named(tmp_path):
    tree = _valid(tmp_path).to_dict()
    tree["train"]["stepz"] = 3
    tree["loss"]["beta"] = "high"
    errors = check_keys(ml_collections.ConfigDict(tree))
    assert "config key 'train.stepz' is unknown; did you mean 'train.steps'?" in errors
    assert any("'loss.beta' must be float, got str" in e for e in errors)


@pytest.mark.parametrize(
    "layout, row_lengths, expected",
    [
        ("prefix_shared", (), (16, 32, 64, 128)),  # powers of two up to 2 x max_length
        ("padded", (), (16, 32, 64)),
        ("prefix_shared", (24, 48), (24, 48, 128)),  # the longest row is always there
        ("prefix_shared", (24, 48, 128, 512), (24, 48, 128)),  # longer ones are never needed
    ],
)
def test_row_lengths_give_the_batch_buckets(layout, row_lengths, expected):
    from dpojax.jobs.build import buckets

    config = default_config()
    config.data.max_length, config.data.layout = 64, layout
    config.data.row_lengths = row_lengths
    assert buckets(config, data_parallel=4).lengths == expected
    assert buckets(config, data_parallel=4).row_multiple == 4


@pytest.mark.parametrize(
    "recipe",
    [
        "tictactoe",
        "tiny_test",
        "train_pairs",
        "customizer",
        "llama1b_tpu",
        "llama8b_tpu",
        "llama1b_h100",
        "llama8b_h100",
    ],
)
def test_shipped_recipes_have_only_known_keys(recipe):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "configs" / f"{recipe}.py"
    spec = importlib.util.spec_from_file_location(f"recipe_{recipe}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    assert check_keys(config) == []
    if recipe == "tictactoe":  # needs no paths: a fresh tiny model, collected data
        assert validate(config, num_devices=1) == []
