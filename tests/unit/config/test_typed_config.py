"""The typed config every job takes: `frozen(config)` (with a workflow's own options read-only in
`collect.workflows`), a changed copy by dotted keys (`schema.replaced`) and the nested dict of
config.json (`schema.as_dict`), which is the ConfigDict's own."""

import dataclasses
import json

import pytest

from dpojax import schema
from dpojax.config import Config, default_config, frozen


def _config():
    c = default_config()
    c.collect.workflow = "tictactoe"
    c.collect.tictactoe.games = 5
    c.train.batch_size, c.loss.weights = 4, [0.5]
    return c


def test_the_typed_config_holds_the_values_and_the_workflow_options_read_only():
    typed = frozen(_config())
    assert isinstance(typed, Config) and typed.train.batch_size == 4
    assert typed.loss.weights == (0.5,)  # lists become tuples
    assert typed.collect.workflows["tictactoe"]["games"] == 5
    with pytest.raises(TypeError):
        typed.collect.workflows["tictactoe"]["games"] = 6  # read-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.train.batch_size = 8
    assert "collect.workflows" not in {k.name for k in schema.keys(Config)}  # not a key


def test_config_json_is_the_config_dicts_record():
    c = _config()
    text = json.dumps(schema.as_dict(frozen(c)), default=str)
    assert text == json.dumps(json.loads(c.to_json_best_effort()))  # the same keys in one order


def test_replaced_changes_dotted_keys_and_options_and_refuses_unknown_ones():
    typed = frozen(_config())
    changed = schema.replaced(
        typed, {"train.grad_accum": 2, "model.path": "m", "collect.tictactoe.games": 9}
    )
    assert (changed.train.grad_accum, changed.model.path) == (2, "m")
    assert changed.collect.workflows["tictactoe"]["games"] == 9
    assert (
        changed.collect.workflows["tictactoe"]["candidates"]
        == (typed.collect.workflows["tictactoe"]["candidates"])
    )
    assert (typed.train.grad_accum, typed.collect.workflows["tictactoe"]["games"]) == (1, 5)
    assert changed.train.batch_size == 4 and changed.loss == typed.loss
    with pytest.raises(KeyError, match="'grad_acum'"):
        schema.replaced(typed, {"train.grad_acum": 2})
    with pytest.raises(KeyError, match="'nope'"):
        schema.replaced(typed, {"nope.x": 1})
