"""cuDNN's fused attention (`model.attention = "cudnn"`): the arguments dpojax passes to
`jax.nn.dot_product_attention` put the layout rule of padded rows into cuDNN's masks (checked on
the CPU with JAX's own implementation of the same call, against the reference attention); which
rows and models may use it (decided from the config and the layout, never the values); and the
call compiled for an H100 without one (a cuDNN fused-attention custom call, forward and backward,
no loop)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpojax.data.layouts import Buckets, build_batch
from dpojax.models import attention
from dpojax.models.attention import cudnn
from dpojax.models.attention.cudnn import cudnn_attention, row_lengths
from dpojax.models.attention.reference import attention_mask, dot_product_attention
from dpojax.models.attention.rule import TokenIds
from dpojax.models.families import ModelConfigError
from dpojax.models.model_config import ModelConfig
from tests.unit.models.test_attention import _pairs, _qkv


@pytest.fixture(autouse=True)
def _exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def _ids(layout: str, seed: int = 0) -> TokenIds:
    """A batch of 5 pairs in 6 slots (so the last chosen and rejected rows are all padding)."""
    batch = build_batch(_pairs(np.random.default_rng(seed)), 6, layout, Buckets(lengths=(64,)))
    return TokenIds(*(jnp.asarray(batch[k]) for k in ("segment_ids", "parts", "positions")))


def _compare(ids, window, scale, heads, kv_heads):
    """(dpojax's reference, the cuDNN call run by XLA) on q, k, v: outputs at the real tokens
    and the gradients of a weighted sum of them."""
    b, t = ids.segment_ids.shape
    mask = attention_mask(
        b, t, positions=ids.positions, segment_ids=ids.segment_ids, parts=ids.parts,
        sliding_window=window,
    )  # fmt: skip
    q, k, v, w = _qkv(ids, heads=heads, kv_heads=kv_heads)
    real = (ids.segment_ids != 0)[:, :, None, None]
    w = jnp.where(real, w, 0.0)  # padding outputs are read by no real token
    impls = {
        "reference": lambda q, k, v: dot_product_attention(q, k, v, mask, scale, causal=True),
        "cudnn_as_xla": lambda q, k, v: cudnn_attention(
            q, k, v, ids, scale=scale, window=window, implementation="xla"
        ),
    }

    @jax.jit
    def run(q, k, v, w):
        out = {}
        for name, fn in impls.items():
            value = jnp.where(real, fn(q, k, v), 0.0)
            grads = jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) * w), argnums=(0, 1, 2))(q, k, v)
            out[name] = (value, *grads)
        return out

    out = run(q, k, v, w)
    return out["reference"], out["cudnn_as_xla"]


@pytest.mark.parametrize(
    "window, heads, kv_heads, scale",
    [
        (None, 4, 2, 0.25),  # GQA, head dim 16's own scale
        (5, 4, 2, 24.0**-0.5),  # a sliding layer; Gemma's query_pre_attn_scalar
        (5, 4, 4, 0.25),  # one query head per KV head
    ],
)
def test_cudnn_arguments_give_the_reference_on_padded_rows(window, heads, kv_heads, scale):
    """Float32, values and gradients within 1e-5: causal, per-row lengths (rows of padding only
    included), GQA, sliding windows and the model's scale as the cuDNN call gets them."""
    ids = _ids("padded")
    assert int(row_lengths(ids).min()) == 1  # the all-padding rows
    want, got = _compare(ids, window, scale, heads, kv_heads)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=name)


def test_cudnn_arguments_give_the_reference_on_plain_causal_rows():
    b, t = 2, 48
    ids = TokenIds.of(b, t)
    want, got = _compare(ids, 7, 0.25, 4, 2)
    for a, b_ in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b_, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_cudnn_masks_do_not_express_the_other_layouts():
    """Why those layouts never run cuDNN: the same call gives other numbers there."""
    for layout in ("packed", "prefix_shared", "grouped"):
        want, got = _compare(_ids(layout), None, 0.25, 4, 2)
        assert float(jnp.abs(got[0] - want[0]).max()) > 1e-2, layout


