"""The forward FLOPs each remat policy reruns in the backward pass, against the forward FLOP
model they are part of."""

import pytest

from dpojax.models.tiny import tiny_config
from dpojax.train.flops import forward_flops, recompute_flops


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_recompute_flops_by_policy(family):
    config = tiny_config(family)
    tokens, pairs = 1000.0, 30000.0
    layers = forward_flops(config, tokens, 0, 0)  # projections and MLP, no attention or head
    attention = forward_flops(config, 0, pairs, 0)
    assert layers > 0 and attention > 0
    full = recompute_flops(config, tokens, pairs, "full", "flash")
    assert full == pytest.approx(layers + attention)
    # the whole forward but the LM head: what full remat reruns
    assert full == pytest.approx(forward_flops(config, tokens, pairs, 0))
    assert recompute_flops(config, tokens, pairs, "attention", "flash") == pytest.approx(layers)
    assert recompute_flops(config, tokens, pairs, "attention", "reference") == pytest.approx(full)
    # cuDNN's statistics are residuals of JAX's own VJP: its forward reruns
    assert recompute_flops(config, tokens, pairs, "attention", "cudnn") == pytest.approx(full)
    assert recompute_flops(config, tokens, pairs, "dots_no_batch", "pallas") == pytest.approx(
        attention
    )
    assert recompute_flops(config, tokens, pairs, "dots", "flash") == 0
    assert recompute_flops(config, tokens, pairs, "none", "flash") == 0
