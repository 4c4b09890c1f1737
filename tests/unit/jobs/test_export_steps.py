"""Under LoRA: checkpoints hold the adapters and their optimizer state only (small saves), any
kept checkpoint exports (`export.step`), and `export.merged=False` exports the adapter alone in
PEFT's format, the same tensors as the merged export's `adapter/`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dpojax.config import frozen, validate
from dpojax.data.pair_files import write_pairs
from dpojax.data.pairs import PreferencePair
from dpojax.jobs import outputs_line
from dpojax.jobs.train import export, train
from dpojax.models.safetensors_io import load_tensors
from dpojax.models.tiny import make_tiny_checkpoint
from dpojax.train.checkpoint import CheckpointError
from tests.helpers.repo_files import load_file

pytestmark = pytest.mark.slow  # one 4-step LoRA run (~40 s)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step LoRA run checkpointed at steps 2 and 4, exported merged (the default)."""
    base = tmp_path_factory.mktemp("export_steps")
    model = make_tiny_checkpoint(base / "model", "llama", seed=0)
    pairs = [PreferencePair(f"q{i}?", f" yes {i}", f" no {i}", {}) for i in range(16)]
    write_pairs(pairs, base / "train.jsonl", format="trl")
    config = load_file("configs/tiny_test.py").get_config()
    config.model.path = str(model)
    config.data.train_path = str(base / "train.jsonl")
    config.train.batch_size = 8
    config.train.steps = 4
    config.train.report_plots = False
    config.mesh.data = -1
    config.lora.rank = 4
    config.reference.type = "lora_base"
    config.checkpoint.every_steps = 2
    config.checkpoint.max_to_keep = 5
    work = base / "run"
    train(frozen(config), work)
    return config, work, model


def _exporting(config, **keys):
    config = config.copy_and_resolve_references()
    config.mode = "export"
    for key, value in keys.items():
        config.export[key] = value
    return config


def test_a_lora_checkpoint_holds_only_the_adapters_and_their_optimizer_state(run):
    _, work, _ = run
    metadata = json.loads((work / "checkpoints" / "4" / "state" / "_METADATA").read_text())
    names = list(metadata["tree_metadata"])
    params = [n for n in names if n.startswith("('params'")]
    moments = [n for n in names if n.startswith("('opt_state'") and "'mu'" in n]
    adapter = load_tensors(work / "export" / "adapter" / "adapter_model.safetensors")
    # one saved array per adapter factor, and Adam's moments of those only
    assert len(params) == len(moments) == len(adapter)
    assert all(n.endswith(("'lora_a')", "'lora_b')")) for n in params + moments), params
    assert not [n for n in names if "embed_tokens" in n or "norm" in n or "'kernel'" in n]


def test_the_adapter_alone_is_the_merged_export_s_adapter(run):
    config, work, _ = run
    target = export(frozen(_exporting(config, merged=False, step=4)), work)
    assert target == work / "export_step_4"
    files = {p.name for p in target.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= files
    assert "tokenizer_config.json" in files
    assert not any(name.startswith("model") for name in files)  # no merged weights
    alone = load_tensors(target / "adapter_model.safetensors")
    merged_export = load_tensors(work / "export" / "adapter" / "adapter_model.safetensors")
    assert alone.keys() == merged_export.keys()
    for name in alone:
        np.testing.assert_array_equal(alone[name], merged_export[name], err_msg=name)
    adapter_config = json.loads((target / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == config.model.path
    assert "AutoPeftModelForCausalLM" in (target / "README.md").read_text()
    assert outputs_line("export", target, work) == f"export done; wrote {target}"


def test_an_earlier_kept_step_exports_and_a_dropped_one_is_named(run):
    config, work, _ = run
    earlier = export(frozen(_exporting(config, merged=False, step=2)), work)
    assert earlier == work / "export_step_2"
    a = load_tensors(earlier / "adapter_model.safetensors")
    b = load_tensors(work / "export" / "adapter" / "adapter_model.safetensors")
    assert any(not np.array_equal(a[name], b[name]) for name in a)  # step 2 is not step 4
    assert json.loads((work / "export" / "config.json").read_text())  # the run's export stays
    with pytest.raises(CheckpointError, match=r"no checkpoint step 3 .*available: \[2, 4\]"):
        export(frozen(_exporting(config, step=3)), work)


def test_export_settings_that_cannot_work_are_refused(run):
    config, _, _ = run
    full = _exporting(config, merged=False)
    full.lora.rank = 0
    full.reference.type = "frozen"
    assert any("'export.merged' is False but LoRA is off" in e for e in validate(full))
    training = config.copy_and_resolve_references()
    training.export.step = 2
    assert any(
        "'export.step' (2) picks the checkpoint of mode 'export'" in e for e in validate(training)
    )
    looping = config.copy_and_resolve_references()
    looping.mode = "loop"
    looping.export.merged = False
    assert any("mode 'loop' plays each round" in e for e in validate(looping))
