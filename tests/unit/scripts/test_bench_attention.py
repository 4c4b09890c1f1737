"""scripts/bench_attention.py: the attention micro-benchmark measures what it says (XLA's
temporaries of the reference grow with the square of the row, flash's stay linear)."""

from __future__ import annotations

import pytest

from tests.helpers.repo_files import load_file


@pytest.mark.slow
def test_reference_temporaries_grow_quadratically_and_flash_linearly():
    bench = load_file("scripts/bench_attention.py")
    r = {
        (impl, t): bench.measure(impl, batch=1, length=t, heads=2, dim=16, repeats=1)
        for impl in ("reference", "flash")
        for t in (256, 512)
    }
    assert set(r[("flash", 256)]) >= {"implementation", "length", "ms_per_call", "temp_gb"}
    assert all(x["ms_per_call"] > 0 for x in r.values())
    ref_growth = r[("reference", 512)]["temp_gb"] / r[("reference", 256)]["temp_gb"]
    flash_growth = r[("flash", 512)]["temp_gb"] / r[("flash", 256)]["temp_gb"]
    assert ref_growth > 3.0, ref_growth  # [T, T] blocks: 4x per doubling
    assert flash_growth < 2.5, flash_growth
    assert r[("flash", 512)]["temp_gb"] < r[("reference", 512)]["temp_gb"]
