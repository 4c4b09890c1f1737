"""The KV-cache sampler: greedy = argmax of the full forward, stop tokens, filters, distinct
candidates (Gumbel-top-k / Plackett-Luce), seeding and the number of compilations.

Most calls share one compiled shape (<= 8 prompts of <= 32 tokens, n = 8, <= 8 new tokens) to keep
the file fast; `test_plackett_luce_frequencies` and `test_compile_count_is_bounded` add one each.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpojax.models import init_model, sampler
from dpojax.models.sampler import compile_count, generate
from dpojax.models.tiny import build_tokenizer, tiny_config
from dpojax.workflows.tictactoe.game import board_prompt

N = 8
REF_LEN = 48  # reference forward passes run on rows right-padded to this length


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return init_model(tiny_config("llama", vocab_size=len(tokenizer)), seed=0)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Prompts of different lengths: two tic-tac-toe boards and two short texts."""
    texts = [board_prompt("X...O...."), "The board", board_prompt("XO.XO...."), "You play a move"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    assert len({len(p) for p in ids}) == 4 and max(len(p) for p in ids) <= 32
    return ids


_forward = jax.jit(lambda model, tokens: model(tokens))


def _next_logits(model, seq) -> np.ndarray:
    """Logits of the token after `seq`, from a full forward pass (padding after it is inert)."""
    row = np.zeros((1, REF_LEN), np.int32)
    row[0, : len(seq)] = seq
    return np.asarray(_forward(model, jnp.asarray(row)))[0, len(seq) - 1]


def _log_softmax(x):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x)))


def _greedy_reference(model, prompt, steps):
    seq, logprobs = list(prompt), []
    for _ in range(steps):
        logits = _next_logits(model, seq)
        seq.append(int(np.argmax(logits)))
        logprobs.append(_log_softmax(logits)[seq[-1]])
    return seq[len(prompt) :], logprobs


@pytest.mark.slow
def test_greedy_equals_argmax_of_full_forward(model, prompts, tokenizer):
    out = generate(
        model, prompts, n=N, max_new_tokens=6, temperature=0.0, stop_tokens=(), tokenizer=tokenizer
    )
    for prompt, completions in zip(prompts, out, strict=True):
        expected, logprobs = _greedy_reference(model, prompt, 6)
        assert len(completions) == N
        for c in completions:
            assert list(c.tokens) == expected
            assert c.finish_reason == "length"
            np.testing.assert_allclose(c.token_logprobs, logprobs, atol=1e-4)
            assert c.logprob == pytest.approx(sum(logprobs), abs=1e-4)
            assert c.text == tokenizer.decode(expected)


@pytest.mark.slow
def test_stop_tokens_end_sequences(model, prompts, tokenizer):
    kw = dict(n=N, max_new_tokens=6, temperature=0)
    greedy = generate(model, prompts, stop_tokens=(), **kw)
    stop = greedy[0][0].tokens[2]
    out = generate(model, prompts, stop_tokens=(stop,), **kw)
    for full, cs in zip(greedy, out, strict=True):
        tokens, c = list(full[0].tokens), cs[0]
        if stop in tokens:
            assert list(c.tokens) == tokens[: tokens.index(stop) + 1]
            assert c.finish_reason == "stop"
        else:
            assert list(c.tokens) == tokens and c.finish_reason == "length"
    assert out[0][0].tokens[-1] == stop and len(out[0][0].tokens) <= 3
    # Sampled rows: a stop token is last (included), never followed by anything; text drops it.
    stops = (stop, 7, 11, 13, 17, 19, 23, 29)
    sampled = generate(model, prompts, n=N, max_new_tokens=8, stop_tokens=stops, seed=3)
    sampled += generate(model, prompts, n=N, max_new_tokens=8, stop_tokens=stops, seed=4)
    reasons = set()
    for c in (c for cs in sampled for c in cs):
        reasons.add(c.finish_reason)
        assert not set(c.tokens[:-1]) & set(stops)
        assert (c.tokens[-1] in stops) == (c.finish_reason == "stop")
        assert c.finish_reason == "stop" or len(c.tokens) == 8
    assert reasons == {"stop", "length"}
    default = generate(model, prompts, n=N, max_new_tokens=8, temperature=0, tokenizer=tokenizer)
    assert sampler._stop_ids(None, model) == (tokenizer.eos_token_id,)  # default: the model's EOS
    for c in (c for cs in default for c in cs):
        assert c.text == tokenizer.decode(c.tokens[:-1] if c.finish_reason == "stop" else c.tokens)


