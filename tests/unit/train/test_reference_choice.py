"""The config's reference keys as a typed choice: one record per kind with only its own settings,
the combinations no record holds refused by key, and where a reference is read from left out of
the record's equality (a loop's rounds keep one compiled step)."""

from types import SimpleNamespace

import pytest

from dpojax.config import default_config
from dpojax.train.reference_choice import (
    REFERENCE_TYPES,
    FrozenReference,
    LoraBaseReference,
    PrecomputedReference,
    Sync,
    reference_choice,
)
from dpojax.train.state import StepConfig


def _keys(**values):
    keys = dict(type="frozen", path="", cache_dir="", sync_every=0, sync_alpha=0.6)
    return SimpleNamespace(**{**keys, **values})


def test_each_kind_from_the_config_keys():
    config = default_config()
    assert reference_choice(config.reference) == FrozenReference()
    assert REFERENCE_TYPES == ("frozen", "lora_base", "precomputed")
    frozen = reference_choice(_keys(path="org/ref", sync_every=3, sync_alpha=0.5))
    assert isinstance(frozen, FrozenReference) and frozen.path == "org/ref"
    assert frozen.sync == Sync(3, 0.5) and frozen.runs_forward
    lora = reference_choice(_keys(type="lora_base", sync_every=2))
    assert isinstance(lora, LoraBaseReference) and lora.sync == Sync(2, 0.6) and lora.path == ""
    pre = reference_choice(_keys(type="precomputed", path="/ref", cache_dir="/cache"))
    assert isinstance(pre, PrecomputedReference) and not pre.runs_forward
    assert (pre.path, pre.cache_dir, pre.sync) == ("/ref", "/cache", None)


@pytest.mark.parametrize(
    "values, match",
    [
        (dict(type="shared"), "'reference.type' must be one of frozen, lora_base, precomputed"),
        (dict(type="lora_base", path="/ref"), "'reference.path' must be empty"),
        (dict(type="precomputed", sync_every=1), r"'reference.sync_every' \(TR-DPO\)"),
    ],
)
def test_combinations_no_kind_holds_are_refused_by_key(values, match):
    with pytest.raises(ValueError, match=match):
        reference_choice(_keys(**values))


def test_where_the_reference_is_read_from_is_not_part_of_the_step():
    """A loop's rounds train against the previous round's checkpoint: the step settings must stay
    equal (and hash equal) so the `StepperCache` hands the rounds one compiled Stepper."""
    first = StepConfig(reference=FrozenReference(path="/loop/round_0/export"))
    second = StepConfig(reference=FrozenReference(path="/loop/round_1/export"))
    assert first == second and hash(first) == hash(second)
    cached = PrecomputedReference(cache_dir="/a"), PrecomputedReference(cache_dir="/b")
    assert cached[0] == cached[1] and hash(cached[0]) == hash(cached[1])
    assert FrozenReference(sync=Sync(2)) != FrozenReference()
    assert FrozenReference() != LoraBaseReference()
