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
        (
            lambda c: (
                setattr(c.reference, "type", "precomputed") or setattr(c.reference, "sync_every", 4)
            ),
            "'reference.sync_every' (TR-DPO) moves the reference during training",
        ),
        (
            lambda c: setattr(c.loss, "type", "orpo") or setattr(c.reference, "sync_every", 4),
            "no reference to sync",
        ),
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
        (lambda c: setattr(c.data, "row_bits", -1), "'data.row_bits' must be >= 0, got -1"),
        (
            lambda c: setattr(c.data, "layout", "padded") or setattr(c.data, "group_size", 4),
            "'data.group_size' applies to data.layout='grouped' only",
        ),
        (
            lambda c: setattr(c.data, "layout", "grouped") or setattr(c.data, "group_size", -2),
            "'data.group_size' must be >= 0, got -2",
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


@pytest.mark.parametrize(
    "key, value, expected",
    [
        # Before: each passed validation; the run reversed or poisoned training and exited 0.
        ("optim.max_grad_norm", -1.0, ">= 0"),
        ("optim.min_lr_ratio", -3.0, "in [0, 1]"),
        ("optim.learning_rate", float("nan"), "a finite number"),
        ("optim.learning_rate", float("inf"), "a finite number"),
        ("lora.alpha", 0.0, "> 0"),
        ("train.vocab_chunk", -5, ">= 0"),  # before: a reshape TypeError, exit 1
        ("optim.b2", 1.0, "in [0, 1)"),
        ("loss.label_smoothing", 0.7, "in [0, 0.5]"),
        ("loop.replay_rounds", -2, ">= 0 or -1"),
        ("collect.top_p", 0.0, "in (0, 1]"),
        ("reference.sync_alpha", 0.0, "in (0, 1]"),
        # Before: accepted; Adam's update was 0/0 = NaN wherever a gradient was 0.
        ("optim.eps", 0.0, ">= 1.17549e-38, got 0.0 (Adam divides each update by sqrt(v) + eps"),
        ("optim.eps", 1e-45, ">= 1.17549e-38"),  # a denormal: flushed to 0 on accelerators
    ],
)
def test_numbers_out_of_range_are_refused_naming_the_range(tmp_path, key, value, expected):
    config = _valid(tmp_path)
    group, name = key.split(".")
    config[group][name] = value
    errors = validate(config, num_devices=8)
    assert any(f"config key '{key}' must be {expected}" in e for e in errors), errors


def test_non_finite_numbers_in_lists_are_refused(tmp_path):
    config = _valid(tmp_path)
    config.loss.type = "sigmoid,sft"
    config.loss.weights = (1.0, float("nan"))
    assert any("'loss.weights' must hold finite numbers" in e for e in validate(config))


def test_every_range_names_a_numeric_key_and_admits_its_default():
    from dpojax.config.ranges import RANGES
    from dpojax.config.tree import all_keys

    defaults = {k.name: k.default for k in all_keys()}
    for name, allowed in RANGES.items():
        assert isinstance(defaults[name], int | float), name
        assert defaults[name] in allowed, name


def test_a_key_at_the_wrong_level_gets_a_hint(tmp_path):
    """Before: an unknown top-level key (a group's key given without its group) had no hint."""
    tree = _valid(tmp_path).to_dict()
    tree["eps"] = 1e-6
    errors = check_keys(ml_collections.ConfigDict(tree))
    assert "config key 'eps' is unknown; did you mean 'optim.eps'?" in errors


@pytest.mark.parametrize("targets", [("q_projj",), ("q_proj", "k_proj", "q_projj")])
def test_an_unknown_lora_target_names_the_key_the_name_and_the_choices(targets):
    """Before: lora.targets=q_projj passed validation and failed at load with exit 3, naming
    the model's field `lora_targets`."""
    config = default_config()
    config.model.path, config.data.train_path = "/m", "/d.jsonl"
    config.lora.rank = 8
    config.lora.targets = targets
    (line,) = [e for e in validate(config) if "lora" in e]
    assert line.startswith("config key 'lora.targets': 'q_projj' is not a projection; choose ")
    assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in line
    config.lora.rank = 0  # LoRA off: the targets are not used
    assert not [e for e in validate(config) if "lora" in e]


def test_a_reference_path_with_a_reference_free_loss_is_refused(tmp_path):
    """loss.reference_free loads and runs no reference: a reference.path would be ignored."""
    config = _valid(tmp_path)
    config.loss.reference_free = True
    assert validate(config, num_devices=8) == []
    config.reference.path = str(tmp_path / "model")
    (line,) = [e for e in validate(config, num_devices=8) if "reference" in e]
    assert line.startswith("config key 'reference.path' is set but the loss is reference-free")


def test_unpaired_losses_alone_and_their_limits(tmp_path):
    """kto / apo_zero_unpaired / bco: valid alone, in every layout and with a precomputed
    reference; refused combined, with one example per micro-batch (kto), with the unpaired data
    format on a paired loss, and with what they do not support."""
    config = _valid(tmp_path)
    for loss_type in ("kto", "apo_zero_unpaired", "bco"):
        config.loss.type = loss_type
        config.data.format = "unpaired"
        assert validate(config, num_devices=8) == []
    config.loss.type = "kto,sigmoid"
    (line,) = [e for e in validate(config, num_devices=8) if "loss.type" in e]
    assert "'kto' is an unpaired loss and cannot be combined" in line
    config.loss.type = "kto"
    config.train.batch_size, config.train.grad_accum = 8, 8
    (line,) = [e for e in validate(config, num_devices=8) if "must be > 1" in e]
    assert line.startswith("config keys 'train.batch_size' / 'train.grad_accum'")
    config.train.grad_accum = 1
    for layout in ("padded", "packed", "prefix_shared", "grouped"):  # every layout, both refs
        for reference in ("frozen", "precomputed"):
            config.data.layout, config.reference.type = layout, reference
            assert validate(config, num_devices=8) == [], (layout, reference)
    config.reference.sync_every = 4  # TR-DPO (frozen) stays refused
    config.reference.type = "frozen"
    (line,) = [e for e in validate(config, num_devices=8) if "sync_every" in e]
    assert line.startswith("config key 'reference.sync_every' must be 0")
    config.reference.sync_every = 0
    config.data.layout = "padded"
    config.mode = "loop"  # collected TTC events labelled by data.unpaired.*
    assert not any("'mode'" in e for e in validate(config))
    config.mode = "submit"
    assert any(e.startswith("config key 'mode' cannot be 'submit'") for e in validate(config))
    config.mode = "train"
    config.loss.desirable_weight = -1.0
    assert any("loss.desirable_weight" in e for e in validate(config, num_devices=8))
    config.loss.desirable_weight = 1.0
    config.loss.type = "sigmoid"
    (line,) = validate(config, num_devices=8)
    assert line.startswith("config key 'data.format' is 'unpaired'")


def test_bco_takes_one_example_per_micro_batch_and_refuses_what_kto_refuses_and_weights(tmp_path):
    """bco needs no KL completions (a micro-batch of one example is fine), refuses the keys the
    unpaired losses do not support, combinations with other losses, and example weights (it
    has none)."""
    config = _valid(tmp_path)
    config.loss.type, config.data.format = "bco", "unpaired"
    config.train.batch_size, config.train.grad_accum = 8, 8
    assert validate(config, num_devices=1) == []
    config.train.grad_accum = 1
    config.loss.type = "bco,sigmoid"
    (line,) = [e for e in validate(config, num_devices=8) if "loss.type" in e]
    assert "'bco' is an unpaired loss and cannot be combined" in line
    config.loss.type = "bco"
    config.data.streaming, config.loss.use_weighting = True, True
    errors = validate(config, num_devices=8)
    assert any(e.startswith("config key 'data.streaming' must be False") for e in errors)
    assert any(e.startswith("config key 'loss.use_weighting' must be False") for e in errors)
    config.data.streaming, config.loss.use_weighting = False, False
    config.loss.undesirable_weight = 2.0
    (line,) = validate(config, num_devices=8)
    assert line.startswith("config key 'loss.undesirable_weight' must be 1 with loss.type 'bco'")