def _config(**kw) -> ModelConfig:
    return ModelConfig(**{"dtype": "bfloat16", "row_layout": "padded", **kw})


@pytest.fixture
def with_cudnn(monkeypatch):
    monkeypatch.setattr(cudnn, "available", lambda: True)


@pytest.mark.usefixtures("with_cudnn")
@pytest.mark.parametrize(
    "changes, plain, expected",
    [
        ({}, False, "cudnn"),
        ({"row_layout": "packed"}, False, "flash"),
        ({"row_layout": "prefix_shared"}, False, "flash"),
        ({"row_layout": "grouped"}, False, "flash"),
        ({"row_layout": ""}, False, "flash"),  # segment ids of an unknown layout
        ({"row_layout": "packed"}, True, "cudnn"),  # no segment ids: one causal sequence a row
        ({"dtype": "float32"}, False, "flash"),
        ({"head_dim": 256, "hidden_size": 1024}, False, "flash"),  # 256: Hopper only
        ({"head_dim": 12, "hidden_size": 48}, False, "flash"),
        ({"attn_softcap": 50.0}, False, "reference"),
        ({"sliding_window": 16}, False, "cudnn"),
    ],
)
def test_auto_on_gpu_runs_cudnn_only_where_it_is_exact(changes, plain, expected):
    config = _config(**changes)
    assert attention.choose(config, "gpu", 1024, plain=plain) == expected
    assert attention.choose(config, "tpu", 1024, plain=plain) in ("pallas", "reference")


def test_auto_on_gpu_without_cudnn_runs_flash(monkeypatch):
    monkeypatch.setattr(cudnn, "available", lambda: False)
    assert attention.choose(_config(), "gpu", 1024) == "flash"


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"row_layout": "packed"}, "not 'packed' rows"),
        ({"row_layout": "grouped"}, "use flash"),
        ({"dtype": "float32"}, "not float32"),
        ({"head_dim": 12, "hidden_size": 48}, "multiple of 8"),
        ({"attn_softcap": 50.0}, "soft-capping"),
    ],
)
def test_explicit_cudnn_where_it_is_not_exact_is_refused_with_the_config(changes, words):
    with pytest.raises(ModelConfigError, match="'cudnn'") as e:
        _config(attention="cudnn", **changes)
    assert words in str(e.value)


def test_explicit_cudnn_off_a_gpu_or_on_unknown_rows_is_an_error():
    config = _config(attention="cudnn")
    assert attention.choose(config, "gpu", 64) == "cudnn"
    for platform in ("cpu", "tpu"):
        with pytest.raises(ValueError, match=rf"model.attention='cudnn'.*not on {platform}"):
            attention.choose(config, platform, 64)
    unknown = config.replace(row_layout="")
    assert attention.choose(unknown, "gpu", 64, plain=True) == "cudnn"
    with pytest.raises(ValueError, match="unknown layout.*use flash"):
        attention.choose(unknown, "gpu", 64)
    assert attention.describe(config, "gpu") == "cudnn"
    assert attention.describe(_config(), "gpu").startswith(
        f"{'cudnn' if cudnn.available() else 'flash'} (auto on gpu)"
    )


def test_config_check_refuses_cudnn_for_other_layouts_and_float32():
    from dpojax.config import default_config, validate

    config = default_config()
    config.model.attention = "cudnn"
    config.data.layout = "prefix_shared"
    config.model.dtype = "float32"
    errors = "\n".join(validate(config))
    assert "config key 'model.attention' is 'cudnn'" in errors
    assert "not 'prefix_shared': use model.attention=flash" in errors
    assert "set model.dtype=bfloat16" in errors
    config.data.layout, config.model.dtype = "padded", "auto"
    assert not [e for e in validate(config) if "model.attention" in e]
    config.mode, config.plan.target = "plan", "tpu:v5e:2x2"
    assert "an NVIDIA GPU kernel, but plan.target is 'tpu:v5e:2x2'" in "\n".join(validate(config))


