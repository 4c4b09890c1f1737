"""dpojax.train.flops: the FLOP model and the work a layout batch holds, against hand counts."""

import jax
import numpy as np

from dpojax.models import ModelConfig
from dpojax.train import flops
from dpojax.train.flops import batch_work, forward_flops, step_flops


def test_step_flops_matches_a_hand_count():
    config = ModelConfig(
        hidden_size=8, intermediate_size=16, vocab_size=32, num_heads=2, num_kv_heads=1,
        head_dim=4, num_layers=3,
    )  # fmt: skip
    # per token per layer: q 8*8, k and v 8*4 each, o 8*8, MLP 3*8*16 multiply-adds
    per_token = 2 * 3 * (64 + 32 + 32 + 64 + 384)
    per_attention_pair = 2 * 3 * 2 * 2 * 4  # QK^T and PV, 2 heads of 4, 3 layers
    forward = per_token * 10 + per_attention_pair * 40 + 2 * 32 * 8 * 5
    assert forward_flops(config, 10, 40, 5) == forward
    assert step_flops(config, 10, 40, 5, reference_forward=True) == 4 * forward
    assert step_flops(config, 10, 40, 5, reference_forward=False) == 3 * forward
    # orpo's NLL over whole chosen sequences: the policy's LM head on all 10 tokens, fwd + bwd
    lm_head_more = 3 * 2 * 32 * 8 * (10 - 5)
    kw = dict(reference_forward=True, lm_head_everywhere=True)
    assert step_flops(config, 10, 40, 5, **kw) == 4 * forward + lm_head_more


def test_the_reference_forward_is_counted_only_where_it_runs():
    """Before: the step's FLOPs (train's MFU, the plan's) counted a reference forward for every
    reference but a precomputed one, so orpo, cpo (simpo included) and loss.reference_free (whose
    reference log-probs are 0, no pass run) had a third too many."""
    from dpojax.train.loss_settings import LossSettings
    from dpojax.train.reference_choice import KINDS
    from dpojax.train.state import StepConfig

    def runs(loss: LossSettings, reference: str = "frozen") -> bool:
        return StepConfig(reference=KINDS[reference](), loss=loss).reference_forward

    assert runs(LossSettings(type="sigmoid")) and runs(LossSettings(type="ipo"), "lora_base")
    assert not runs(LossSettings(type="sigmoid"), "precomputed")
    assert not runs(LossSettings(type="sigmoid", reference_free=True))
    for free in ("orpo", "cpo"):
        assert not runs(LossSettings(type=free)), free
    assert not runs(LossSettings(type="cpo", cpo_type="simpo"))
    assert runs(LossSettings(type="sigmoid,sft")) and not runs(LossSettings(type="orpo,cpo"))


def test_batch_work_counts_what_the_attention_rule_allows():
    # row 0: one prefix-shared segment (2 prompt tokens, a 1-token chosen, a 1-token rejected) and
    # a padding slot; row 1: two packed segments of 2 and 3 prompt-only tokens
    batch = dict(
        segment_ids=np.array([[1, 1, 1, 1, 0], [1, 1, 2, 2, 2]]),
        parts=np.array([[0, 0, 1, 2, 0], [0, 0, 0, 0, 0]]),
        completion_ids=np.array([[-1, -1, 0, 1, -1], [-1, -1, -1, -1, -1]]),
    )
    tokens, pairs, scored = batch_work(batch)
    assert tokens == 9
    # row 0: 1 + 2 + 3 (part 1 sees the prompt and itself) + 3 (part 2 skips part 1) = 9;
    # row 1: causal within each segment, 1 + 2 and 1 + 2 + 3 = 9; padding attends nothing
    assert pairs == 18
    assert scored == 2


def test_batch_work_counts_on_the_host_cpu_not_the_default_device(monkeypatch):
    """On an accelerator the count would queue behind the train step in flight (and reading it
    would make the batch pipeline wait for that step): it runs on the host's CPU device whatever
    the default device is (here another of the test's CPU devices stands in for a GPU)."""
    host = jax.local_devices(backend="cpu")[0]
    other = next(d for d in jax.devices() if d != host)
    ran_on = []
    count = flops._allowed_pairs

    def spy(seg, parts, block):
        ran_on.append(seg.devices())
        return count(seg, parts, block)

    monkeypatch.setattr(flops, "_allowed_pairs", spy)
    batch = dict(
        segment_ids=np.array([[1, 1, 1, 0]]),
        parts=np.zeros((1, 4), np.int32),
        completion_ids=np.array([[-1, 0, 0, -1]]),
    )
    with jax.default_device(other):
        assert batch_work(batch) == (3, 6, 2)
    assert ran_on == [{host}]
