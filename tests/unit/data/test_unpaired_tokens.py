"""Unpaired examples tokenized as TRL's KTOTrainer does and laid out as (own completion, KL
completion) pairs: TRL's prompt / completion split, the KL rotation within runs of the batch size
in the data's order, the prompt-too-long drop and truncation, labels into the batch arrays."""

import numpy as np
import pytest

from dpojax.data.layouts import padded_batch
from dpojax.data.pairs import PreferencePair
from dpojax.data.tokenize import tokenize_pair
from dpojax.data.unpaired import UnpairedExample
from dpojax.data.unpaired_tokens import kl_partners, tokenize_unpaired
from dpojax.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _examples(n):
    return [UnpairedExample(f"{i} +", f" {i + 1}", i % 2 == 0) for i in range(n)]


def test_kl_partners_rotate_within_runs():
    assert kl_partners(5, 2).tolist() == [1, 0, 3, 2, 4]
    assert kl_partners(4, 4).tolist() == [3, 0, 1, 2]
    with pytest.raises(ValueError):
        kl_partners(3, 0)


def test_own_completion_as_the_pair_tokenizer_and_kl_completion_rotated(tok):
    examples = _examples(5)
    result = tokenize_unpaired(examples, tok, kl_batch_size=2)
    assert [p.pair_id for p in result.pairs] == [0, 1, 2, 3, 4]
    assert [p.label for p in result.pairs] == [1, 0, 1, 0, 1]
    own = [
        tokenize_pair(PreferencePair(e.prompt, e.completion, e.completion), tok) for e in examples
    ]
    for p, o in zip(result.pairs, own, strict=True):
        assert p.sequence("chosen").tolist() == o.sequence("chosen").tolist()
        assert p.chosen_prompt_len == p.rejected_prompt_len == o.chosen_prompt_len
    for i, j in enumerate([1, 0, 3, 2, 4]):
        prompt = own[i].sequence("chosen")[: own[i].chosen_prompt_len]
        tail = own[j].sequence("chosen")[own[j].chosen_prompt_len :]
        assert result.pairs[i].sequence("rejected").tolist() == [*prompt, *tail]
    batch = padded_batch(result.pairs[:3], 4)
    assert batch["labels"].tolist() == [1, 0, 1, 0]
    assert "labels" not in padded_batch([own[0]], 2)


def test_prompt_too_long_dropped_before_the_rotation_and_truncation(tok):
    examples = [*_examples(2), UnpairedExample("1 + 2 + 3 + 4 + 5 + 6 + 7", " 8", True)]
    whole = tokenize_unpaired(examples, tok, kl_batch_size=3)
    long_prompt = whole.pairs[2].chosen_prompt_len
    result = tokenize_unpaired(examples, tok, kl_batch_size=3, max_length=long_prompt)
    assert result.dropped == {"prompt_too_long": [2]}
    assert [p.pair_id for p in result.pairs] == [0, 1]
    assert result.pairs[0].sequence("rejected")[-2:].tolist() == (
        whole.pairs[1].sequence("chosen")[-2:].tolist()
    )
    limit = whole.pairs[0].chosen_prompt_len + 1
    cut = tokenize_unpaired(examples[:2], tok, kl_batch_size=2, max_length=limit)
    assert len(cut.pairs) == 2
    assert all(len(p.sequence(w)) <= limit for p in cut.pairs for w in ("chosen", "rejected"))
    assert cut.truncated > 0
    assert np.all([p.num_scored("chosen") >= 1 for p in cut.pairs])
