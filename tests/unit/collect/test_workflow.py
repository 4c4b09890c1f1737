"""Workflow plug-ins, collection errors as NAT handles them, and the collect / loop modes."""

import json
import math

import pytest

from dpojax.collect.gate import Gate
from dpojax.collect.runner import CollectionError, run_collection
from dpojax.collect.workflow import load_workflow
from dpojax.config import default_config, frozen
from dpojax.jobs import rounds
from dpojax.jobs.rounds import collection

PLUGIN = "tests.helpers.plugin_workflow:CountingWorkflow"


def _config(**collect):
    config = default_config()
    config.collect.workflow = PLUGIN
    config.collect.workflow_kwargs = json.dumps(collect)
    config.collect.max_new_tokens = 3
    config.collect.min_score_diff = 0.5
    return config


def test_load_workflow_errors_are_clear():
    with pytest.raises(ValueError, match="cannot import no_such_module"):
        load_workflow("no_such_module:X")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        load_workflow("tests.helpers.plugin_workflow:Nope")
    with pytest.raises(ValueError, match="bad collect.workflow_kwargs"):
        load_workflow(PLUGIN, {"unknown": 1})
    with pytest.raises(ValueError, match="registered name"):
        load_workflow("whatever")


def test_builtin_workflow_is_known_without_installed_entry_points(monkeypatch):
    """A source checkout on PYTHONPATH (no installed entry points) still has tic-tac-toe and its
    collect.tictactoe.* keys; an installed package's entry points add to them."""
    import importlib.metadata

    from dpojax.collect import workflow

    monkeypatch.setattr(workflow, "entry_points", lambda group: [])
    assert workflow.registered_workflows() == workflow.BUILTIN_WORKFLOWS
    assert default_config().collect.tictactoe.games == 64
    assert type(load_workflow("tictactoe")).__name__ == "TicTacToeWorkflow"
    monkeypatch.setattr(
        workflow,
        "entry_points",
        lambda group: [importlib.metadata.EntryPoint("mine", PLUGIN, group)],
    )
    assert set(workflow.registered_workflows()) == {"tictactoe", "mine"}


