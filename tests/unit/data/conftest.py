"""Fixtures for the data tests: a real NeMo Agent Toolkit output with the pairs NAT builds from it,
and small file writers."""

from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SAMPLE = FIXTURES / "nat_workflow_output_sample.json"
EXPECTED = FIXTURES / "nat_workflow_output_sample.expected_pairs.json"


@pytest.fixture
def nat_sample() -> tuple[Path, Path]:
    """(NAT workflow output, NAT's expected pairs): `workflow_output.json` made with NAT 1.9's data
    models (tic-tac-toe turns with TTC steps `dpo_candidate_move`, plus unrelated LLM steps), and
    the pairs NAT 1.9's DPO trajectory builder makes from it for two option sets (see
    fixtures/README.md)."""
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