@pytest.mark.slow
def test_distinct_single_token_candidates(model, prompts):
    out = generate(model, prompts, n=N, max_new_tokens=1, distinct=True, seed=0)
    for completions in out:
        assert len(completions) == N
        assert len({c.tokens for c in completions}) == N
    # n equal to the number of allowed tokens: exactly the top-k set, each once.
    out = generate(model, prompts, n=N, max_new_tokens=1, top_k=N, distinct=True, seed=1)
    for prompt, completions in zip(prompts, out, strict=True):
        top = np.argsort(-_next_logits(model, prompt))[:N].tolist()
        assert sorted(c.tokens[0] for c in completions) == sorted(top)
    # more candidates asked for than exist: the ones that exist, reported by the list length.
    out = generate(model, prompts, n=N, max_new_tokens=1, top_k=6, distinct=True, seed=2)
    assert [len(cs) for cs in out] == [6] * len(prompts)
    # greedy distinct: the N most likely first tokens, most likely first.
    out = generate(model, prompts, n=N, max_new_tokens=1, temperature=0, distinct=True)
    for prompt, completions in zip(prompts, out, strict=True):
        best = np.argsort(-_next_logits(model, prompt))[:N].tolist()
        assert [c.tokens[0] for c in completions] == best


@pytest.mark.slow
@pytest.mark.newest  # it reads the lowered program, which each JAX release writes its way
def test_single_token_program_draws_the_first_token_of_longer_ones(model, prompts):
    """max_new_tokens=1 compiles without the decode loop; its tokens and log-probs are the first
    step of the same seed's longer generation (the first draw does not depend on the length)."""
    for kw in (dict(temperature=0), dict(distinct=True, seed=3), dict(top_k=5, seed=4)):
        one = generate(model, prompts, n=N, max_new_tokens=1, stop_tokens=(), **kw)
        three = generate(model, prompts, n=N, max_new_tokens=3, stop_tokens=(), **kw)
        for short, long in zip(one, three, strict=True):
            assert [c.tokens for c in short] == [c.tokens[:1] for c in long]
            assert [c.finish_reason for c in short] == ["length"] * len(short)
            np.testing.assert_allclose(
                [c.logprob for c in short], [c.token_logprobs[0] for c in long], rtol=1e-6
            )
    graphdef, state = nnx.split(model)
    opts = dict(temperature=1.0, top_k=0, top_p=1.0, greedy=False, filtered=False, distinct=True)
    args = (graphdef, state, jnp.ones((8, 16), jnp.int32), jnp.full((8,), 16), jax.random.key(0))
    args += ({k: jnp.asarray(v) for k, v in opts.items()}, jnp.full((8,), -1), jnp.int32(1))

    def program(new_bucket):
        return sampler._generate_chunk.lower(*args, n=N, new_bucket=new_bucket).as_text()

    single, longer = program(sampler._new_bucket(1)), program(8)
    # the decode loop's while (and the sampling inside its body) is gone: about half the program
    assert single.count("stablehlo.while") < longer.count("stablehlo.while")
    assert len(single) < 0.6 * len(longer)


@pytest.mark.slow
def test_distinct_longer_sequences_reject_duplicates(model, prompts):
    # top-2 over 3 steps: exactly 8 sequences exist; first tokens alone give only 2.
    out = generate(
        model,
        prompts,
        n=N,
        max_new_tokens=3,
        top_k=2,
        stop_tokens=(),
        distinct=True,
        seed=5,
        max_retries=60,
    )
    for prompt, completions in zip(prompts, out, strict=True):
        assert len({c.tokens for c in completions}) == len(completions) == N
        for c in completions:
            for i, token in enumerate(c.tokens):
                top2 = np.argsort(-_next_logits(model, prompt + list(c.tokens[:i])))[:2]
                assert token in top2
    # fewer exist (top-1 continuations): found once, no endless retries.
    out = generate(
        model, prompts[:1], n=N, max_new_tokens=3, top_k=1, stop_tokens=(), distinct=True
    )
    assert len(out[0]) == 1


@pytest.mark.slow
def test_plackett_luce_frequencies(model, prompts):
    """First and second candidates of Gumbel-top-k follow the Plackett-Luce marginals."""
    prompt, k, copies = prompts[0], 4, 400
    logits = _next_logits(model, prompt)
    top = np.argsort(-logits)[:k]
    temperature = float(logits[top[0]] - logits[top[-1]]) / 2.0  # a clearly uneven distribution
    p = np.exp((logits[top] - logits[top].max()) / temperature)
    p /= p.sum()
    second = np.array([sum(p[i] * p[j] / (1 - p[i]) for i in range(k) if i != j) for j in range(k)])
    kw = dict(n=N, max_new_tokens=1, temperature=temperature, top_k=k, seed=11)
    distinct = generate(model, [prompt] * copies, distinct=True, **kw)
    assert all(len(cs) == k for cs in distinct)  # only k tokens allowed
    assert all(len({c.tokens for c in cs}) == k for cs in distinct)
    for pos, expected in ((0, p), (1, second)):
        seen = [cs[pos].tokens[0] for cs in distinct]
        freq = np.array([seen.count(t) for t in top]) / copies
        np.testing.assert_allclose(freq, expected, atol=0.05)
    # with replacement: every draw follows p
    free = [c.tokens[0] for cs in generate(model, [prompt] * copies, **kw) for c in cs]
    freq = np.array([free.count(t) for t in top]) / len(free)
    np.testing.assert_allclose(freq, p, atol=0.03)
    assert sum(freq) == pytest.approx(1.0)


