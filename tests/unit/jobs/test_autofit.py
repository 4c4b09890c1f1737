"""train.auto_fit: the usable memory (host figures, cgroup limits, the override), the ladder of
changes it tries, and — compiling the tiny model's step — the change it takes under a small
memory budget, the error when nothing it may change fits, and a resumed run's reuse of the
first run's decision."""

from __future__ import annotations

import json
from pathlib import Path

import ml_collections
import pytest

from dpojax.config import default_config
from dpojax.hardware import memory
from dpojax.jobs import autofit, plan
from dpojax.models.model_config import config_to_hf
from dpojax.models.tiny import tiny_config
from dpojax.train.fit import parse_auto_fit


def _meminfo(tmp_path: Path, available_kib: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kib} kB\n")
    return path


def test_host_usable_takes_the_smaller_of_available_memory_and_the_cgroup_headroom(tmp_path):
    meminfo = _meminfo(tmp_path, 10 * 2**20)  # 10 GiB
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")  # no limit
    found = memory.host_usable(0.5, meminfo=meminfo, cgroup=cgroup)
    assert found.bytes == 5 * 2**30 and "MemAvailable: 10.0 GiB" in found.source
    (cgroup / "memory.max").write_text(str(6 * 2**30))
    (cgroup / "memory.current").write_text(str(2 * 2**30))
    found = memory.host_usable(0.5, meminfo=meminfo, cgroup=cgroup)
    assert found.bytes == 2 * 2**30 and "cgroup limit: 4.0 GiB" in found.source


def test_host_usable_reads_a_cgroup_v1_limit_and_fails_clearly_without_figures(tmp_path):
    v1 = tmp_path / "cg" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(3 * 2**30))
    (v1 / "memory.usage_in_bytes").write_text(str(2**30))
    found = memory.host_usable(1.0, meminfo=tmp_path / "none", cgroup=tmp_path / "cg")
    assert found.bytes == 2 * 2**30
    with pytest.raises(RuntimeError, match="train.usable_memory_gib"):
        memory.host_usable(meminfo=tmp_path / "none", cgroup=tmp_path / "none")


def test_the_override_comes_first():
    found = memory.usable(object(), 1.5)
    assert found.bytes == 1.5 * 2**30 and found.source == "train.usable_memory_gib"


def _config(**train) -> ml_collections.ConfigDict:
    c = default_config()
    c.train.batch_size = 8
    c.train.update(train)
    return c


def _base(c) -> plan.Candidate:
    return plan.Candidate("the recipe", c.model.remat, (2, 1, 1), c.train.grad_accum, "float32")


def test_the_ladder_tries_micro_batches_then_remat_then_bf16_parameters():
    c = _config()
    labels = [x.label for x in autofit.ladder(c, _base(c), parse_auto_fit("on"))]
    assert labels == [
        "train.grad_accum=2",
        "train.grad_accum=4",  # 8 / 8 = 1 pair is not divisible over 2 data-parallel devices
        "train.grad_accum=4, model.remat=attention",
        "train.grad_accum=4, model.remat=dots_no_batch",
        "train.grad_accum=4, model.remat=dots",
        "train.grad_accum=4, model.remat=full",
        "train.grad_accum=4, model.remat=full, model.param_dtype=bfloat16",
    ]
    # "on" keeps what the config sets; a list may change it
    c = _config(grad_accum=2)
    c.model.remat = "dots"
    assert [x.label for x in autofit.ladder(c, _base(c), parse_auto_fit("on"))] == [
        "model.param_dtype=bfloat16"
    ]
    assert [x.label for x in autofit.ladder(c, _base(c), parse_auto_fit("grad_accum,remat"))] == [
        "train.grad_accum=4",
        "train.grad_accum=4, model.remat=full",
    ]
    assert autofit.ladder(c, _base(c), parse_auto_fit("off")) == []


# --- compiled (the tiny model's step on this host's CPU) ------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("autofit_model")
    (directory / "config.json").write_text(json.dumps(config_to_hf(tiny_config("llama"))))
    return directory


def _tiny(model_dir: Path, **train) -> ml_collections.ConfigDict:
    c = default_config()
    c.model.path = str(model_dir)
    c.data.max_length = 64
    c.train.batch_size = 32  # over the test session's 8 CPU devices (mesh.data=-1)
    c.train.update(train)
    return c


@pytest.mark.slow
def test_a_small_budget_takes_more_micro_batches_and_no_budget_is_a_clear_error(
    model_dir, tmp_path, caplog
):
    # what the recipe needs: a budget it fits
    _, fits = autofit.auto_fit(
        _tiny(model_dir, usable_memory_gib=64), tmp_path / "a", resuming=False
    )
    assert fits["changed"] == {} and fits["compiles"] == 1
    recipe = fits["needed_bytes"]
    # just under it: the first rung (2 micro-batches) fits, and the line says so
    budget = 0.97 * recipe / 2**30
    caplog.set_level("INFO")
    config, decision = autofit.auto_fit(
        _tiny(model_dir, usable_memory_gib=budget), tmp_path / "b", resuming=False
    )
    assert decision["changed"] == {"train.grad_accum": [1, 2]}
    assert config.train.grad_accum == 2 and config.train.batch_size == 32
    assert decision["needed_bytes"] < decision["recipe_needed_bytes"] == recipe
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("auto-fit:"))
    assert "train.grad_accum 1 -> 2, because the recipe's step needs" in line
    assert "(same global batch of 32 pairs)" in line
    assert json.loads((tmp_path / "b" / autofit.RECORD).read_text())["changed"] == {
        "train.grad_accum": [1, 2]
    }
    # a resumed run takes the record, without compiling
    again, resumed = autofit.auto_fit(
        _tiny(model_dir, usable_memory_gib=0.001), tmp_path / "b", resuming=True
    )
    assert again.train.grad_accum == 2 and resumed["resumed"]
    # grad_accum set by the config is kept under "on": the error names the change that fits
    with pytest.raises(autofit.DoesNotFit, match=r"smallest change that fits is") as error:
        autofit.auto_fit(
            _tiny(model_dir, usable_memory_gib=budget, grad_accum=1, auto_fit="param_dtype"),
            tmp_path / "c",
            resuming=False,
        )
    assert "train.grad_accum=2" in str(error.value)
    # nothing fits 1 MiB: the error lists what each try needed and what to change
    with pytest.raises(autofit.DoesNotFit, match=r"lower data.max_length or train.batch_size"):
        autofit.auto_fit(_tiny(model_dir, usable_memory_gib=2**-10), tmp_path / "d", resuming=False)
