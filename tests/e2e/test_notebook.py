"""notebooks/quickstart.ipynb runs top to bottom in a fresh kernel, so it never rots.

The kernel runs on the default single CPU device: the 8 fake devices of tests/conftest.py are
for this test process only, so XLA_FLAGS is cleared for the kernel.
"""

import json
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
        timeout=300,  # per cell
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
    assert (run_dir / "export" / "config.json").is_file()
    assert list(run_dir.glob("round_*/train/metrics.jsonl"))
