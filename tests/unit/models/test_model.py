"""The decoder itself: the per-token attention rule, remat, dtypes, hidden-state output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpojax.models import ModelConfig, ModelConfigError, abstract_model, attention, init_model
from dpojax.models.attention.reference import attention_mask, causal_block, dot_product_attention
from dpojax.models.tiny import tiny_config


@pytest.fixture(scope="module")
def model():
    return init_model(tiny_config("qwen2", vocab_size=96), seed=0)


def _seq(n, seed):
    return np.random.default_rng(seed).integers(0, 96, size=n)


def test_hidden_states_times_head_equal_logits(model):
    tokens = jnp.asarray(_seq(10, 0))[None]
    hidden = model(tokens, return_hidden=True)
    assert hidden.shape == (1, 10, model.config.hidden_size)
    np.testing.assert_allclose(model.logits(hidden), model(tokens), atol=1e-6)


@pytest.mark.slow
def test_packed_row_equals_separate_sequences(model):
    a, b = _seq(7, 1), _seq(5, 2)
    row = np.concatenate([a, b, [0, 0]])[None]
    segment_ids = np.array([[1] * 7 + [2] * 5 + [0, 0]])
    positions = np.array([list(range(7)) + list(range(5)) + [0, 0]])
    packed = np.asarray(
        model(
            jnp.asarray(row), positions=jnp.asarray(positions), segment_ids=jnp.asarray(segment_ids)
        )
    )
    alone_a = np.asarray(model(jnp.asarray(a)[None]))
    alone_b = np.asarray(model(jnp.asarray(b)[None]))
    np.testing.assert_allclose(packed[0, :7], alone_a[0], atol=1e-5)
    np.testing.assert_allclose(packed[0, 7:12], alone_b[0], atol=1e-5)
    assert np.isfinite(packed).all()  # padding rows attend to themselves, never to nothing


@pytest.mark.slow
@pytest.mark.parametrize(
    "lengths",
    [(6, 4, 3), (160, 90, 50)],  # 300 tokens: causal attention in 5 query blocks of 64
)
def test_prefix_shared_row_equals_two_full_sequences(model, lengths):
    """prompt once, then chosen (part 1), then rejected (part 2) continuing from the prompt."""
    n_p, n_c, n_r = lengths
    prompt, chosen, rejected = _seq(n_p, 3), _seq(n_c, 4), _seq(n_r, 5)
    row = np.concatenate([prompt, chosen, rejected])[None]
    parts = np.array([[0] * n_p + [1] * n_c + [2] * n_r])
    positions = np.array([list(range(n_p + n_c)) + list(range(n_p, n_p + n_r))])
    shared = np.asarray(
        model(
            jnp.asarray(row),
            positions=jnp.asarray(positions),
            segment_ids=jnp.ones_like(jnp.asarray(row)),
            parts=jnp.asarray(parts),
        )
    )
    full_c = np.asarray(model(jnp.asarray(np.concatenate([prompt, chosen]))[None]))
    full_r = np.asarray(model(jnp.asarray(np.concatenate([prompt, rejected]))[None]))
    np.testing.assert_allclose(shared[0, : n_p + n_c], full_c[0], atol=1e-5)
    np.testing.assert_allclose(shared[0, n_p + n_c :], full_r[0, n_p:], atol=1e-5)


def test_causal_blocks():
    lengths = (48, 127, 128, 192, 255, 256, 300, 384, 512, 1024, 1100, 2048, 8192)
    assert [causal_block(n) for n in lengths] == [
        48, 127, 64, 64, 64, 128, 128, 128, 128, 128, 256, 256, 1024
    ]  # fmt: skip
    assert [causal_block(n, min_block=64) for n in (300, 384, 1024)] == [64, 64, 128]
    assert all(-(-n // causal_block(n)) <= 8 for n in lengths)


@pytest.mark.slow
@pytest.mark.parametrize("length, heads, kv_heads", [(300, 4, 2), (384, 2, 2)])
def test_causal_blocked_attention_equals_full(length, heads, kv_heads):
    """Skipping the keys past each query block changes nothing: values and gradients, with the
    segments and parts of a packed prefix-shared row."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, length, heads, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, length, kv_heads, 16)), jnp.float32) for _ in "kv")
    cut = [0, 90, 150, 200, length]  # segment 1: prompt 0-89, parts 1 and 2; segment 2 after
    segment_ids = np.where(np.arange(length) < cut[3], 1, 2)[None].repeat(2, 0)
    parts = np.select(
        [np.arange(length) < cut[1], np.arange(length) < cut[2], np.arange(length) < cut[3]],
        [0, 1, 2],
        0,
    )[None].repeat(2, 0)
    mask = attention_mask(2, length, segment_ids=jnp.asarray(segment_ids), parts=jnp.asarray(parts))

    def loss(causal):
        def f(q, k, v):
            out = dot_product_attention(q, k, v, mask, 0.25, causal=causal)
            return jnp.sum(jnp.sin(out)), out

        return jax.grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    (grads_full, out_full), (grads_blocked, out_blocked) = loss(False), loss(True)
    np.testing.assert_allclose(out_blocked, out_full, atol=1e-6)
    for a, b in zip(grads_blocked, grads_full, strict=True):  # float32 summation order
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # and the blocks are real: one pair of einsums (scores, values) per query block
    jaxpr = str(
        jax.make_jaxpr(lambda q: dot_product_attention(q, k, v, mask, 0.25, causal=True))(q)
    )
    assert jaxpr.count("dot_general") == 2 * -(-length // causal_block(length))


def test_attention_mask_rule():
    segment_ids = jnp.array([[1, 1, 1, 1, 2, 0]])
    parts = jnp.array([[0, 1, 2, 2, 0, 0]])
    mask = np.asarray(attention_mask(1, 6, segment_ids=segment_ids, parts=parts))[0]
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],  # part 2 sees the prompt and itself, not part 1
            [1, 0, 1, 1, 0, 0],
            [0, 0, 0, 0, 1, 0],  # a new segment sees nothing before it
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(mask, expected)
    window = np.asarray(attention_mask(1, 5, sliding_window=2))[0]
    np.testing.assert_array_equal(
        window, np.tril(np.ones((5, 5)), 0) - np.tril(np.ones((5, 5)), -2)
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy, attention",
    [("full", "auto"), ("dots", "auto"), ("attention", "flash"), ("attention", "pallas")],
)
def test_remat_gives_same_logits_and_gradients(policy, attention):
    config = tiny_config("llama", vocab_size=64, attention=attention)
    plain, remat = init_model(config, seed=1), init_model(config.replace(remat=policy), seed=1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 9)))

    def loss(m):
        return jax.nn.log_softmax(m(tokens)).mean()

    g_plain = nnx.state(nnx.grad(loss)(plain))
    g_remat = nnx.state(nnx.jit(nnx.grad(loss))(remat))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g_plain, g_remat)


