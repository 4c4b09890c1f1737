"""Fixtures for the data tests: the shared sample data beside the repo, and small file writers."""

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
SAMPLE = SHARED / "data" / "nat_workflow_output_sample.json"
EXPECTED = SHARED / "data" / "nat_workflow_output_sample.expected_pairs.json"


@pytest.fixture
def nat_sample() -> tuple[Path, Path]:
    """(NAT workflow output, NAT's expected pairs); skipped when ../shared is not checked out."""
    if not (SAMPLE.is_file() and EXPECTED.is_file()):
        pytest.skip(
            f"shared sample data not found at {SHARED / 'data'} (clone shared/ beside the repo)"
        )
    return SAMPLE, EXPECTED


@pytest.fixture
def write_lines(tmp_path):
    """Write raw lines (str or bytes) to a file joined by newlines; returns the path."""

    def write(lines, name="data.jsonl"):
        path = tmp_path / name
        raw = [line.encode() if isinstance(line, str) else line for line in lines]
        path.write_bytes(b"\n".join(raw) + b"\n")
        return path

    return write
