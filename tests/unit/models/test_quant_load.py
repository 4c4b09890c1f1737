"""Quantizing while the safetensors are read (docs/quantization.md, "Loading"): the result equals
quantizing after a full load, bit for bit (looped and scanned layers, on one device and on a
sharded mesh, with adapters added after), a block that does not cut a projection is named, and a
pre-quantized checkpoint is refused naming the option."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from dpojax.errors import ConfigProblem
from dpojax.models import ModelFileError, add_lora, from_pretrained, save_pretrained
from dpojax.models.layers import QuantParam
from dpojax.models.safetensors_io import TensorReader
from dpojax.models.sharding import make_mesh, named_shardings
from dpojax.models.tiny import tiny_config
from dpojax.models.transformer import abstract_model, init_model, quantize_model

BLOCK = 16  # divides the tiny llama's hidden (64) and MLP (176) sizes


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """A tiny llama saved as a sharded bfloat16 checkpoint (several files and an index)."""
    path = tmp_path_factory.mktemp("qload") / "tiny"
    model = init_model(tiny_config("llama", vocab_size=64), seed=3)
    return save_pretrained(model, None, path, dtype="bfloat16", max_shard_bytes=20_000)


def _flat(model):
    return dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))


def _assert_bit_equal(got, want):
    assert got.config == want.config
    got_flat, want_flat = _flat(got), _flat(want)
    assert list(got_flat) == list(want_flat)
    for p, var in want_flat.items():
        a, b = np.asarray(got_flat[p].get_value()), np.asarray(var.get_value())
        assert type(got_flat[p]) is type(var), p
        assert (a.dtype, a.shape) == (b.dtype, b.shape), p
        assert a.tobytes() == b.tobytes(), p


@pytest.mark.parametrize(
    "scheme,scan",
    [
        ("int8", False),
        ("nf4", True),
        pytest.param("nf4", False, marks=pytest.mark.slow),
        pytest.param("int8", True, marks=pytest.mark.slow),
    ],
    ids=["int8-looped", "nf4-scanned", "nf4-looped", "int8-scanned"],
)
def test_quantized_while_read_equals_quantized_after_load(bf16_dir, scheme, scan):
    kw = dict(param_dtype="float32", scan_layers=scan, tokenizer=False)
    model, _ = from_pretrained(bf16_dir, quantization=scheme, quantization_block=BLOCK, **kw)
    full, _ = from_pretrained(bf16_dir, **kw)
    _assert_bit_equal(model, quantize_model(full, scheme, BLOCK))
    codes = [v for v in _flat(model).values() if isinstance(v, QuantParam)]
    assert len(codes) == 2 * 7 * (1 if scan else 2)  # codes and scales of 7 projections


def test_sharded_load_places_codes_by_their_axes(bf16_dir):
    mesh = make_mesh(1, 4, 2)
    model, _ = from_pretrained(
        bf16_dir, quantization="nf4", quantization_block=BLOCK, tokenizer=False, mesh=mesh
    )
    full, _ = from_pretrained(bf16_dir, tokenizer=False)
    _assert_bit_equal(model, quantize_model(full, "nf4", BLOCK))
    want = dict(nnx.to_flat_state(named_shardings(abstract_model(model.config), mesh)))
    for p, var in _flat(model).items():
        assert var.get_value().sharding.is_equivalent_to(want[p], len(var.shape)), p
    codes = model.layers[0].mlp.up_proj.codes.get_value()
    assert tuple(codes.sharding.spec) == ("fsdp", "tensor")


@pytest.mark.slow
def test_sharded_scanned_load(bf16_dir):
    mesh = make_mesh(2, 2, 2)
    kw = dict(tokenizer=False, scan_layers=True)
    model, _ = from_pretrained(
        bf16_dir, quantization="int8", quantization_block=BLOCK, mesh=mesh, **kw
    )
    full, _ = from_pretrained(bf16_dir, **kw)
    _assert_bit_equal(model, quantize_model(full, "int8", BLOCK))
    want = dict(nnx.to_flat_state(named_shardings(abstract_model(model.config), mesh)))
    for p, var in _flat(model).items():
        assert var.get_value().sharding.is_equivalent_to(want[p], len(var.shape)), p


@pytest.mark.slow
def test_adapters_added_after_a_quantized_load(bf16_dir):
    """build.load_policy's order (quantized load, then LoRA) gives the model the former order
    (float load, LoRA, then quantize_model) gave."""
    model, _ = from_pretrained(
        bf16_dir, quantization="nf4", quantization_block=BLOCK, tokenizer=False
    )
    full, _ = from_pretrained(bf16_dir, tokenizer=False)
    lora = dict(rank=4, alpha=8.0, targets=("q_proj", "down_proj"), seed=1)
    got = add_lora(model, **lora)
    _assert_bit_equal(got, quantize_model(add_lora(full, **lora), "nf4", BLOCK))
    tokens = jax.numpy.asarray(np.arange(24).reshape(2, 12) % 64)
    assert np.isfinite(np.asarray(got(tokens))).all()


def test_a_block_that_does_not_cut_a_projection_is_named(bf16_dir):
    with pytest.raises(ConfigProblem, match=r"layers/0/mlp/down_proj/kernel \(176, 64\)"):
        from_pretrained(bf16_dir, quantization="int8", quantization_block=32, tokenizer=False)


def test_a_pre_quantized_checkpoint_is_refused_naming_the_option(bf16_dir, tmp_path):
    import shutil

    path = shutil.copytree(bf16_dir, tmp_path / "bnb")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (path / "config.json").write_text(json.dumps(config))
    match = (
        r"bnb: config\.json has a quantization_config \(quant_method 'bitsandbytes'\): a "
        r"pre-quantized checkpoint is not read\. Set model\.path .*model\.quantization=nf4"
    )
    for quantization in ("none", "nf4"):
        with pytest.raises(ModelFileError, match=match):
            from_pretrained(path, quantization=quantization, quantization_block=BLOCK)


def test_a_transient_reader_keeps_no_file_mapped(bf16_dir):
    files = _files(bf16_dir)
    with TensorReader(files, transient=True) as reader:
        name = sorted(files)[0]
        assert reader.get(name).shape == reader.shape(name)
        assert reader._handles == {}


def _files(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return {n: path / f for n, f in index["weight_map"].items()}


@pytest.mark.parametrize("sharded", [False, True], ids=["one-device", "mesh"])
def test_large_plain_tensors_are_read_in_row_chunks(bf16_dir, monkeypatch, sharded):
    """The embeddings and the (untied) LM head, read in chunks of 5 rows, come out equal to a
    whole read (a chunk of the LM head kernel is columns)."""
    from dpojax.models import hf

    mesh = make_mesh(1, 4, 2) if sharded else None
    kw = dict(quantization="nf4", quantization_block=BLOCK, tokenizer=False, mesh=mesh)
    whole, _ = from_pretrained(bf16_dir, **kw)
    monkeypatch.setattr(hf, "ROW_CHUNK_BYTES", 5 * 64 * 4)  # 5 rows of 64 float32
    reads = []
    real = TensorReader.get_rows
    monkeypatch.setattr(TensorReader, "get_rows", lambda *a: reads.append(a[1:]) or real(*a))
    chunked, _ = from_pretrained(bf16_dir, **kw)
    assert ("model.embed_tokens.weight", 0, 5) in reads and ("lm_head.weight", 60, 64) in reads
    _assert_bit_equal(chunked, whole)
    for p, var in _flat(chunked).items():
        assert var.get_value().sharding == _flat(whole)[p].get_value().sharding, p


def test_a_pre_quantized_hub_model_is_refused_before_its_weights(monkeypatch, tmp_path):
    """By Hub id, config.json is fetched first: the refusal names the id and downloads no
    weights."""
    pytest.importorskip("huggingface_hub")
    import huggingface_hub

    from dpojax.models.hub import resolve_model_dir
    from tests.helpers.hub_server import HubServer

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    for name in ("HF_HUB_CACHE", "HF_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    config = {"model_type": "llama", "quantization_config": {"quant_method": "gptq", "bits": 4}}
    server = HubServer()
    server.add_repo(
        "model",
        "acme/gptq",
        {"config.json": json.dumps(config).encode(), "model.safetensors": b"x"},
    )
    with server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        with pytest.raises(ModelFileError, match=r"acme/gptq: .*'gptq'.*model\.quantization=nf4"):
            resolve_model_dir("acme/gptq")
    fetched = [path for _, path, _ in server.requests]
    assert any(p.endswith("/config.json") for p in fetched)
    assert not any("model.safetensors" in p for p in fetched)
