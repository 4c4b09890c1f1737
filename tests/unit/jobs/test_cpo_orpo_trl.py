"""Evaluation of `loss.type=cpo` (sigmoid, simpo) and `loss.type=orpo` by dpojax and by TRL 1.16's
experimental CPOTrainer / ORPOTrainer `.evaluate()` on the same tiny llama and the same 8
plain-text pairs, in one eval batch of 8 on both sides, float32, no training (issue 49's
must-show).

The two tokenizations are checked first: TRL's CPO/ORPO tokenize `prompt` and `prompt + answer`
without special tokens, prepend BOS and append EOS; dpojax tokenizes `prompt + answer + EOS` with
the tokenizer's own BOS, as TRL's DPOTrainer does. On these pairs (no token merge across the
prompt/completion boundary) the sequences and the completion tokens are equal, asserted below.

Compared within 1e-5 relative: the eval loss and TRL's `rewards/chosen`, `rewards/rejected`,
`rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`, `nll_loss` and ORPO's
`log_odds_ratio` and `log_odds_chosen`, under the same names on both sides (docs/trl.md,
docs/losses.md#metrics: for orpo and for cpo's averaged types dpojax logs the length-averaged
log-probs and beta (orpo: lambda) times them, as TRL does).

TRL's ORPOTrainer takes its NLL term over the chosen sequence's prompt *and* completion tokens
(`labels = input_ids` where attended); so does dpojax's orpo by default (`loss.orpo_nll_prompt`),
so orpo's `loss` and `nll_loss` are compared directly too; CPO's NLL covers the chosen completion
tokens only in both.
`logits/chosen` and `logits/rejected` are not compared: TRL's CPO/ORPO average the logits over
every position of the padded batch (prompt and padding included), dpojax's token metrics over the
scored completion tokens (docs/losses.md#metrics)."""

from __future__ import annotations

import json

import pytest

from dpojax import api

# TRL 1.16's trainers use transformers' deprecated gradient-checkpointing names.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:You are importing from 'trl.experimental'"),
]

PAIRS, BETA, GAMMA, ALPHA, LAMBDA, MAX_LENGTH, REL = 8, 0.1, 0.5, 1.0, 0.1, 64, 1e-5
CASES = {
    "cpo-sigmoid": dict(type="cpo", cpo_type="sigmoid", cpo_alpha=ALPHA),
    "cpo-simpo": dict(type="cpo", cpo_type="simpo", cpo_alpha=0.5),
    "orpo": dict(type="orpo"),
}
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "nll_loss",
)
ORPO_METRICS = ("log_odds_ratio", "log_odds_chosen")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from dpojax.models.tiny import make_tiny_checkpoint

    base = tmp_path_factory.mktemp("cpo_orpo_trl")
    model = make_tiny_checkpoint(base / "model", "llama", seed=0)
    rows = [
        {
            "prompt": f"{i} + {i + 3} =",
            "chosen": f" {2 * i + 3}",
            "rejected": f" {i * 7 % 10} and {i}" if i % 2 else f" {i + 1}",
        }
        for i in range(PAIRS)
    ]
    (base / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return base, model, rows


def _trl_trainer(model_dir, rows, out_dir, case: dict):
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = dict(
        output_dir=str(out_dir),
        per_device_eval_batch_size=PAIRS,
        max_length=MAX_LENGTH,
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        dataloader_num_workers=0,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    if case["type"] == "cpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        trainer_cls = CPOTrainer
        args = CPOConfig(
            loss_type=case["cpo_type"],
            beta=BETA,
            simpo_gamma=GAMMA,
            cpo_alpha=case["cpo_alpha"],
            **common,
        )
    else:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        trainer_cls = ORPOTrainer
        args = ORPOConfig(beta=LAMBDA, **common)
    torch.manual_seed(0)
    data = datasets.Dataset.from_list(rows)
    return trainer_cls(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        args=args,
        train_dataset=data,
        eval_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )


def _dpojax_config(base, model, case: dict):
    from tests.helpers.repo_files import load_file

    config = load_file("configs/tiny_test.py").get_config()
    config.model.path = str(model)
    config.model.dtype = "float32"
    config.data.eval_path = str(base / "pairs.jsonl")
    config.data.shuffle = False
    config.data.max_length = MAX_LENGTH
    config.loss.type = case["type"]
    if case["type"] == "cpo":
        config.loss.beta, config.loss.cpo_type = BETA, case["cpo_type"]
        config.loss.simpo_gamma, config.loss.cpo_alpha = GAMMA, case["cpo_alpha"]
    else:
        config.loss.orpo_lambda = LAMBDA
    config.train.batch_size = config.train.eval_batch_size = PAIRS
    config.train.report_plots = False
    config.mesh.data = -1
    config.export.enabled = False
    return config


def _assert_same_tokens(trainer, rows, model_dir) -> None:
    """TRL's tokenized eval rows: the same sequences and the same scored completion tokens as
    dpojax's tokenization of the pairs."""
    import numpy as np
    from transformers import AutoTokenizer

    from dpojax.data.pairs import PreferencePair
    from dpojax.data.tokenize import tokenize_pairs

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs = [PreferencePair(r["prompt"], r["chosen"], r["rejected"]) for r in rows]
    ours = tokenize_pairs(pairs, tokenizer, max_length=MAX_LENGTH)
    assert ours.boundary_merges == 0 and len(ours.pairs) == PAIRS
    for theirs, mine in zip(trainer.eval_dataset, ours.pairs, strict=True):
        for which in ("chosen", "rejected"):
            ids = theirs[f"{which}_input_ids"]
            assert ids == [int(t) for t in mine.sequence(which)]
            scored = np.asarray(theirs[f"{which}_labels"]) != -100
            assert scored.tolist() == np.asarray(mine.completion_mask(which), bool).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_evaluation_equals_trl_s_cpo_and_orpo_trainers(assets, tmp_path, name):
    """One evaluation each: TRL's `eval_*` metrics against dpojax's mode=evaluate metrics."""
    base, model, rows = assets
    case = CASES[name]
    trainer = _trl_trainer(model, rows, tmp_path / "trl", case)
    _assert_same_tokens(trainer, rows, model)
    trl = {k.removeprefix("eval_"): v for k, v in trainer.evaluate().items()}
    ours = api.evaluate(tmp_path / "dpojax", _dpojax_config(base, model, case))

    names = METRICS + (ORPO_METRICS if case["type"] == "orpo" else ())
    assert ours["loss"] == pytest.approx(trl["loss"], rel=REL)
    for metric in names:
        assert ours[metric] == pytest.approx(trl[metric], rel=REL, abs=1e-7), metric
