"""Batch layouts: equal per-pair log-probs everywhere, no attention across pairs, bounded shapes."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpojax.data.layouts import (
    LAYOUTS,
    PAIR_KEYS,
    ROW_KEYS,
    Buckets,
    build_batch,
    max_num_shapes,
    padding_fraction,
)
from dpojax.data.pairs import PreferencePair
from dpojax.data.pipeline import BatchIterator
from dpojax.data.tokenize import TokenizedPair, tokenize_pairs
from dpojax.models import init_model
from dpojax.models.tiny import _WORDS, build_tokenizer, tiny_config
from dpojax.train.logprobs import completion_sums, token_logps

PROMPT = "You are X. Your move:"
LONG = " 1 because the corner wins"
CHAT = [{"role": "user", "content": "Your move?"}]
BOARD = "Board:\nX.O\n.X.\n..O\nYou are X. Your move:"
P = 16  # pairs per batch (the test data has 14; the rest are padding pairs)
SMALL = Buckets(lengths=(16, 32, 64))
TIGHT = Buckets(lengths=(24, 32), row_bits=2, row_multiple=2)  # forces segment splits


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return init_model(tiny_config("llama", vocab_size=len(tok)), seed=1)


@pytest.fixture(scope="module")
def pairs(tok) -> list[TokenizedPair]:
    """Plain, boundary-merge, chat (three pairs on one prompt), a TTC turn with four candidates
    (six pairs naming their completions by index) and keep_end-truncated pairs."""
    plain = [
        PreferencePair(PROMPT, " 5", LONG),
        PreferencePair(PROMPT + " ", "5", "7"),
        PreferencePair("The boa", "rd", "t"),
        PreferencePair(CHAT, "9", "the center"),
        PreferencePair(CHAT, "9", "5"),
        PreferencePair(CHAT, "the center", "5"),
    ]
    moves = [" 1", " 3", " 7 wins", " 9"]
    ttc = [
        PreferencePair(BOARD, moves[i], moves[j], {"example_id": "e", "turn_id": 2})
        for i in range(4)
        for j in range(i + 1, 4)
    ]
    kept = tokenize_pairs(plain + ttc, tok).pairs
    cut = tokenize_pairs(
        [PreferencePair(PROMPT, " 5", LONG), PreferencePair(BOARD, LONG, " 3")],
        tok,
        max_length=7,
        truncation_mode="keep_end",
        pair_ids=[100, 101],
    ).pairs
    return kept + cut


ROWS, LENGTH = 32, 64  # every batch is run padded to this shape, so the forward compiles once


@nnx.jit(static_argnums=2)
def _forward(model, b, num_completions):
    hidden = model(
        b["tokens"],
        positions=b["positions"],
        segment_ids=b["segment_ids"],
        parts=b["parts"],
        return_hidden=True,
    )
    logps = token_logps(hidden, model.lm_head_weight(), b["tokens"], b["pred_index"])
    return completion_sums(logps, b["completion_ids"], num_completions)


def run(model, batch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-pair (chosen sum, rejected sum, chosen count, rejected count) from one forward pass.

    The rows are first padded to [ROWS, LENGTH] with padding tokens (segment 0): rows are
    independent and causal attention never looks right, so this changes no value."""
    r, length = batch["tokens"].shape
    assert r <= ROWS and length <= LENGTH
    fill = {"completion_ids": -1, "completion_pos": -1}
    b = {
        k: jnp.asarray(
            np.pad(batch[k], ((0, ROWS - r), (0, LENGTH - length)), constant_values=fill.get(k, 0))
        )
        for k in ROW_KEYS
    }
    sums, counts = _forward(model, b, 2 * len(batch["pair_mask"]))
    sums, counts = np.asarray(sums), np.asarray(counts)
    c, r = batch["chosen_index"], batch["rejected_index"]
    return sums[c], sums[r], counts[c], counts[r]


@nnx.jit
def _logits(model, tokens):
    return jax.nn.log_softmax(model(tokens), axis=-1)