@pytest.mark.slow
def test_user_workflow_runs_end_to_end_in_collect_mode(tmp_path):
    stats = collection.collect(frozen(_config()), tmp_path)
    assert stats["num_events"] > 0 and stats["num_pairs"] > 0
    events = (tmp_path / "events.jsonl").read_text().splitlines()
    pairs = [json.loads(x) for x in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert len(events) == stats["num_events"] and len(pairs) == stats["num_pairs"]
    assert all(len(p["chosen"]) > len(p["rejected"]) for p in pairs)  # scored by length
    progress = [
        json.loads(x)
        for x in (tmp_path / "data_collection_progress.jsonl").read_text().splitlines()
    ]
    assert list(progress[0]) == [
        "run_number",
        "timestamp",
        "run_id",
        "num_trajectories",
        "num_dpo_pairs",
        "avg_reward",
        "min_reward",
        "max_reward",
    ]


def test_collection_errors_follow_nat():
    workflow = load_workflow(PLUGIN, {"fail_runs": [1]})

    def generate(prompts, k):
        return [[f"{'x' * (j + 1)}" for j in range(k)] for _ in prompts]

    events, runs = run_collection(
        workflow, generate, num_runs=3, round_index=1, seed=0, continue_on_collection_error=True
    )
    assert [r["status"] for r in runs] == ["completed", "failed", "completed"]
    assert "simulated failure" in runs[1]["error"] and len(events) == 2 * 2 * 4
    with pytest.raises(CollectionError, match="Data collection failed at run 2: simulated"):
        run_collection(
            workflow,
            generate,
            num_runs=3,
            round_index=1,
            seed=0,
            continue_on_collection_error=False,
        )
    always = load_workflow(PLUGIN, {"fail_runs": [0]})
    with pytest.raises(CollectionError, match="No trajectories collected"):
        run_collection(
            always, generate, num_runs=1, round_index=1, seed=0, continue_on_collection_error=True
        )


@pytest.mark.slow
def test_loop_mode_trains_rounds_and_keeps_the_best(tmp_path, caplog):
    config = _config()
    config.loop.rounds = 3  # the gate, met by every round, stops the loop after 2
    config.loop.gate, config.loop.gate_rounds = "mean_length>=0", 2
    config.loop.best_metric = "mean_length"
    config.loop.replay_rounds = -1
    config.loop.keep_round_files = True  # tests/unit/jobs/test_loop_resume.py checks the pruning
    config.train.epochs = 1
    config.train.batch_size = 8
    config.optim.learning_rate = 1e-3
    config.data.max_length = 32
    with caplog.at_level("INFO", logger="dpojax.jobs.rounds"):
        out = rounds.loop(frozen(config), tmp_path)
    assert [r["round"] for r in out["rounds"]] == [0, 1, 2]
    assert out["stop_reason"] == "gate_rounds"
    gate = out["gate"]
    assert (gate["conditions"], gate["met_rounds"], gate["first_met_round"]) == (
        "mean_length>=0",
        [1, 2],
        1,
    )
    assert gate["first_met_seconds"] == out["rounds"][1]["elapsed_seconds"] <= out["wall_seconds"]
    phases = {"collection", "pairs", "setup", "tokenization", "compile", "training"}
    phases |= {"checkpoint", "export", "evaluation"}
    for record in out["rounds"][1:]:
        assert set(record["phase_seconds"]) == set(record["phase_cpu_seconds"]) == phases
        assert 0 < sum(record["phase_seconds"].values()) <= record["seconds"]
        assert record["cpu_seconds"] > 0 and record["gate_met"] is True
    # two prompts evaluated in every round; each round says how many answers changed
    assert [r["greedy_answers"]["compared"] for r in out["rounds"][1:]] == [2, 2]
    lines = [m for m in caplog.messages if m.startswith(("round 1", "round 2"))]
    assert any("greedy answers changed since round 1" in m for m in lines)
    assert any(m.startswith("round 2 took") and "evaluation" in m for m in lines)
    assert (tmp_path / "export" / "config.json").is_file()
    assert (tmp_path / "round_01" / "train" / "export" / "model.safetensors").is_file()
    # round 1 checks that its step fits; round 2 takes that decision without compiling again
    fits = [
        json.loads((tmp_path / f"round_0{r}" / "train" / "summary.json").read_text())["auto_fit"]
        for r in (1, 2)
    ]
    assert "reused" not in fits[0] and fits[1]["reused"] and fits[1]["line"] == fits[0]["line"]
    # round 2 trains on its own pairs and round 1's (deduplicated)
    counts = {
        name: len((tmp_path / "round_02" / name).read_text().splitlines())
        for name in ("pairs.jsonl", "train_pairs.jsonl")
    }
    round1 = len((tmp_path / "round_01" / "pairs.jsonl").read_text().splitlines())
    assert counts["pairs.jsonl"] <= counts["train_pairs.jsonl"] <= counts["pairs.jsonl"] + round1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) >= {"initial", "final", "wall_seconds", "rounds"}
    assert (tmp_path / "report.md").is_file() and (
        tmp_path / "plots" / "quality_per_round.png"
    ).is_file()
    final_metrics = json.loads((tmp_path / "final_metrics.json").read_text())
    assert final_metrics["status"] == "completed" and final_metrics["num_collection_runs"] == 2


def _two_rounds_of_pairs():
    """Round 1: pairs p0..p19; round 2: p15..p49 (p15..p19 collected in both rounds)."""
    from dpojax.data.pairs import PreferencePair

    def pair(i):
        return PreferencePair(prompt=f"p{i}", chosen="a", rejected="b", metadata={})

    return [[pair(i) for i in range(20)], [pair(i) for i in range(15, 50)]]


@pytest.mark.parametrize(
    "max_train_pairs, whole_batches, expected",
    [
        (0, False, 50),  # every distinct pair
        (0, True, 48),  # 6 whole batches of 8
        (30, False, 30),
        (30, True, 24),
        (7, True, 7),  # less than one batch: kept as it is
    ],
)
def test_training_pairs_cap_and_whole_batches(max_train_pairs, whole_batches, expected):
    per_round = _two_rounds_of_pairs()
    config = _config()
    config.loop.replay_rounds = -1
    config.train.batch_size = 8
    config.loop.max_train_pairs = max_train_pairs
    config.loop.whole_batches = whole_batches
    pairs = rounds._training_pairs(config, per_round, 2)
    assert len(pairs) == expected
    assert len({p.prompt for p in pairs}) == expected  # deduplicated: distinct prompts
    assert {p.prompt for p in pairs} <= {f"p{i}" for i in range(50)}
    again = rounds._training_pairs(config, per_round, 2)
    assert [p.prompt for p in again] == [p.prompt for p in pairs]  # seeded


@pytest.mark.slow
def test_loop_stops_at_the_wall_clock_budget(tmp_path):
    config = _config()
    config.loop.rounds = 3
    config.loop.max_wall_seconds = 1e-3  # round 1 always runs; no later round fits
    config.train.batch_size = 8
    config.data.max_length = 32
    out = rounds.loop(frozen(config), tmp_path)
    assert [r["round"] for r in out["rounds"]] == [0, 1]
    assert out["stop_reason"] == "max_wall_seconds"
    assert not (tmp_path / "round_02").exists()
    assert (tmp_path / "export" / "config.json").is_file()
    assert json.loads((tmp_path / "summary.json").read_text())["stop_reason"] == "max_wall_seconds"


