"""model.quantization's cross-key checks: LoRA needed, an even nf4 block, no TR-DPO mixing of
quantized codes."""

import pytest

from dpojax.config import validate
from tests.unit.config.test_config import _valid


def _quantized(tmp_path, scheme="nf4"):
    config = _valid(tmp_path)
    config.model.quantization = scheme
    config.lora.rank = 8
    return config


def test_quantized_base_under_lora_is_valid(tmp_path):
    config = _quantized(tmp_path)
    assert validate(config, num_devices=8) == []
    config.model.quantization = "int8"
    config.model.quantization_block = 33  # odd blocks are fine for int8
    assert validate(config, num_devices=8) == []


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda c: setattr(c.lora, "rank", 0),
            "'model.quantization' is 'nf4' but LoRA is off (lora.rank is 0)",
        ),
        (lambda c: setattr(c.model, "quantization_block", 63), "must be even"),
        (lambda c: setattr(c.model, "quantization_block", 0), "'model.quantization_block' must"),
        (lambda c: setattr(c.model, "quantization", "int4"), "'model.quantization' must be one"),
        (
            lambda c: setattr(c.reference, "sync_every", 4),
            "would mix a frozen reference's quantized codes",
        ),
    ],
)
def test_quantization_problems(tmp_path, edit, message):
    config = _quantized(tmp_path)
    edit(config)
    errors = validate(config, num_devices=8)
    assert any(message in e for e in errors), errors
