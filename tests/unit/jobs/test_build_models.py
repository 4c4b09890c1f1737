"""jobs.build's model loading: the policy (LoRA, remat) and a separate reference
(`reference.path`) read with the same model settings, the reference without adapters or remat."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from dpojax.config import default_config
from dpojax.jobs import build
from dpojax.models import LoRAParam
from dpojax.models.hf import from_pretrained
from dpojax.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("build_models")
    return tuple(make_tiny_checkpoint(base / f"m{s}", "llama", seed=s) for s in (0, 1))


def _params(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _adapters(model) -> list:
    return jax.tree.leaves(nnx.state(model, LoRAParam))


def test_policy_and_separate_reference_share_the_model_settings(checkpoints):
    policy_path, reference_path = checkpoints
    config = default_config()
    config.model.path, config.reference.path = str(policy_path), str(reference_path)
    config.model.remat, config.model.attention, config.data.layout = "full", "flash", "packed"
    config.lora.rank = 4
    policy, tokenizer = build.load_policy(config, None)
    reference = build.load_reference(config, None)
    assert tokenizer is not None
    # the policy: LoRA adapters and remat; the reference: neither, the same other settings
    # (model.scan_layers "auto" resolves per model: scanned with remat, unrolled without)
    assert policy.config.remat == "full" and reference.config.remat == "none"
    for key in ("attention", "row_layout", "dtype", "param_dtype"):
        assert getattr(reference.config, key) == getattr(policy.config, key), key
    assert reference.config.attention == "flash" and reference.config.row_layout == "packed"
    assert _adapters(policy) and not _adapters(reference)
    # the reference holds reference.path's weights, as read (unrolled: no remat, no scan)
    want, _ = from_pretrained(str(reference_path), "float32", tokenizer=False, scan_layers=False)
    for got, expected in zip(_params(reference), _params(want), strict=True):
        np.testing.assert_array_equal(got, expected)
    config.reference.path = ""
    assert build.load_reference(config, None) is None  # the initial policy is the reference