def test_replay_without_cross_round_dedup_weighs_pairs_by_rounds_seen():
    per_round = _two_rounds_of_pairs()
    config = _config()
    config.loop.replay_rounds = -1
    config.loop.replay_dedup = False
    pairs = rounds._training_pairs(config, per_round, 2)
    assert len(pairs) == 55  # p15..p19 twice
    counts = {f"p{i}": 2 if 15 <= i < 20 else 1 for i in range(50)}
    assert {p.prompt: [q.prompt for q in pairs].count(p.prompt) for p in pairs} == counts
    config.loop.replay_rounds = 0  # this round only: nothing to weigh
    assert len(rounds._training_pairs(config, per_round, 2)) == 35


def test_round_rank_orders_by_several_metrics():
    from dpojax.collect.workflow import RoundRank

    rank = RoundRank("losses_total, optimal_move_rate", "min,max")
    rounds = [
        {"losses_total": 2, "optimal_move_rate": 0.97},
        {"losses_total": 0, "optimal_move_rate": 0.91},
        {"losses_total": 0, "optimal_move_rate": 0.95},
        {"losses_total": 1, "optimal_move_rate": 0.99},
    ]
    assert max(range(4), key=lambda i: rank(rounds[i])) == 2
    assert rank({"optimal_move_rate": 0.9}) is None  # a metric missing
    assert RoundRank("accuracy", "max")({"accuracy": 0.5}) == (0.5,)
    assert RoundRank("a,b", "min")({"a": 1, "b": 2}) == (-1.0, -2.0)  # one mode for all
    for metrics, modes in (("a,b", "min,max,max"), ("a", "best"), ("a,,b", "max")):
        with pytest.raises(ValueError, match="loop.best_mode"):
            RoundRank(metrics, modes)


def test_gate_conditions():
    gate = Gate("optimal_move_rate>=0.95, illegal_move_rate<=0,losses_total<1e-9")
    assert str(gate) == "optimal_move_rate>=0.95,illegal_move_rate<=0,losses_total<1e-09"
    good = {"optimal_move_rate": 0.95, "illegal_move_rate": 0.0, "losses_total": 0}
    assert gate.met(good) and gate.unmet(good) == []
    bad = {**good, "optimal_move_rate": 0.9371, "losses_total": 2}
    assert not gate.met(bad)
    assert gate.unmet(bad) == [
        "optimal_move_rate 0.9371 (needs >=0.95)",
        "losses_total 2 (needs <1e-09)",
    ]
    assert gate.missing({"losses_total": 0}) == ["optimal_move_rate", "illegal_move_rate"]
    assert not Gate("") and not Gate("").met(good)
    assert Gate("a==1").met({"a": 1}) and not Gate("a>1").met({"a": 1})
    for spec in ("optimal_move_rate=>0.9", "rate>=", ">=1", "a>=1,,b<2"):
        with pytest.raises(ValueError, match="is not METRIC OP NUMBER"):
            Gate(spec)


def test_loop_config_errors_name_the_keys():
    from dpojax.config import validate

    config = default_config()
    config.mode = "loop"
    config.collect.workflow = "tictactoe"
    config.loop.best_metric = "losses_total,optimal_move_rate"
    config.loop.best_mode = "min,max,max"
    config.collect.tictactoe.explore = 1.5
    config.collect.tictactoe.min_candidates = 0
    errors = "\n".join(validate(config))
    assert "'loop.best_metric' / 'loop.best_mode'" in errors
    assert "'collect.tictactoe.explore' must be a probability" in errors
    assert "'collect.tictactoe.min_candidates' must be >= 1" in errors
    config.loop.gate = "losses_total=0"
    config.loop.gate_rounds = -1
    errors = validate(config)
    assert "config key 'loop.gate': condition 'losses_total=0' is not METRIC OP NUMBER" in str(
        errors
    )
    config.loop.gate = ""
    assert "config key 'loop.gate_rounds' must be >= 0" in str(validate(config))
    config.loop.gate_rounds = 2
    assert "config key 'loop.gate_rounds' needs 'loop.gate'" in str(validate(config))
    config.loop.gate = "losses_total<=0"
    config.loop.best_mode = "min,max"
    config.collect.tictactoe.explore = 0.25
    config.collect.tictactoe.min_candidates = 2
    assert not [e for e in validate(config) if "loop." in e or "tictactoe" in e]


