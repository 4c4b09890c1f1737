"""notebooks/quickstart.ipynb runs top to bottom in a fresh kernel, so it never rots.

The kernel runs on the default single CPU device: the 8 fake devices of tests/conftest.py are
for this test process only, so XLA_FLAGS is cleared for the kernel.
"""

import json
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"


def _code_cells(nb):
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def test_committed_notebook_is_valid_and_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in _code_cells(nb):
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


@pytest.mark.newest  # the stack a new Colab runtime gets
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("QUICKSTART_WORKDIR", str(run_dir))
    cwd = tmp_path / "cwd"  # outside the repository: the notebook must find the recipe itself
    cwd.mkdir()

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        # per cell: a guard against a hung kernel, not a speed goal (the loop cell takes about
        # 220 s alone on a 2-core machine, longer beside another test under CI's 2 workers)
        timeout=900,
        kernel_name="python3",
        resources={"metadata": {"path": str(cwd)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell

    outputs = [out for cell in _code_cells(nb) for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    stdout = "".join(
        out.text for out in outputs if out.output_type == "stream" and out.name == "stdout"
    )
    assert "quickstart summary:" in stdout
    assert "trained  answers" in stdout
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) >= 2  # the per-round quality plot and the training-loss plot

    summary = json.loads((run_dir / "summary.json").read_text())
    for side in ("initial", "final"):
        for key in ("optimal_move_rate", "illegal_move_rate", "losses_vs_random"):
            assert key in summary[side]
    _check_gate_and_budget(summary)
    assert (run_dir / "export" / "config.json").is_file()
    assert list(run_dir.glob("round_*/train/metrics.jsonl"))


YOUR_MODEL = NOTEBOOK.parent / "your_model.ipynb"


def test_your_model_notebook_executes_on_a_tiny_local_model(tmp_path, monkeypatch):
    """notebooks/your_model.ipynb through the Python API, on a tiny local model and local pairs
    instead of its Hub defaults (no network): LoRA training, evaluation and export; then its 8B
    section (plan, then train with an nf4 base) on the same tiny model, judged against an L4's
    memory since the kernel's CPU has no limit, and trained although the runtime is a CPU."""
    from dpojax.data.pair_files import write_pairs
    from dpojax.data.pairs import PreferencePair
    from dpojax.models.tiny import make_tiny_checkpoint

    nb = nbformat.read(YOUR_MODEL, as_version=4)
    nbformat.validate(nb)
    assert all(c.outputs == [] and c.execution_count is None for c in _code_cells(nb))
    model = make_tiny_checkpoint(tmp_path / "model", "llama", seed=0)
    pairs = [
        PreferencePair(prompt=f"q{i}?", chosen=f" yes {i}", rejected=f" no {i}", metadata={})
        for i in range(24)
    ]
    data = tmp_path / "pairs"
    data.mkdir()
    write_pairs(pairs, data / "train.jsonl", format="trl")
    work = tmp_path / "run"
    big = tmp_path / "big"
    for name, value in {
        "DPOJAX_NOTEBOOK_MODEL": str(model),
        "DPOJAX_NOTEBOOK_DATA": str(data),  # a folder: datasets reads its splits
        "DPOJAX_NOTEBOOK_TRAIN_SPLIT": "train[:16]",
        "DPOJAX_NOTEBOOK_EVAL_SPLIT": "train[16:]",
        "DPOJAX_NOTEBOOK_WORKDIR": str(work),
        "DPOJAX_NOTEBOOK_STEPS": "4",
        "DPOJAX_NOTEBOOK_BIG_MODEL": str(model),
        "DPOJAX_NOTEBOOK_BIG_MODEL_CONFIG": str(model),
        "DPOJAX_NOTEBOOK_BIG_WORKDIR": str(big),
        "DPOJAX_NOTEBOOK_BIG_STEPS": "2",
        "DPOJAX_NOTEBOOK_BIG_BLOCK": "16",  # divides the tiny llama's hidden 64 and MLP 176
        # the pairs' rows (about 19 tokens) then take the longest bucket, the planned one: the
        # run executes the step auto-fit compiled instead of compiling its own (20 s here)
        "DPOJAX_NOTEBOOK_BIG_MAX_LENGTH": "32",
        "DPOJAX_NOTEBOOK_BIG_PLAN_CHIP": "l4",
        "DPOJAX_NOTEBOOK_BIG_TRAIN": "1",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "",
        "TOKENIZERS_PARALLELISM": "false",
    }.items():
        monkeypatch.setenv(name, value)
    client = nbclient.NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()

    stdout = "".join(
        out.text
        for cell in _code_cells(nb)
        for out in cell.outputs
        if out.output_type == "stream" and out.name == "stdout"
    )
    assert "completed at step 4" in stdout
    assert "step 2/4: eval loss" in stdout and "step 4/4: eval loss" in stdout
    assert json.loads((work / "config.json").read_text())["lora"]["rank"] == 16
    assert (work / "evaluate" / "metrics.json").is_file()
    assert (work / "export" / "config.json").is_file()
    assert (work / "export" / "adapter" / "adapter_config.json").is_file()

    plan_line = next(line for line in stdout.splitlines() if line.startswith("8B plan on 1 x "))
    assert re.search(r": fits: \d+\.\d\d GiB per device of 16\.76 GiB usable, step >= ", plan_line)
    assert json.loads((big / "plan.json").read_text())["recipe_fits"] is True
    saved = json.loads((big / "config.json").read_text())
    assert saved["model"]["quantization"] == "nf4" and saved["reference"]["type"] == "lora_base"
    assert saved["model"]["quantization_block"] == 16 and saved["lora"]["rank"] == 16
    records = map(json.loads, (big / "metrics.jsonl").read_text().splitlines())
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2]
    assert "8B run: completed at step 2" in stdout


def _check_gate_and_budget(summary):
    """The recipe's gate (the README's claim: >= 95% optimal moves, no illegal move, no game
    lost) is judged on every round's full evaluation, and the loop kept to the recipe's budget
    (the notebook's small rounds neither meet the gate nor reach the budget)."""
    import importlib.util

    from dpojax.collect.gate import Gate

    path = NOTEBOOK.parents[1] / "configs" / "tictactoe.py"
    spec = importlib.util.spec_from_file_location("tictactoe_recipe", path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    loop = recipe.get_config().loop
    gate = Gate(loop.gate)
    assert str(gate) == "optimal_move_rate>=0.95,illegal_move_rate<=0,losses_total<=0"
    assert (loop.gate_rounds, loop.max_wall_seconds) == (1, 540.0)
    assert summary["gate"]["conditions"] == str(gate)
    rounds = summary["rounds"][1:]
    assert rounds and [r["gate_met"] for r in rounds] == [gate.met(r) for r in rounds]
    assert summary["gate"]["met_rounds"] == [r["round"] for r in rounds if r["gate_met"]]
    assert summary["stop_reason"] in (None, "gate_rounds", "max_wall_seconds")
    last = rounds[-1]
    assert last["elapsed_seconds"] <= summary["wall_seconds"]
    # no round started once the budget could not hold another one like the one before it
    for before, record in zip(rounds, rounds[1:], strict=False):
        started = record["elapsed_seconds"] - record["seconds"]
        assert started + before["seconds"] <= loop.max_wall_seconds + 1.0  # the check's moment
    assert sum(last["phase_seconds"].values()) <= last["seconds"]
