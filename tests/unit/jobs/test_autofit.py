"""train.auto_fit: the usable memory (host figures, cgroup limits, the override), the ladder of
changes it tries, and — compiling the tiny model's step — the change it takes under a small
memory budget, the error when nothing it may change fits, and a resumed run's reuse of the
first run's decision."""

from __future__ import annotations

import json
from pathlib import Path

import ml_collections
import pytest

from dpojax.config import default_config, frozen
from dpojax.hardware import memory
from dpojax.jobs import plan
from dpojax.jobs.train import autofit
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
    return plan.Candidate("the recipe", c.model.remat, (2, 1, 1, 1), c.train.grad_accum, "float32")


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
        "train.grad_accum=4, model.param_dtype=bfloat16",
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


# --- the decision, with a model of the compiled memory (the real compile: tests/e2e) ---------

GiB = 2**30
REMAT_SAVES = {"none": 1.0, "attention": 0.8, "dots_no_batch": 0.6, "dots": 0.5, "full": 0.25}


def _fake_compile(calls: list):
    """plan.compile_candidate's figures from a formula: 1 GiB of state (half in bfloat16) plus
    8 GiB of activations split over the micro-batches and reduced by remat."""

    def compile_candidate(config, target, candidate, programs=None):
        calls.append(candidate.label)
        state = (0.5 if candidate.param_dtype == "bfloat16" else 1.0) * GiB
        activations = 8 * GiB / candidate.grad_accum * REMAT_SAVES[candidate.remat]
        total = state + activations
        memory = {"argument": state, "output": state, "alias": state, "temp": activations}
        return {"train": {"memory_bytes": {**memory, "peak": 0}, "total_bytes": total}}

    return compile_candidate


@pytest.fixture
def compiled(monkeypatch, tmp_path):
    calls: list[str] = []
    monkeypatch.setattr(plan, "compile_candidate", _fake_compile(calls))
    (tmp_path / "model").mkdir()
    return calls


def _fit(tmp_path, name: str, budget: float, *, resuming=False, **changes):
    c = default_config()
    c.model.path = str(tmp_path / "model")
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.train.batch_size = 32 * 8  # 8 data-parallel devices in the test session
    c.train.usable_memory_gib = budget
    for key, value in changes.items():
        group, name_ = key.split("__")
        c[group][name_] = value
    return autofit.auto_fit(frozen(c), tmp_path / name, resuming=resuming)


def test_the_recipe_that_fits_is_compiled_once_and_kept(compiled, tmp_path):
    config, decision = _fit(tmp_path, "a", 10)
    assert decision["changed"] == {} and compiled == ["the recipe"]
    assert config.train.grad_accum == 1
    assert autofit.describe(decision).startswith("auto-fit: the recipe fits (9.00 GiB per device")


def test_the_cheapest_change_that_fits_is_taken_and_reused_on_resume(compiled, tmp_path, caplog):
    caplog.set_level("INFO")
    config, decision = _fit(tmp_path, "b", 4)  # 9 GiB; 2 micro-batches: 5; 4: 3
    assert decision["changed"] == {"train.grad_accum": [1, 4]}
    assert compiled == ["the recipe", "train.grad_accum=2", "train.grad_accum=4"]
    assert config.train.grad_accum == 4 and config.train.batch_size == 256
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("auto-fit:"))
    assert line.startswith(
        "auto-fit: train.grad_accum 1 -> 4, because the recipe's step needs 9.00 GiB per device "
        "and 4.00 GiB usable, train.usable_memory_gib; with the change it needs 3.00 GiB "
        "(same global batch of 256 pairs)"
    )
    record = json.loads((tmp_path / "b" / autofit.RECORD).read_text())
    assert record["changed"] == {"train.grad_accum": [1, 4]} and record["line"] == line
    # a resumed run takes the first run's change, whatever the memory now, without compiling
    compiled.clear()
    again, resumed = _fit(tmp_path, "b", 100, resuming=True)
    assert again.train.grad_accum == 4 and resumed["resumed"] and compiled == []