def _events(scores_per_turn):
    """TTC events: turn i has one candidate per score, candidate k answering f"t{i}-c{k}"."""
    from dpojax.data.events import TTCEvent

    return [
        TTCEvent(
            example_id="run",
            turn_id=str(i),
            candidate_index=k,
            input=f"prompt {i}",
            output=f"t{i}-c{k}",
            score=score,
            name="dpo_candidate_move",
        )
        for i, scores in enumerate(scores_per_turn)
        for k, score in enumerate(scores)
    ]


def test_a_rounds_events_are_labelled_by_data_unpaired_and_round_trip(tmp_path):
    """With an unpaired loss a round labels its TTC events (threshold: single-candidate turns
    count; top_k: by rank), caps them by collect.max_pairs (seeded) and writes unpaired.jsonl,
    which reads back as the same examples; replay deduplicates across rounds."""
    from dpojax.data.unpaired import read_unpaired, write_unpaired
    from dpojax.jobs.rounds.examples import dedup_examples, label_events

    config = _config()
    config.loss.type = "kto"
    events = _events([[1.0, 0.2, 0.7], [0.9], [0.1]])
    config.data.unpaired.threshold = 0.7
    examples, counts = label_events(config, events, 1)
    assert [(e.completion, e.label) for e in examples] == [
        ("t0-c0", True),
        ("t0-c1", False),
        ("t0-c2", True),
        ("t1-c0", True),
        ("t2-c0", False),
    ]
    assert (counts["num_examples"], counts["num_desirable"], counts["num_undesirable"]) == (5, 3, 2)
    assert counts["unpaired"]["single_candidate"] == 2
    config.data.unpaired.top_k = 1  # the best and the worst of each turn; single ones left out
    examples, counts = label_events(config, events, 1)
    assert [(e.completion, e.label) for e in examples] == [("t0-c0", True), ("t0-c1", False)]
    assert counts["unpaired"]["unlabelled"] == 3
    config.data.unpaired.top_k, config.collect.max_pairs = 0, 2
    examples, counts = label_events(config, events, 1)
    assert counts["num_examples"] == 2
    assert examples == label_events(config, events, 1)[0]  # seeded
    path = write_unpaired(examples, tmp_path / "unpaired.jsonl")
    assert read_unpaired(path, strict=True)[0] == examples
    config.collect.max_pairs, config.loop.replay_rounds = 0, -1
    one, _ = label_events(config, events, 1)
    # round 2 relabels t0-c0 and t1-c0 (undesirable now): the evidence contradicts itself, so
    # replay drops every copy of them
    two, _ = label_events(config, _events([[0.1], [0.5, 0.9]]), 2)
    replayed = rounds._training_pairs(config, [one, two], 2, dedup_examples)
    assert [(e.completion, e.label) for e in replayed] == [
        ("t1-c1", True),
        ("t0-c1", False),
        ("t0-c2", True),
        ("t2-c0", False),
    ]


@pytest.mark.slow
def test_loop_mode_trains_kto_on_its_rounds_labelled_events(tmp_path):
    """loss.type kto in loop mode: each round writes unpaired.jsonl from its events (top 1 /
    bottom 1 per prompt here) and trains on it and the earlier round's (train_unpaired.jsonl)."""
    config = _config()
    config.loss.type = "kto"
    config.data.unpaired.top_k = 1
    config.loop.rounds = 2  # two rounds of training after the initial evaluation
    config.loop.best_metric = "mean_length"
    config.loop.replay_rounds = -1
    config.loop.keep_round_files = True
    config.train.batch_size = 8  # one row per device; a round's few examples are padded
    config.data.max_length = 32
    out = rounds.loop(frozen(config), tmp_path)
    assert [r["round"] for r in out["rounds"]] == [0, 1, 2]
    lines = {}
    for r in (1, 2):
        folder = tmp_path / f"round_0{r}"
        lines[r] = [json.loads(x) for x in (folder / "unpaired.jsonl").read_text().splitlines()]
        assert out["rounds"][r]["num_examples"] == len(lines[r]) > 0
        for record in lines[r]:  # the longest answer of a prompt is the desirable one
            scores = [x["metadata"]["score"] for x in lines[r] if x["prompt"] == record["prompt"]]
            assert record["label"] == (record["metadata"]["score"] == max(scores))
        summary = json.loads((folder / "train" / "summary.json").read_text())
        assert summary["status"] == "completed"
        assert math.isfinite(out["rounds"][r]["train_loss"])
    trained = (tmp_path / "round_02" / "train_unpaired.jsonl").read_text().splitlines()
    assert len(lines[2]) <= len(trained) <= len(lines[1]) + len(lines[2])
    assert not (tmp_path / "round_02" / "train_pairs.jsonl").exists()
