"""The attention kernel in a plan (`dpojax.jobs.plan.attention`): each implementation's core
compiled alone at a step's shapes, its figures scaled to the step and set against it."""

from __future__ import annotations

import jax
import pytest

from dpojax.jobs.plan.attention import core_figures, per_step, shares
from dpojax.models import attention
from dpojax.models.sharding import make_mesh
from dpojax.models.tiny import tiny_config


def _mesh():
    return make_mesh(1, 2, 1, devices=jax.devices()[:2])


@pytest.mark.slow
def test_reference_temporaries_grow_with_the_square_of_the_row_flash_nearly_flat():
    """One layer's forward + backward at 128 and 512 tokens on a 2-device fsdp mesh: the
    reference holds [B, H, T, T] scores (x16 for x4 the row, less the fixed part), flash only
    blocks of them."""
    model = tiny_config("llama")
    temps = {}
    for implementation in ("reference", "flash"):
        for length in (128, 512):
            core = core_figures(model, implementation, _mesh(), "cpu", rows=4, length=length)
            assert core["runs"] and list(core["kinds"]) == ["full"]
            for figures in core["kinds"]["full"].values():
                assert figures["fits"] and figures["compile_seconds"] > 0
                assert figures["hlo_bytes"] > 0 and figures["compiled_flops"] > 0
            temps[implementation, length] = core["kinds"]["full"]["forward_backward"]["temp_bytes"]
            if implementation == "flash":
                assert core["block"] == min(length, 128)  # flash's block, cut to the row
            else:
                assert core["block"] is None
    reference = temps["reference", 512] / temps["reference", 128]
    flash = temps["flash", 512] / temps["flash", 128]
    assert reference > 8 and flash < 4 and reference > 3 * flash, temps


def test_pallas_off_tpu_and_a_refused_implementation_are_reported_not_running(monkeypatch):
    model = tiny_config("llama")
    pallas = core_figures(model, "pallas", _mesh(), "cpu", rows=2, length=64)
    assert pallas == {
        "implementation": "pallas",
        "runs": False,
        "reason": "runs interpreted (emulated) on this target",
    }

    def refuse(*args, **kwargs):
        raise NotImplementedError("this kernel\nneeds a GPU")

    monkeypatch.setattr(attention, "attend", refuse)
    refused = core_figures(model, "flash", _mesh(), "cpu", rows=2, length=64)
    assert refused["runs"] is False and refused["reason"] == "this kernel needs a GPU"
    # the model's config refuses it (cuDNN takes bfloat16 or float16): a row, not a failed plan
    cudnn = core_figures(model, "cudnn", _mesh(), "cpu", rows=2, length=64)
    assert cudnn["runs"] is False and "float32" in cudnn["reason"], cudnn


def test_per_step_scales_by_layers_micro_batches_and_forward_passes():
    model = tiny_config(
        "llama",
        num_layers=3,
        sliding_window=16,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    )

    def figures(temp, flops, hlo):
        return {
            "fits": True,
            "temp_bytes": temp,
            "compiled_flops": flops,
            "compiled_bytes": None,
            "hlo_bytes": hlo,
        }

    core = {
        "runs": True,
        "kinds": {
            "full": {"forward": figures(1, 10, 100), "forward_backward": figures(5, 30, 300)},
            "sliding": {"forward": figures(2, 4, 40), "forward_backward": figures(3, 12, 120)},
        },
    }
    step = per_step(core, model, micro=2, forward_passes=2)
    # 2 micro-batches x (1 full layer x (30 + 2 x 10) + 2 sliding layers x (12 + 2 x 4))
    assert step["compiled_flops"] == 2 * (1 * 50 + 2 * 20)
    assert step["hlo_bytes"] == 2 * (1 * 500 + 2 * 200)
    assert step["compiled_bytes"] is None  # a figure one compile lacks
    assert step["temp_bytes"] == 5 and step["fits"]  # one layer's backward at a time
    assert step["calls"] == {"forward_backward": 6, "forward": 12}


def test_shares_of_the_step():
    step_attention = {"hlo_bytes": 25.0, "compiled_flops": 30.0}
    model = {"attention": 20.0, "step": 100.0}
    out = shares(step_attention, {"hlo_bytes": 100.0}, model)
    # the step's FLOPs with the attention as compiled: 100 - 20 + 30
    assert out == {"hlo_bytes": 0.25, "flops": pytest.approx(30 / 110), "model_flops": 0.2}
    gpu = shares({"hlo_bytes": 25.0, "compiled_flops": None}, {}, model)
    assert gpu == {"hlo_bytes": None, "flops": None, "model_flops": 0.2}
