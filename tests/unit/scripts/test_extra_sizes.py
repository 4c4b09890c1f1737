"""scripts/extra_sizes.py: which distributions an extra adds, and their installed bytes."""

from __future__ import annotations

import importlib.util

import pytest

from tests.helpers.repo_files import load_file

extra_sizes = load_file("scripts/extra_sizes.py")


def test_requirements_follow_the_extras_asked_for_and_the_platform():
    requires = [
        "numpy>=1.26",
        'torch>=2.4; extra == "test"',
        'libtpu==0.0.42.*; extra == "tpu"',
        'pywin32; sys_platform == "nonesuch"',
        "jax[cuda12-local]>=0.10.2",
    ]
    assert extra_sizes.requirements(requires, set()) == [
        ("numpy", set()),
        ("jax", {"cuda12-local"}),
    ]
    assert [n for n, _ in extra_sizes.requirements(requires, {"tpu"})] == ["numpy", "libtpu", "jax"]


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="the tpu-plan extra is not installed"
)
def test_the_tpu_plan_extra_adds_libtpu_and_not_the_base_install():
    sizes = dict(extra_sizes.added_by("tpu-plan"))
    assert sizes["libtpu"] > 100e6  # XLA's TPU compiler: hundreds of MB
    assert not {"jax", "jaxlib", "numpy", "flax"} & set(sizes)