def test_a_known_decision_is_taken_without_compiling_and_recorded(compiled, tmp_path):
    """A loop's later rounds train the same shapes: they take the first round's decision."""
    _, first = _fit(tmp_path, "k1", 4)
    compiled.clear()
    c = default_config()
    c.model.path = str(tmp_path / "model")
    config, decision = autofit.auto_fit(frozen(c), tmp_path / "k2", resuming=False, known=first)
    assert compiled == [] and config.train.grad_accum == 4 and decision["reused"]
    record = json.loads((tmp_path / "k2" / autofit.RECORD).read_text())
    assert record["changed"] == {"train.grad_accum": [1, 4]}  # what a resume of k2 takes
    c.train.auto_fit = "off"
    assert autofit.auto_fit(frozen(c), tmp_path / "k3", resuming=False, known=first) == (
        frozen(c),
        None,
    )


def test_remat_and_bf16_parameters_come_after_the_micro_batches(compiled, tmp_path):
    # 32 micro-batches of 8 pairs (one per device): 1.25 GiB; full remat on them: 1.0625
    config, decision = _fit(tmp_path, "c", 1.1)
    assert decision["changed"] == {"train.grad_accum": [1, 32], "model.remat": ["none", "full"]}
    _, decision = _fit(tmp_path, "d", 0.6)
    assert decision["changed"]["model.param_dtype"] == ["float32", "bfloat16"]


def test_a_change_the_config_does_not_allow_is_named_in_the_error(compiled, tmp_path):
    # everything set by the config: "on" keeps it all; 2x the micro-batches would fit
    with pytest.raises(autofit.DoesNotFit) as error:
        _fit(
            tmp_path,
            "e",
            2.2,
            train__grad_accum=2,
            model__remat="dots",
            model__param_dtype="bfloat16",
        )
    message = str(error.value)
    assert message.startswith(
        "the train step needs 2.50 GiB per device and 2.20 GiB is usable (train.usable_memory_gib)"
    )
    assert "the smallest change that fits is train.grad_accum=4 (1.50 GiB)" in message
    assert "which train.auto_fit=on may not make" in message
    assert "--config.train.auto_fit=grad_accum" in message
    assert not (tmp_path / "e" / autofit.RECORD).exists()


def test_a_step_needs_the_larger_of_the_peak_and_its_buffers():
    memory = {"argument": 10, "output": 8, "alias": 6, "temp": 20}
    assert autofit.step_bytes({"memory_bytes": {**memory, "peak": 12}}) == 32  # a CPU's peak
    assert autofit.step_bytes({"memory_bytes": {**memory, "peak": 40}}) == 40
    assert autofit.step_bytes({"fits": False, "needed_bytes": 50}) == 50
    assert autofit.step_bytes({"fits": False, "needed_bytes": None}) == float("inf")


def test_nothing_fits_lists_every_try_and_what_to_change(compiled, tmp_path):
    with pytest.raises(autofit.DoesNotFit, match="no change of train.grad_accum") as error:
        _fit(tmp_path, "f", 0.1)
    assert "the recipe: 9.00 GiB" in str(error.value)
    assert "lower data.max_length or train.batch_size, use more devices" in str(error.value)


def test_off_compiles_nothing(compiled, tmp_path):
    config, decision = _fit(tmp_path, "g", 0.1, train__auto_fit="off")
    assert decision is None and compiled == []


def test_a_recipe_the_plan_cannot_compile_starts_unchecked(monkeypatch, tmp_path, caplog):
    def fails(config, target, candidate, programs=None):
        raise KeyError("ref_chosen_logps")

    monkeypatch.setattr(plan, "compile_candidate", fails)
    (tmp_path / "model").mkdir()
    config, decision = _fit(tmp_path, "h", 0.1)
    assert decision["changed"] == {} and "not checked" in decision["skipped"]
    assert config.train.grad_accum == 1