@pytest.mark.slow
@pytest.mark.parametrize("remat, forwards", [("none", 2), ("attention", 4)])
def test_cudnn_train_step_compiles_for_h100_with_fused_attention(remat, forwards):
    """A small model's loss and gradient with attention=cudnn on padded rows (a sliding layer
    too), compiled deviceless for 8 H100s with the rows sharded: every layer's attention is a
    cuDNN fused-attention custom call, forward and backward, and the program has no loop. Under
    remat=attention the forward runs again in the backward pass (what the plan's FLOPs count)."""
    import re

    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from dpojax.hardware import gpu_targets
    from dpojax.models.transformer import init_model

    if not gpu_targets.plugin_installed() or not cudnn.available():
        pytest.skip("needs the gpu-plan extra (JAX's CUDA plugin and cuDNN)")
    devices, _ = gpu_targets.devices("gpu:h100:8")
    mesh = Mesh(np.array(devices), ("data",))
    config = _config(
        attention="cudnn", target_platform="gpu", num_layers=2, sliding_window=16,
        layer_types=("sliding_attention", "full_attention"), remat=remat,
    )  # fmt: skip
    graphdef, params = nnx.split(init_model(config))

    def loss(params, tokens, positions, segment_ids, parts):
        model = nnx.merge(graphdef, params)
        hidden = model(
            tokens, positions=positions, segment_ids=segment_ids, parts=parts, return_hidden=True
        )
        return jnp.sum(hidden.astype(jnp.float32) ** 2)

    replicated = NamedSharding(mesh, PartitionSpec())
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), params
    )
    rows = jax.ShapeDtypeStruct(
        (8, 256), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec("data"))
    )
    compiled = jax.jit(jax.grad(loss)).lower(abstract, *[rows] * 4).compile()
    text = compiled.as_text()
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha[A-Za-z]*)"', text)
    assert calls.count("__cudnn$fmhaSoftmax") == forwards
    assert calls.count("__cudnn$fmhaSoftmaxBackward") == 2
    assert " while(" not in text


@pytest.mark.slow
def test_model_with_cudnn_gives_the_reference_logits(monkeypatch):
    """The model's wiring (lengths from the ids, each layer's window and the model's scale) on
    padded rows: auto on a GPU target picks cudnn, run here by XLA in float32 (cuDNN itself
    takes bf16 only, so its dtype check is lifted for the test); logits at the real tokens
    equal those of the reference attention."""
    from flax import nnx

    from dpojax.models.transformer import init_model

    monkeypatch.setattr(cudnn, "available", lambda: True)
    monkeypatch.setattr(ModelConfig, "cudnn_problem", lambda self, layout=None: "")
    ran = []

    def as_xla(*args, **kw):
        ran.append(kw["window"])
        return cudnn_attention(*args, **kw, implementation="xla")

    monkeypatch.setattr(cudnn, "cudnn_attention", as_xla)
    config = ModelConfig(
        num_layers=2, sliding_window=6, layer_types=("sliding_attention", "full_attention"),
        query_pre_attn_scalar=24.0, target_platform="gpu", row_layout="padded",
    )  # fmt: skip
    batch = build_batch(_pairs(np.random.default_rng(3)), 6, "padded", Buckets(lengths=(64,)))
    arrays = {k: jnp.asarray(batch[k]) for k in ("tokens", "positions", "segment_ids", "parts")}
    tokens = arrays.pop("tokens")
    call = nnx.jit(lambda model, tokens, arrays: model(tokens, **arrays))
    got = call(init_model(config), tokens, arrays)
    want = call(init_model(config.replace(attention="reference")), tokens, arrays)
    assert ran == [6, None]  # both layers ran the cuDNN call (traced once each)
    real = np.asarray(arrays["segment_ids"]) != 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5, rtol=0)