def direct(model, tp: TokenizedPair, which: str) -> float:
    """The sequence alone in one row (right-padded: causal, so the padding changes nothing):
    the sum of log p(token t | tokens < t) over its completion tokens."""
    seq = tp.sequence(which)
    logp = np.asarray(_logits(model, jnp.asarray(np.pad(seq, (0, LENGTH - len(seq)))[None])))[0]
    k = max(int(np.argmax(tp.completion_mask(which))), 1)
    return float(sum(logp[t - 1, seq[t]] for t in range(k, len(seq))))


@pytest.mark.parametrize("buckets", [SMALL, TIGHT], ids=["small", "tight"])
def test_logps_equal_across_layouts_and_direct(model, pairs, buckets):
    n = len(pairs)
    expected_c = np.array([direct(model, p, "chosen") for p in pairs])
    expected_r = np.array([direct(model, p, "rejected") for p in pairs])
    for layout in LAYOUTS:
        batch = build_batch(pairs, P, layout, buckets)
        c, r, nc, nr = run(model, batch)
        np.testing.assert_allclose(c[:n], expected_c, rtol=1e-6, atol=1e-5, err_msg=layout)
        np.testing.assert_allclose(r[:n], expected_r, rtol=1e-6, atol=1e-5, err_msg=layout)
        assert nc[:n].tolist() == [p.num_scored("chosen") for p in pairs]
        assert nr[:n].tolist() == [p.num_scored("rejected") for p in pairs]
        assert batch["pair_mask"].tolist() == [1.0] * n + [0.0] * (P - n)