@pytest.mark.slow
def test_temperature_top_k_top_p_restrict_the_support(model, prompts):
    first = {i: _next_logits(model, p) for i, p in enumerate(prompts)}
    # top-k: every generated token is among the k most likely at its prefix.
    out = generate(model, prompts, n=N, max_new_tokens=3, top_k=3, stop_tokens=(), seed=7)
    for prompt, completions in zip(prompts, out, strict=True):
        for c in completions:
            for i, token in enumerate(c.tokens):
                assert token in np.argsort(-_next_logits(model, prompt + list(c.tokens[:i])))[:3]
    # top-p (after temperature and top-k): the smallest set reaching p, every member drawn.
    temperature = 0.02
    rows = [prompts[0]] * 8
    for top_k, top_p in ((0, 0.6), (5, 0.9)):
        scaled = first[0] / temperature
        order = np.argsort(-scaled)[: top_k or None]
        probs = np.exp(scaled[order] - scaled[order].max())
        probs /= probs.sum()
        nucleus = set(order[: int(np.searchsorted(np.cumsum(probs), top_p)) + 1].tolist())
        assert 2 <= len(nucleus) <= 5
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=8)
        drawn = {
            c.tokens[0] for cs in generate(model, rows, n=N, max_new_tokens=1, **kw) for c in cs
        }
        assert drawn == nucleus
    # a tiny temperature is greedy; a large one spreads over many tokens.
    cold = generate(model, prompts, n=N, max_new_tokens=1, temperature=1e-4)
    for i, completions in enumerate(cold):
        assert {c.tokens[0] for c in completions} == {int(np.argmax(first[i]))}
    hot = generate(model, rows, n=N, max_new_tokens=1, temperature=100.0, seed=9)
    assert len({c.tokens[0] for cs in hot for c in cs}) > 40


@pytest.mark.slow
def test_seeded_reproducibility(model, prompts):
    kw = dict(n=N, max_new_tokens=5, top_p=0.95, stop_tokens=())
    a = generate(model, prompts, seed=42, **kw)
    generate(model, prompts, seed=1, **kw)
    b = generate(model, prompts, seed=42, **kw)
    c = generate(model, prompts, seed=43, **kw)
    assert a == b
    assert [x.tokens for cs in a for x in cs] != [x.tokens for cs in c for x in cs]
    d1 = generate(model, prompts, seed=42, distinct=True, **kw)
    d2 = generate(model, prompts, seed=42, distinct=True, **kw)
    assert d1 == d2


@pytest.mark.slow
def test_compile_count_is_bounded(model, tokenizer):
    rng = np.random.default_rng(0)
    lengths = itertools.cycle([17, 20, 23, 25, 27, 30, 32])  # bucket 32
    before = compile_count()
    for count, max_new in ((1, 1), (3, 2), (8, 8), (5, 7), (2, 5)):
        batch = [rng.integers(3, 500, size=next(lengths)).tolist() for _ in range(count)]
        for kw in (dict(temperature=0), dict(distinct=True), dict(top_k=5, top_p=0.9)):
            generate(model, batch, n=N, max_new_tokens=max_new, **kw)
    # one shape and the single-token program (max_new_tokens=1, no decode loop); compiled
    # already if other tests ran first
    assert compile_count() - before <= 2
    middle = compile_count()
    generate(model, [rng.integers(3, 500, size=40).tolist()], n=N, max_new_tokens=2)
    generate(model, [rng.integers(3, 500, size=60).tolist()] * 3, n=N, max_new_tokens=8)
    assert compile_count() - middle == 1  # prompt length bucket 64


def test_bad_arguments(model):
    with pytest.raises(ValueError):
        generate(model, [[]], max_new_tokens=1)
    with pytest.raises(ValueError):
        generate(model, [[1, 2]], max_new_tokens=1, top_p=0.0)
    with pytest.raises(ValueError):
        generate(model, [[1, 10_000]], max_new_tokens=1)
    assert generate(model, [], max_new_tokens=1) == []
    assert sampler._bucket(25, 16) == 32 and sampler._bucket(9, 8, 4) == 32
