"""The context mesh axis (docs/long_context.md): rows split over it along their length give the
same train steps, log-probs and attention gradients as whole rows, in every batch layout."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpojax.config import default_config, validate
from dpojax.data.layouts import LAYOUTS, Buckets, build_batch
from dpojax.data.tokenize import TokenizedPair
from dpojax.models import attention, init_model
from dpojax.models.attention import TokenIds
from dpojax.models.attention.context import order as context_order
from dpojax.models.sharding import constrain, context_size, make_mesh
from dpojax.models.tiny import tiny_config
from dpojax.train.batches import part_arrays
from dpojax.train.loss_settings import LossSettings
from dpojax.train.optim import make_optimizer
from dpojax.train.state import StepConfig, create_train_state
from dpojax.train.step import Stepper
from tests.helpers.synthetic import micro_batches

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")

VOCAB = 64
# every length divides by 2 * 4 (mesh.context=4); row counts by the 4 data devices of context=2
BUCKETS = Buckets(lengths=(32, 64, 128), row_multiple=4)


def _pairs(n: int, seed: int) -> list[TokenizedPair]:
    """Pairs with shared prompts (so prefix_shared and grouped rows hold several parts)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, VOCAB, size=int(rng.integers(3, 20))) for _ in range(n // 2)]
    out = []
    for i in range(n):
        prompt = prompts[i % len(prompts)]
        chosen, rejected = (rng.integers(3, VOCAB, size=int(rng.integers(1, 12))) for _ in "cr")
        out.append(TokenizedPair(prompt, chosen, rejected, len(prompt), len(prompt), pair_id=i))
    return out


def _stepper(context: int | None, attention_: str = "auto"):
    """A tiny Llama (float32, SGD: Adam's first steps would blow float noise in near-zero
    gradients up to lr-sized differences) on one device (None) or on a (data, context) mesh of the
    8 devices."""
    mesh = None if context is None else make_mesh(8 // context, 1, 1, context=context)
    config = tiny_config("llama", vocab_size=VOCAB, num_layers=1, attention=attention_)
    model = init_model(config, seed=3)
    tx, schedule = make_optimizer(0.5, schedule="constant", max_grad_norm=1.0, name="sgd")
    cfg = StepConfig(loss=LossSettings(type="sigmoid", beta=0.1))
    graphdef, state = create_train_state(model, tx, cfg)
    stepper = Stepper(graphdef, tx, schedule, cfg, False, mesh=mesh)
    return stepper, stepper.shard_state(state)


def _params(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


def _batch(layout: str) -> dict[str, np.ndarray]:
    """The layout's batch of 8 pairs padded to one shape for every layout (16 rows of 64 tokens,
    score slots 48 wide), so each mesh compiles its train and eval steps once for all four."""
    batch = build_batch(_pairs(8, seed=10), 8, layout, BUCKETS)
    assert (batch["completion_ids"] >= 0).sum(-1).max() <= 48
    out = part_arrays(batch, rows=16, length=64, width=48, offset=0, lead=0)
    return {**out, "pair_ids": batch["pair_ids"]}


@functools.cache
def _run(context: int | None, layout: str, steps: int = 2, attention_: str = "auto"):
    """(the params after `steps` train steps, the per-sequence log-probs then, the mesh's context
    size) of one layout, every step on the same batch."""
    stepper, state = _stepper(context, attention_)
    batch = _batch(layout)
    for _ in range(steps):
        state, _ = stepper.train(state, micro_batches([batch]))
    out = stepper.evaluate(state, batch)
    logps = np.concatenate([out["policy_chosen_logps"], out["policy_rejected_logps"]])
    return _params(state), logps, None if context is None else stepper.mesh.shape["context"]


# context 4 compiles a third mesh's steps (about 30 s here): the slow tier, run once in CI
@pytest.mark.parametrize("context", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_split_rows_train_like_whole_rows(layout, context):
    """mesh.context 2 and 4 (the rest on data): the weights after two steps and the per-sequence
    log-probs equal the single device's to 1e-5 in float32."""
    want_params, want_logps, _ = _run(None, layout)
    params, logps, split = _run(context, layout)
    assert split == context
    np.testing.assert_allclose(logps, want_logps, atol=1e-5)
    for got, want in zip(params, want_params, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("context", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_split_rows_train_like_whole_rows_with_context_flash(layout, context):
    """The same with model.attention=flash, which on split rows is the context-parallel flash
    (keys and values all-gathered in shard_map): weights and log-probs of one device to 1e-5."""
    want_params, want_logps, _ = _run(None, layout)
    params, logps, split = _run(context, layout, attention_="flash")
    assert split == context
    np.testing.assert_allclose(logps, want_logps, atol=1e-5)
    for got, want in zip(params, want_params, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


# the interpreted kernels' train step compiles in ~20 s: the slow tier (the kernels' gradient
# check below has a fast case)
@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_split_rows_train_like_whole_rows_with_context_pallas(layout):
    """model.attention=pallas on (data 4, context 2): the Pallas kernels (interpreted) as the
    local kernel of the context-parallel attention give one device's weights and log-probs to
    1e-5 after two steps."""
    want_params, want_logps, _ = _run(None, layout)
    params, logps, split = _run(2, layout, attention_="pallas")
    assert split == 2
    np.testing.assert_allclose(logps, want_logps, atol=1e-5)
    for got, want in zip(params, want_params, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def _ids(layout: str) -> TokenIds:
    batch = build_batch(_pairs(8, seed=5), 8, layout, Buckets(lengths=(64,), row_multiple=4))
    return TokenIds(*(jnp.asarray(batch[k]) for k in ("segment_ids", "parts", "positions")))


def _attention_grads(implementation: str, ids: TokenIds, q, k, v, w, window=None):
    """The attention output and d(sum(out * w))/d(q, k, v), with q split over the current mesh's
    context axis and k, v gathered as the model lays them out."""
    rows = attention.rows(implementation, ids, window, platform="cpu")

    def loss(q, k, v):
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        k = constrain(k, ("batch", "kv_length", "kv", "head_dim"))
        v = constrain(v, ("batch", "kv_length", "kv", "head_dim"))
        out = attention.attend(rows, q, k, v, scale=0.25, sliding=window is not None)
        out = constrain(out, ("batch", "length", "heads", "head_dim"))
        return jnp.sum(out * w), out

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)


@pytest.mark.parametrize(
    "implementation", ["reference", pytest.param("flash", marks=pytest.mark.slow)]
)
def test_attention_gradients_with_the_length_split(implementation):
    """Each layout's attention (values and gradients in q, k, v) on a (data 2, context 4) mesh
    equals the unsplit reference's, and the queries' length really is split over context."""
    rng = np.random.default_rng(0)
    mesh = make_mesh(2, 1, 1, context=4)
    for layout in LAYOUTS:
        ids = _ids(layout)
        b, t = ids.segment_ids.shape
        q, w = (jnp.asarray(rng.normal(size=(b, t, 4, 16)), jnp.float32) for _ in "qw")
        k, v = (jnp.asarray(rng.normal(size=(b, t, 2, 16)), jnp.float32) for _ in "kv")
        want_grads, want = _attention_grads("reference", ids, q, k, v, w)
        with jax.set_mesh(mesh):
            assert context_size() == 4
            grads, out = _attention_grads(implementation, ids, q, k, v, w)
        assert out.sharding.spec[1] == "context"
        np.testing.assert_allclose(out, want, atol=1e-5, err_msg=layout)
        for name, got, expected in zip("qkv", grads, want_grads, strict=True):
            np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"{layout} d{name}")


def _split(implementation: str, ids: TokenIds, static: bool, balanced: bool, window, q, k, v, w):
    """context_attention's output and q, k, v gradients (`implementation` its local kernel)
    with the keys and values handed over split like the queries (as the model does; balanced:
    in causal load-balancing order, the output put back in row order), and the step's HLO."""
    held = context_order(ids.segment_ids.shape[1], context_size()) if balanced else None
    if balanced:
        ids = TokenIds(*(x[:, held] for x in ids))
    platform = "gpu" if static else "cpu"
    block = 8 if implementation == "pallas" else None  # blocks of 8: some cut across chunks
    rows = attention.rows(
        implementation, ids, window, platform=platform, balanced=balanced, block=block
    )
    assert rows.static == static and attention.gathers_keys(rows.implementation)

    def loss(q, k, v):
        if balanced:
            q, k, v = (x[:, held] for x in (q, k, v))
        q, k, v = (constrain(x, ("batch", "length", "heads", "head_dim")) for x in (q, k, v))
        out = attention.attend(rows, q, k, v, scale=0.25, sliding=window is not None)
        if balanced:
            out = out[:, np.argsort(held)]
        return jnp.sum(out * w), out

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    return fn(q, k, v), fn.lower(q, k, v).compile().as_text()


def _check_split_attention(implementation: str, static: bool, balanced: bool, layouts=LAYOUTS):
    """`_split` against the unsplit reference on (data 2, context 4), 96-token rows (stretches
    of 24 tokens), with and without a sliding window: values and gradients to 1e-5, and the
    all-gathers with their transposes (reduce-scatters) in the HLO."""
    rng = np.random.default_rng(1)
    mesh = make_mesh(2, 1, 1, context=4)
    for layout in layouts:
        batch = build_batch(_pairs(8, seed=5), 8, layout, Buckets(lengths=(96,), row_multiple=4))
        ids = TokenIds(*(jnp.asarray(batch[k]) for k in ("segment_ids", "parts", "positions")))
        b, t = ids.segment_ids.shape
        q, w = (jnp.asarray(rng.normal(size=(b, t, 4, 16)), jnp.float32) for _ in "qw")
        k, v = (jnp.asarray(rng.normal(size=(b, t, 2, 16)), jnp.float32) for _ in "kv")
        for window in (None, 5):
            want_grads, want = _attention_grads("reference", ids, q, k, v, w, window)
            with jax.set_mesh(mesh):
                split = _split(implementation, ids, static, balanced, window, q, k, v, w)
            (grads, out), hlo = split
            where = f"{layout} window={window}"
            assert balanced or out.sharding.spec[1] == "context"
            assert "all-gather" in hlo and "reduce-scatter" in hlo, where
            np.testing.assert_allclose(out, want, atol=1e-5, err_msg=where)
            for name, got, expected in zip("qkv", grads, want_grads, strict=True):
                np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=f"{where} d{name}")


# the model's case (balanced) in the fast tier; the rest compile more scans: the slow tier
@pytest.mark.parametrize(
    ("static", "balanced"),
    [
        (False, True),
        pytest.param(False, False, marks=pytest.mark.slow),
        pytest.param(True, True, marks=pytest.mark.slow),
        pytest.param(True, False, marks=pytest.mark.slow),
    ],
    ids=["balanced", "row-order", "static-balanced", "static-row-order"],
)
def test_context_flash_gathers_keys_and_matches_the_reference(static, balanced):
    """The context-parallel flash (shard_map, keys and values all-gathered over the axis, the
    local kernel on each stretch's queries from its row index; the static variant with its
    per-device block-pair tables) equals the unsplit reference in values and q, k, v gradients,
    for every layout, on (data 2, context 4) with 96-token rows (stretches of 24 tokens, the
    kernel's blocks cut across them), with and without a sliding window; its only collectives
    over the context axis are the gathers and their transposes."""
    _check_split_attention("flash", static, balanced)


# two layouts balanced in the fast tier (the interpreted kernels take ~5 s a layout here)
@pytest.mark.parametrize(
    ("balanced", "layouts"),
    [
        (True, ("packed", "grouped")),
        pytest.param(True, ("padded", "prefix_shared"), marks=pytest.mark.slow),
        pytest.param(False, LAYOUTS, marks=pytest.mark.slow),
    ],
    ids=["balanced", "balanced-more", "row-order"],
)
def test_context_pallas_gathers_keys_and_matches_the_reference(balanced, layouts):
    """The same for the Pallas kernels (interpreted) as the local kernel: each device's stretch
    of queries, with their row indices, against the gathered keys in the order the devices hold
    them, its own block table from both sides' id ranges; blocks of 8 tokens, so some cut
    across a balanced stretch's two chunks (12 tokens each) and the stretch is padded."""
    _check_split_attention("pallas", False, balanced, layouts)


@pytest.mark.slow
@pytest.mark.newest
def test_context_pallas_compiles_for_a_tpu_slice():
    """The Pallas kernels as the local kernel of split rows, lowered through Mosaic and compiled
    by libtpu for v5e:2x2 with the four chips on the context axis (16k-token rows, balanced
    chunks of 2,048 tokens): forward and both backward kernels, the keys and values gathered
    over the axis and their gradients summed back over it."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding

    from dpojax.runtime import prepare_tpu_compile_host

    prepare_tpu_compile_host("v5e:2x2")
    devices = topologies.get_topology_desc("v5e:2x2", "tpu").devices
    mesh = Mesh(np.array(devices).reshape(1, 1, 4, 1), ("data", "fsdp", "context", "tensor"))
    b, t, h, kv, d = 1, 16384, 4, 2, 128
    split = NamedSharding(mesh, jax.sharding.PartitionSpec(None, "context"))

    def loss(q, k, v, seg, part, pos):
        ids = TokenIds(seg, part, pos)
        rows = attention.rows("pallas", ids, None, platform="tpu", balanced=True)
        assert not rows.interpret and attention.gathers_keys("pallas")
        out = attention.attend(rows, q, k, v, scale=d**-0.5, sliding=False)
        return out.astype(jnp.float32).sum()

    shapes = [(b, t, h, d), (b, t, kv, d), (b, t, kv, d)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=split) for s in shapes]
    args += [jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=split)] * 3
    with jax.set_mesh(mesh):
        lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args)
    text = lowered.compile().as_text()
    for name in ("dpojax_flash_forward", "dpojax_flash_dq", "dpojax_flash_dkv"):
        assert name in text, name
    gathers = [line for line in text.splitlines() if " all-gather(" in line]
    assert any("bf16[1,16384,2,128]" in line for line in gathers)  # K and V, whole rows
    # their gradients come back summed over the axis: libtpu compiles all_gather's transpose
    # (a reduce-scatter) as an all-reduce of the whole rows' dK and dV here
    summed = [
        line for line in text.splitlines() if " all-reduce(" in line or "reduce-scatter(" in line
    ]
    assert any("bf16[1,16384,2,128]" in line or "bf16[1,4096,2,128]" in line for line in summed)


def test_causal_load_balancing_gives_every_device_the_same_pairs():
    """order(): device d holds chunks d and 2n-1-d; with it every device's static table has as
    many visited block pairs as any other (in row order the last device has the most), and the
    tables are shorter than row order's padded ones."""
    from dpojax.models.attention.context import order, pair_tables

    held = order(32, 4).reshape(4, 8)
    assert held[0].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    assert held[3].tolist() == [12, 13, 14, 15, 16, 17, 18, 19]
    assert sorted(held.reshape(-1).tolist()) == list(range(32))
    balanced, row_order = pair_tables(2048, 4, 64, True), pair_tables(2048, 4, 64)
    visited = balanced[:, :, 2].sum(1)
    assert (visited == visited[0]).all() and len(set(row_order[:, :, 2].sum(1).tolist())) == 4
    assert balanced.shape[1] == visited[0] < row_order.shape[1]
    assert visited.sum() == row_order[:, :, 2].sum()  # the same triangle, dealt out evenly


@pytest.mark.parametrize("context", [2, 4])
def test_to_rows_puts_balanced_rows_back_by_permutes_alone(context):
    """context.to_rows: a [B, T, D] array held in `order` comes back in row order (values and
    gradients: its transpose is the inverse permutes), each device sending and receiving half a
    stretch twice; no collective of the HLO holds more than a stretch (no gather of whole
    rows)."""
    from dpojax.models.attention.context import to_rows

    b, t, d = 4, 32, 3
    rows = np.arange(b * t * d, dtype=np.float32).reshape(b, t, d)
    held = context_order(t, context)
    mesh = make_mesh(8 // context, 1, 1, context=context)
    spec = jax.sharding.PartitionSpec("data", "context")
    w = np.random.default_rng(0).normal(size=(b, t, d)).astype(np.float32)

    def loss(x):
        out = to_rows(x, spec)
        return jnp.sum(out * w), out

    with jax.set_mesh(mesh):
        x = jax.device_put(rows[:, held], jax.sharding.NamedSharding(mesh, spec))
        fn = jax.jit(jax.grad(loss, has_aux=True))
        grad, out = fn(x)
        hlo = fn.lower(x).compile().as_text()
    np.testing.assert_array_equal(out, rows)
    np.testing.assert_array_equal(grad, w[:, held])
    collectives = [line for line in hlo.splitlines() if "collective-permute" in line]
    assert collectives and "all-gather" not in hlo and "all-reduce" not in hlo
    assert all(f"[{b // (8 // context)},{t // context // 2},{d}]" in line for line in collectives)


def test_context_pair_tables_cover_each_stretch_once():
    """The static variant's tables: for each device's stretch, every (query block, key block)
    pair at or below the diagonal exactly once, fillers after, one length for all devices."""
    from dpojax.models.attention.context import pair_tables

    tables = pair_tables(96, 4, 16)  # 2 query blocks a stretch (the second padded), 6 key blocks
    assert tables.shape[0] == 4
    for d, table in enumerate(tables):
        visited = {(int(i), int(j)) for i, j, on in table if on}
        assert len(visited) == int(table[:, 2].sum())
        want = {(i, j) for i in range(2) for j in range(6) if j * 16 <= d * 24 + (i + 1) * 16 - 1}
        assert visited == want
        assert not table[int(table[:, 2].sum()) :].any()


def test_kernels_that_see_whole_rows_are_refused_on_split_rows():
    """cuDNN's custom call sees whole rows only; the Pallas kernels, flash and the reference run
    split rows ("auto" on TPU stays with the Pallas kernels there)."""
    config = tiny_config("llama", vocab_size=VOCAB)
    with jax.set_mesh(make_mesh(4, 1, 1, context=2)):
        assert attention.choose(config.replace(attention="auto"), "tpu", 64) == "pallas"
        assert attention.choose(config.replace(attention="pallas"), "tpu", 64) == "pallas"
        assert attention.choose(config.replace(attention="reference"), "cpu", 64) == "reference"
        assert attention.choose(config.replace(attention="auto"), "gpu", 64) == "flash"
        padded = config.replace(attention="cudnn", row_layout="padded", dtype="bfloat16")
        with pytest.raises(ValueError, match=r"model.attention='cudnn'.*mesh.context=2"):
            attention.choose(padded, "gpu", 64)
    assert attention.describe(config.replace(attention="auto"), "tpu", context=2).startswith(
        "pallas"
    )


def test_parameters_are_split_over_fsdp_and_context():
    stepper, state = _stepper(2)
    kernel = state.params["layers"][0]["mlp"]["up_proj"]["kernel"].get_value()
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("context", None)


def _config(tmp_path, **mesh):
    config = default_config()
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "train.jsonl").write_text("{}\n")
    config.model.path = str(tmp_path / "model")
    config.data.train_path = str(tmp_path / "train.jsonl")
    for key, value in mesh.items():
        setattr(config.mesh, key, value)
    return config


def test_context_config_checks(tmp_path):
    """mesh.context: row lengths divisible by 2 * context, an attention that runs split rows;
    the batch is split over data x fsdp only."""
    config = _config(tmp_path, data=-1, context=2)
    config.data.max_length = 512
    assert validate(config, num_devices=8) == []  # rows of 16, 32, ..., 512 tokens
    config.mesh.context = 16  # 16-token rows cannot be cut into 32 chunks
    (error,) = validate(config, num_devices=16)
    assert "'mesh.context' (16)" in error and "[16]" in error and "data.row_lengths" in error
    config.mesh.context = 2
    config.data.max_length = 102  # the longest row, 102 tokens, is not a multiple of 4
    assert any("[102]" in e for e in validate(config, num_devices=8))
    config.data.max_length, config.model.attention = 512, "pallas"
    assert validate(config, num_devices=8) == []
    config.model.attention = "cudnn"
    errors = validate(config, num_devices=8)
    assert any("'model.attention' is 'cudnn'" in e and "mesh.context=2" in e for e in errors)
    config.model.attention = "auto"
    config.train.batch_size = 4  # 4 pairs over data 4 (8 devices / context 2): fine
    assert validate(config, num_devices=8) == []
    config.mesh.data, config.mesh.context = 4, -1
    assert any("'mesh.context' must be a positive size" in e for e in validate(config))


@pytest.mark.parametrize(("name", "devices"), [("llama8b_h100_128k", 8), ("llama8b_v5p_128k", 4)])
def test_long_row_recipes_check(name, devices):
    """The shipped 131,072-token recipes pass the config checks for their target's devices: one
    pair a step, the rows split over every device on the context axis."""
    from dpojax import api

    config = api.config(name)
    config.mode = "plan"
    assert validate(config, num_devices=devices) == []
    assert config.data.max_length == 131072 and config.mesh.context == devices