@pytest.mark.slow
def test_bfloat16_compute_and_params_close_to_float32():
    config = tiny_config("llama", vocab_size=64)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 9)))
    f32 = init_model(config, seed=2)
    bf16 = init_model(config.replace(dtype="bfloat16", param_dtype="bfloat16"), seed=2)
    mixed = init_model(config.replace(dtype="bfloat16"), seed=2)
    assert bf16.layers[0].mlp.up_proj.kernel[...].dtype == jnp.bfloat16
    assert mixed.layers[0].mlp.up_proj.kernel[...].dtype == jnp.float32
    assert (
        bf16.layers[0]
        .self_attn(
            jnp.zeros((1, 3, 64), jnp.bfloat16),
            attention.rows("reference", attention.TokenIds.of(1, 3), None),
            jnp.ones((1, 3, 16), jnp.bfloat16),
            jnp.zeros((1, 3, 16), jnp.bfloat16),
            False,
        )
        .dtype
        == jnp.bfloat16
    )
    ref = np.asarray(f32(tokens))
    for model in (bf16, mixed):
        out = model(tokens)
        assert out.dtype == jnp.float32  # logits always float32
        np.testing.assert_allclose(np.asarray(out), ref, atol=2e-2)


def test_abstract_model_allocates_nothing():
    config = tiny_config("llama").replace(
        vocab_size=1_000_000,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
    )
    model = abstract_model(config)
    assert isinstance(model.embed_tokens.get_value(), jax.ShapeDtypeStruct)
    n = sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert n == config.num_params()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(model_type="gpt2"), "not supported; supported: LlamaForCausalLM"),
        (dict(num_heads=4, num_kv_heads=3), "multiple of num_key_value_heads"),
        (dict(hidden_size=66, num_heads=4), "set head_dim explicitly"),
        (dict(dtype="float8"), "dtype must be one of"),
        (dict(remat="everything"), "remat must be one of"),
        (dict(attention_block=200), "attention_block must be 0 .* or a multiple of 128"),
        (dict(rope_scaling=(("rope_type", "yarn"),)), "rope_type 'yarn' is not supported"),
    ],
)
def test_bad_model_config_names_the_field(kwargs, match):
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig(**kwargs)
