"""Bad checkpoints give errors that name the tensor, field or file; sharded checkpoints work."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from dpojax.models import ModelFileError, from_pretrained, save_pretrained
from dpojax.models.safetensors_io import load_tensors, save_tensors
from dpojax.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "qwen2", seed=0)


@pytest.fixture
def ckpt(tiny_dir, tmp_path):
    return shutil.copytree(tiny_dir, tmp_path / "copy")


def _edit_tensors(path, edit):
    tensors = load_tensors(path / "model.safetensors")
    edit(tensors)
    save_tensors(tensors, path / "model.safetensors")


def _edit_config(path, edit):
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_tensor_is_named(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ModelFileError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"
    ):
        from_pretrained(ckpt)


def test_wrong_shape_is_named_with_both_shapes(ckpt):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 48), np.float32)

    _edit_tensors(ckpt, edit)
    with pytest.raises(
        ModelFileError,
        match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(32, 48\), but "
        r"config\.json implies \(32, 64\)",
    ):
        from_pretrained(ckpt)


def test_unexpected_tensor_is_named(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(64)}))
    with pytest.raises(ModelFileError, match=r"not used .*o_proj\.bias.*attention_bias"):
        from_pretrained(ckpt)


def test_unknown_architecture_lists_supported(ckpt):
    _edit_config(ckpt, lambda c: c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with pytest.raises(
        ModelFileError,
        match=r"config\.json: unsupported architecture .*gpt2.*"
        r"LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM",
    ):
        from_pretrained(ckpt)


def test_missing_config_field_is_named(ckpt):
    _edit_config(ckpt, lambda c: c.pop("hidden_size"))
    with pytest.raises(ModelFileError, match=r"config\.json: required field 'hidden_size'"):
        from_pretrained(ckpt)


def test_invalid_config_json_names_the_line(ckpt):
    (ckpt / "config.json").write_text('{\n  "model_type": "qwen2",\n  oops\n}')
    with pytest.raises(ModelFileError, match=r"config\.json: invalid JSON at line 3"):
        from_pretrained(ckpt)


def test_unsupported_rope_scaling_is_named(ckpt):
    _edit_config(
        ckpt,
        lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
    )
    with pytest.raises(ModelFileError, match=r"rope scaling type 'yarn' is not supported"):
        from_pretrained(ckpt)


def test_truncated_safetensors_names_the_tensor(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(
        ModelFileError,
        match=r"model\.safetensors: tensor '.*' ends at byte .* "
        r"the file is truncated",
    ):
        from_pretrained(ckpt)


def test_truncated_header(ckpt):
    (ckpt / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:100])
    with pytest.raises(ModelFileError, match=r"header length .* exceeds the file size"):
        from_pretrained(ckpt)


def test_torch_bin_only_says_how_to_convert(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    with pytest.raises(ModelFileError, match=r"only PyTorch \.bin weights .*save_pretrained"):
        from_pretrained(ckpt)


def test_missing_tokenizer_files(ckpt):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / f).unlink()
    with pytest.raises(ModelFileError, match=r"no tokenizer files .* tokenizer=False"):
        from_pretrained(ckpt)
    model, tokenizer = from_pretrained(ckpt, tokenizer=False)
    assert tokenizer is None and model.config.model_type == "qwen2"


def test_not_a_directory(tmp_path):
    with pytest.raises(ModelFileError, match="not a directory"):
        from_pretrained(tmp_path / "nope")


@pytest.mark.slow
def test_sharded_checkpoint_round_trip_and_missing_shard(tiny_dir, tmp_path):
    model, tokenizer = from_pretrained(tiny_dir)
    out = save_pretrained(model, tokenizer, tmp_path / "sharded", max_shard_bytes=100_000)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    assert not (out / "model.safetensors").exists()
    again, _ = from_pretrained(out)
    tokens = jnp.asarray(np.arange(20)[None] % 7)
    np.testing.assert_array_equal(np.asarray(again(tokens)), np.asarray(model(tokens)))
    shards[1].unlink()
    with pytest.raises(ModelFileError, match=rf"is mapped to {shards[1].name}, which does not"):
        from_pretrained(out)


def test_float64_and_integer_weights_are_cast_with_a_warning(tmp_path, caplog):
    """Before: int32 and float64 tensors were cast to the parameter dtype without a word."""
    import logging

    import numpy as np

    from dpojax.models.hf import from_pretrained
    from dpojax.models.safetensors_io import load_tensors, save_tensors
    from dpojax.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", "llama", seed=0)
    tensors = dict(load_tensors(path / "model.safetensors"))
    names = sorted(tensors)
    tensors[names[0]] = tensors[names[0]].astype(np.float64)
    tensors[names[1]] = np.zeros(tensors[names[1]].shape, np.int32)
    save_tensors(tensors, path / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="dpojax.models.hf"):
        from_pretrained(path, tokenizer=False)
    text = caplog.text
    assert "stored as float64 and were cast" in text
    assert "stored as int32 and were cast" in text and "quantized" in text