def relabel(tp: TokenizedPair, perm: np.ndarray) -> TokenizedPair:
    """The same pair with every token id mapped through a permutation (same lengths, groups and
    duplicates, so every layout places it identically)."""
    return TokenizedPair(
        perm[tp.prompt_ids],
        perm[tp.chosen_ids],
        perm[tp.rejected_ids],
        tp.chosen_prompt_len,
        tp.rejected_prompt_len,
        tp.pair_id,
        tp.group,
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_never_crosses_pairs(model, pairs, tok, layout):
    target = 2  # alone in its group
    perm = np.random.default_rng(0).permutation(len(tok)).astype(np.int32)
    other = [p if i == target else relabel(p, perm) for i, p in enumerate(pairs)]
    batch, changed = build_batch(pairs, P, layout, SMALL), build_batch(other, P, layout, SMALL)
    for key in ROW_KEYS[1:]:
        np.testing.assert_array_equal(batch[key], changed[key])  # same placement
    if layout != "padded":  # the target's row also holds other pairs' tokens
        row = np.argmax((batch["completion_ids"] == batch["chosen_index"][target]).any(-1))
        assert len(np.unique(batch["segment_ids"][row])) > 2
    before, after = run(model, batch), run(model, changed)
    for x, y in zip(before[:2], after[:2], strict=True):
        assert x[target] == pytest.approx(y[target], abs=1e-6)
        others = [i for i in range(len(pairs)) if i != target]
        assert not np.isclose(x[others], y[others]).any()  # every other pair did change


def test_prefix_shared_and_grouped_structure(pairs):
    batch = build_batch(pairs[:1], 4, "prefix_shared", SMALL)
    tp = pairs[0]
    n, lc, lr = len(tp.prompt_ids), len(tp.chosen_ids), len(tp.rejected_ids)
    row = batch["parts"][0, : n + lc + lr]
    assert row.tolist() == [0] * n + [1] * lc + [2] * lr
    assert batch["positions"][0, n + lc] == n  # rejected continues from the prompt's end
    assert batch["pred_index"][0, n + lc] == n - 1  # ... and is predicted by the prompt's end
    assert batch["pred_index"][0, n] == n - 1
    assert batch["completion_pos"][0, n + lc : n + lc + lr].tolist() == list(range(lr))
    assert batch["segment_ids"][0, : n + lc + lr].tolist() == [1] * (n + lc + lr)
    assert (batch["segment_ids"][0, n + lc + lr :] == 0).all()
    assert batch["pair_ids"].tolist() == [0, -1, -1, -1]
    assert batch["pair_mask"].tolist() == [1, 0, 0, 0]
    assert batch["chosen_index"][0] == 0 and batch["rejected_index"][0] == 4

    ttc = [p for p in pairs if p.group == ("turn", "e", "2")]
    grouped = build_batch(ttc, 8, "grouped", SMALL)
    assert grouped["parts"].max() == 4  # four candidates behind one prompt
    assert len(np.unique(grouped["completion_ids"])) == 5  # four slots and -1
    slots = set(grouped["chosen_index"][:6]) | set(grouped["rejected_index"][:6])
    assert slots == {0, 1, 2, 3}
    tokens = build_batch(ttc, 8, "padded", SMALL)["segment_ids"].astype(bool).sum()
    assert grouped["segment_ids"].astype(bool).sum() < tokens / 4


def test_padded_rows(pairs):
    batch = build_batch(pairs[:3], 4, "padded", SMALL)
    assert {k: v.shape for k, v in batch.items()} == {
        **{k: (8, 32) for k in ROW_KEYS},
        **{k: (4,) for k in PAIR_KEYS},
    }
    assert batch["tokens"].dtype == np.int32 and batch["pair_ids"].dtype == np.int64
    assert batch["pair_mask"].dtype == np.float32
    for i, tp in enumerate(pairs[:3]):
        for row, which in ((i, "chosen"), (4 + i, "rejected")):
            seq = tp.sequence(which)
            assert batch["tokens"][row, : len(seq)].tolist() == seq.tolist()
            assert batch["positions"][row, : len(seq)].tolist() == list(range(len(seq)))
            assert (batch["segment_ids"][row, len(seq) :] == 0).all()
            scored = batch["completion_ids"][row] >= 0
            assert scored.sum() == tp.num_scored(which)
    assert (batch["segment_ids"][3] == 0).all() and (batch["segment_ids"][7] == 0).all()


def test_too_long_sequence_is_an_error(pairs):
    with pytest.raises(ValueError, match="largest length bucket"):
        build_batch(pairs, P, "packed", Buckets(lengths=(8,)))
    with pytest.raises(ValueError, match="layout"):
        build_batch(pairs, P, "diagonal", SMALL)
    with pytest.raises(ValueError, match="do not fit a batch"):
        build_batch(pairs, 2, "padded", SMALL)


def test_row_buckets():
    b = Buckets(row_bits=3)
    assert [b.rows(n) for n in (1, 8, 9, 15, 17, 33, 100)] == [1, 8, 9, 15, 18, 36, 104]
    assert Buckets(row_bits=1, row_multiple=4).rows(5) == 8
    assert Buckets(row_multiple=4).rows(9) == 12


def test_bucketed_shapes_are_bounded(tok):
    rng = random.Random(1)
    text = lambda n: " ".join(rng.choice(_WORDS) for _ in range(n))
    raw = [
        PreferencePair(text(int(rng.paretovariate(1.2) * 4)), text(rng.randint(1, 30)), text(3))
        for _ in range(300)
    ]
    data = tokenize_pairs(raw, tok, max_length=120).pairs
    buckets = Buckets(lengths=(32, 64, 128, 256), row_multiple=2)
    for layout in LAYOUTS:
        shapes, fractions = set(), []
        for batch in BatchIterator(
            data, batch_pairs=8, layout=layout, buckets=buckets, num_epochs=2
        ):
            shapes.add(batch["tokens"].shape)
            fractions.append(padding_fraction(batch))
            assert all(batch[k].shape == batch["tokens"].shape for k in ROW_KEYS)
        rows = set(buckets.row_counts(16)) if layout != "padded" else {16}
        assert all(r in rows and length in buckets.lengths for r, length in shapes), shapes
        assert len(shapes) <= max_num_shapes(layout, 8, buckets)
        assert len(shapes) <= 12, (layout, shapes)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["flash", "pallas"])
def test_logps_equal_across_layouts_with_every_attention(model, pairs, attention):
    """The flash path and the Pallas kernels (interpreted on the CPU) give every layout the
    log-probs of the reference attention's direct computation."""
    other = init_model(model.config.replace(attention=attention), seed=1)
    n = len(pairs)
    expected_c = np.array([direct(model, p, "chosen") for p in pairs])
    expected_r = np.array([direct(model, p, "rejected") for p in pairs])
    for layout in LAYOUTS:
        c, r, _, _ = run(other, build_batch(pairs, P, layout, SMALL))
        np.testing.assert_allclose(c[:n], expected_c, rtol=1e-6, atol=1e-5, err_msg=layout)
        np.testing.assert_allclose(r[:n], expected_r, rtol=1e-6, atol=1e-5, err_msg=layout)


@nnx.jit
def _token_metric_sums(model, batch):
    from dpojax.train.forward import completion_logps, token_metric_sums
    from dpojax.train.state import StepConfig

    policy = completion_logps(model, batch, StepConfig(token_metrics=True, vocab_chunk=16))
    return token_metric_sums(policy, batch)


@pytest.mark.slow
def test_token_metrics_equal_trl_s_formulas_in_every_layout(model, pairs):
    """entropy (every completion token), mean_token_accuracy (chosen tokens), logits/chosen and
    logits/rejected as TRL 1.16 computes them from each sequence's full logits, counted per
    pair: the same from every layout, shared prompts and completions included."""
    # The most common chosen token's output row scaled up, so it is often the argmax: a random
    # model's top-1 rate is otherwise 0.
    common = np.bincount(np.concatenate([tp.chosen_ids for tp in pairs])).argmax()
    model = nnx.clone(model)
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    head[...] = head[...].at[common].multiply(30.0)
    totals = {"ent": 0.0, "tokens": 0.0, "top1": 0.0, "chosen": 0.0, "zc": 0.0, "zr": 0.0}
    for tp in pairs:
        for which in ("chosen", "rejected"):
            seq = tp.sequence(which)
            logits = model(jnp.asarray(np.pad(seq, (0, LENGTH - len(seq)))[None]))[0]
            logits = np.asarray(logits, np.float64)
            k = max(int(np.argmax(tp.completion_mask(which))), 1)
            z = logits[k - 1 : len(seq) - 1]
            p = np.exp(z - z.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            totals["ent"] += float(-(p * np.log(p)).sum())
            totals["tokens"] += len(z)
            if which == "chosen":
                totals["top1"] += float((z.argmax(-1) == seq[k:]).sum())
                totals["chosen"] += len(z)
                totals["zc"] += float(z.mean(-1).sum())
            else:
                totals["zr"] += float(z.mean(-1).sum())
    rejected = totals["tokens"] - totals["chosen"]
    expected = {
        "entropy": totals["ent"] / totals["tokens"],
        "mean_token_accuracy": totals["top1"] / totals["chosen"],
        "logits/chosen": totals["zc"] / totals["chosen"],
        "logits/rejected": totals["zr"] / rejected,
    }
    assert 0 < expected["mean_token_accuracy"] < 1
    from dpojax.train.losses import TOKEN_METRICS

    for layout in LAYOUTS:
        batch = build_batch(pairs, P, layout, SMALL)
        r, length = batch["tokens"].shape
        fill = {"completion_ids": -1, "completion_pos": -1}
        b = {
            k: jnp.asarray(
                np.pad(
                    batch[k], ((0, ROWS - r), (0, LENGTH - length)), constant_values=fill.get(k, 0)
                )
            )
            for k in ROW_KEYS
        }
        b.update({k: jnp.asarray(v) for k, v in batch.items() if k not in ROW_KEYS})
        sums = jax.device_get(_token_metric_sums(model, b))
        for name, (total, count) in TOKEN_METRICS.items():
            got = float(sums[total] / sums[count])
            assert got == pytest.approx(expected[name], rel=1e-5, abs=1e-5), (layout, name)
