"""Every record shape dpojax reads is tokenized exactly as TRL 1.16's DPOTrainer tokenizes it:
the same token ids and the same completion masks, for a plain tokenizer (no chat template) and
for chat-template tokenizers (a minimal one and a ChatML-style one with tools, tool calls and an
`enable_thinking` switch). The reference is TRL's own preprocessing (`DPOTrainer._prepare_dataset`:
prompt extraction, EOS, chat templates, prompt/completion split) and its collator
(`DataCollatorForPreference`: the sequences and completion masks the loss sees)."""

from __future__ import annotations

import copy
import json
import types

import pytest

from dpojax.data.pair_files import pair_from_record, read_pairs
from dpojax.data.shapes import RecordShape, extract_prompt
from dpojax.data.tokenize import tokenize_pairs
from dpojax.models.tiny import build_tokenizer

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
pytestmark = pytest.mark.slow  # TRL's own tokenization runs in every test
pytest.importorskip("torch")

# A ChatML-style template written for these tests: tools in a system block, assistant tool calls,
# tool results, reasoning, and `enable_thinking=False` adding an empty thought block to the
# generation prompt only (so the prompt alone renders differently from prompt + completion, as
# Qwen3's and Gemma's templates do).
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|>\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}<|end|>\n{% endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}<|assistant|>\n"
    "{%- if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif -%}"
    "{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>{{ call.function.name }} "
    "{{ call.function.arguments | tojson }}</tool_call>{% endfor -%}<|end|>\n"
    "{%- elif message.role == 'tool' -%}<|user|>\n<tool_response>{{ message.content }}"
    "</tool_response><|end|>\n"
    "{%- else -%}<|{{ message.role }}|>\n{{ message.content }}<|end|>\n{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think></think>{% endif -%}"
    "{%- endif -%}"
)

USER = {"role": "user", "content": "Which cell wins for X?"}
SYSTEM = {"role": "system", "content": "You play tic-tac-toe."}


def _assistant(text):
    return {"role": "assistant", "content": text}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "board",
            "description": "Show the board",
            "parameters": {"type": "object", "properties": {"game": {"type": "string"}}},
        },
    }
]
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"type": "function", "function": {"name": "board", "arguments": {"game": "g1"}}}
    ],
}
RESULT = {"role": "tool", "content": "X.O\n.X.\n..O"}

SHAPES = {
    "explicit_plain": [
        {"prompt": "Board X.O .X. ..O. Your move:", "chosen": " 9", "rejected": " 3"},
        {"prompt": "The best play is", "chosen": " the center", "rejected": " a corner, then"},
    ],
    "implicit_plain": [  # Anthropic/hh-rlhf
        {
            "chosen": "\n\nHuman: Which cell wins?\n\nAssistant: The center wins.",
            "rejected": "\n\nHuman: Which cell wins?\n\nAssistant: No cell can win.",
        },
        {
            "chosen": "\n\nHuman: Your move?\n\nAssistant: I play five.",
            "rejected": "\n\nHuman: Your move?\n\nAssistant: I play seven now.",
        },
    ],
    "explicit_conversational": [
        {"prompt": [SYSTEM, USER], "chosen": [_assistant("9")], "rejected": [_assistant("3")]},
        {"prompt": [USER], "chosen": [_assistant("the center")], "rejected": [_assistant("a")]},
    ],
    "implicit_conversational": [  # full conversations, the prompt their shared leading turns
        {
            "chosen": [USER, _assistant("Five."), USER, _assistant("Then nine.")],
            "rejected": [USER, _assistant("Five."), USER, _assistant("Then one, I think.")],
        },
        {
            "chosen": [SYSTEM, USER, _assistant("Nine.")],
            "rejected": [SYSTEM, USER, _assistant("3")],
        },
    ],
    "multi_turn_tools": [  # completions of several messages: a tool call, its result, an answer
        {
            "prompt": [USER],
            "chosen": [CALL, RESULT, _assistant("Nine wins the game.")],
            "rejected": [_assistant("Cell one.")],
            "tools": json.dumps(TOOLS),
        },
        {
            "prompt": [SYSTEM, USER],
            "chosen": [
                {"role": "assistant", "content": "Nine.", "reasoning_content": "X holds 1 and 5."}
            ],
            "rejected": [CALL, RESULT, _assistant("Three.")],
            "tools": json.dumps(TOOLS),
        },
    ],
    "template_kwargs": [  # per-record chat template arguments (TRL's chat_template_kwargs)
        {
            "prompt": [USER],
            "chosen": [_assistant("Nine.")],
            "rejected": [_assistant("Three.")],
            "chat_template_kwargs": {"enable_thinking": False},
        },
        {
            "prompt": [SYSTEM, USER],
            "chosen": [_assistant("The center.")],
            "rejected": [_assistant("One.")],
            "chat_template_kwargs": {"enable_thinking": True},
        },
    ],
}
CONVERSATIONAL = {"explicit_conversational", "implicit_conversational", "multi_turn_tools"}
CONVERSATIONAL |= {"template_kwargs"}


def _tokenizer(kind: str):
    tok = build_tokenizer()
    if kind == "plain":
        tok.chat_template = None
    elif kind == "tools":
        tok.chat_template = TOOL_TEMPLATE
    return tok


def _trl_rows(records, tok) -> list[dict]:
    """TRL's sequences and completion masks: its dataset preprocessing, then its collator."""
    from trl import DPOConfig
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    args = DPOConfig(output_dir="unused", max_length=None, report_to=[], bf16=False, use_cpu=True)
    dataset = datasets.Dataset.from_list(copy.deepcopy(records))
    prepared = DPOTrainer._prepare_dataset(
        types.SimpleNamespace(_tokenizer=tok), dataset, tok, args, "train"
    )
    rows = []
    for example in prepared:
        batch = DataCollatorForPreference(pad_token_id=tok.pad_token_id)([example])
        n_c = len(example["prompt_ids"]) + len(example["chosen_ids"])
        n_r = len(example["prompt_ids"]) + len(example["rejected_ids"])
        rows.append(
            {
                "chosen": batch["input_ids"][0, :n_c].tolist(),
                "chosen_mask": batch["completion_mask"][0, :n_c].tolist(),
                "rejected": batch["input_ids"][1, :n_r].tolist(),
                "rejected_mask": batch["completion_mask"][1, :n_r].tolist(),
            }
        )
    return rows


def _dpojax_rows(records, tok, shape=None) -> list[dict]:
    # the rows as a datasets.Dataset hands them out (missing struct keys filled with None)
    rows = datasets.Dataset.from_list(copy.deepcopy(records)).to_list()
    pairs = [pair_from_record(row, shape=shape) for row in rows]
    result = tokenize_pairs(pairs, tok)
    assert len(result.pairs) == len(records), result
    return [
        {
            "chosen": p.sequence("chosen").tolist(),
            "chosen_mask": p.completion_mask("chosen").tolist(),
            "rejected": p.sequence("rejected").tolist(),
            "rejected_mask": p.completion_mask("rejected").tolist(),
        }
        for p in result.pairs
    ]


CASES = [
    (shape, kind)
    for shape in SHAPES
    for kind in (("minimal", "tools") if shape in CONVERSATIONAL else ("plain", "tools"))
    if not (shape in ("multi_turn_tools", "template_kwargs") and kind == "minimal")
]


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "kind"), CASES)
def test_token_ids_and_masks_equal_trl(shape, kind):
    tok = _tokenizer(kind)
    ours, theirs = _dpojax_rows(SHAPES[shape], tok), _trl_rows(SHAPES[shape], tok)
    assert ours == theirs
    assert all(sum(row["chosen_mask"]) and sum(row["rejected_mask"]) for row in ours)


def test_tool_calls_and_thinking_reach_the_template():
    tok = _tokenizer("tools")
    multi, kwargs = (_dpojax_rows(SHAPES[s], tok) for s in ("multi_turn_tools", "template_kwargs"))
    chosen = tok.decode(multi[0]["chosen"])
    assert '"name": "board"' in chosen and "<tool_call>board" in chosen
    assert "<tool_response>X.O" in chosen and "<think>X holds 1 and 5.</think>" in tok.decode(
        multi[1]["chosen"]
    )
    completion = [t for t, m in zip(multi[0]["chosen"], multi[0]["chosen_mask"], strict=True) if m]
    assert "<tool_response>" in tok.decode(completion)  # tool results are part of the completion
    # enable_thinking=False renders an empty thought block after the generation prompt only: the
    # completion starts where the prompt alone and prompt + completion diverge (as in TRL)
    off, on = kwargs
    assert "<think>" not in tok.decode(off["chosen"])
    for row in (off, on):
        start = row["chosen_mask"].index(1)
        assert tok.decode(row["chosen"][:start]).endswith(
            "Which cell wins for X?<|end|><|assistant|>"
        )


def test_column_mapping_and_system_prompt_equal_trl_on_the_renamed_records():
    tok = _tokenizer("tools")
    records = SHAPES["explicit_conversational"]
    renamed = [
        {"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in records
    ]
    shape = RecordShape.create({"prompt": "question", "chosen": "good", "rejected": "bad"})
    assert _dpojax_rows(renamed, tok, shape) == _trl_rows(records, tok)

    system = RecordShape.create(system_prompt="Answer with a cell number.")
    with_system = [
        {
            **r,
            "prompt": r["prompt"]
            if r["prompt"][0]["role"] == "system"
            else [{"role": "system", "content": "Answer with a cell number."}, *r["prompt"]],
        }
        for r in records
    ]
    assert _dpojax_rows(records, tok, system) == _trl_rows(with_system, tok)


def test_ultrafeedback_shape_reads_as_its_implicit_form():
    """HuggingFaceH4/ultrafeedback_binarized: a plain `prompt` column next to full conversations
    that start with it; tokenized as TRL tokenizes the conversations with the prompt extracted."""
    tok = _tokenizer("tools")
    records = [
        {
            "prompt": USER["content"],
            "chosen": [USER, _assistant("Nine.")],
            "rejected": [USER, _assistant("Three, maybe.")],
            "score_chosen": 8.0,
            "score_rejected": 3.0,
        }
    ]
    implicit = [{"chosen": r["chosen"], "rejected": r["rejected"]} for r in records]
    assert _dpojax_rows(records, tok) == _trl_rows(implicit, tok)
    pair = pair_from_record(records[0])
    assert pair.prompt == [USER] and pair.chosen == "Nine."


def test_extract_prompt_follows_trl():
    from trl.data_utils import extract_prompt as trl_extract

    cases = [
        ("Human: hi\n\nAssistant: yes", "Human: hi\n\nAssistant: no"),
        ("abc", "abcd"),  # one a prefix of the other
        ("same start, then A", "same start, then B"),
        ([USER, _assistant("a")], [USER, _assistant("b")]),
        ([SYSTEM, USER, _assistant("a")], [SYSTEM, USER, _assistant("a"), USER]),
    ]
    for chosen, rejected in cases:
        expected = trl_extract({"chosen": chosen, "rejected": rejected})
        assert extract_prompt(chosen, rejected) == (
            expected["prompt"],
            expected["chosen"],
            expected["rejected"],
        )


def test_shapes_from_files_and_a_datasets_folder(tmp_path):
    tok = _tokenizer("tools")
    records = SHAPES["implicit_conversational"] + SHAPES["multi_turn_tools"]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    pairs, summary = read_pairs(path, strict=True)
    assert summary.kept == 4 and summary.records == 4
    folder = tmp_path / "shards"
    folder.mkdir()
    for i, record in enumerate(SHAPES["implicit_plain"]):
        datasets.Dataset.from_list([record]).to_parquet(str(folder / f"train-{i:05d}.parquet"))
    from_folder, summary = read_pairs(folder, strict=True)
    assert [p.chosen for p in from_folder] == [" The center wins.", " five."]
    assert tokenize_pairs(pairs + from_folder, tok).num_dropped == 0


def test_chat_template_setting_from_text_file_or_json(tmp_path):
    from dpojax.data.shapes import read_chat_template

    assert read_chat_template("") is None
    assert read_chat_template(TOOL_TEMPLATE) == TOOL_TEMPLATE
    (tmp_path / "t.jinja").write_text(TOOL_TEMPLATE)
    assert read_chat_template(str(tmp_path / "t.jinja")) == TOOL_TEMPLATE
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": TOOL_TEMPLATE}))
    assert read_chat_template(str(tmp_path / "chat_template.json")) == TOOL_TEMPLATE
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template("no/such/template.jinja")
    (tmp_path / "plain.txt").write_text("no template here")
    with pytest.raises(ValueError, match="does not hold a Jinja template"):
        read_chat_template(str(tmp_path / "plain.txt"))


def test_config_template_kwargs_apply_and_a_record_s_own_win():
    """data.chat_template_kwargs reach every template call; a record's chat_template_kwargs
    override them (TRL reads only the record's)."""
    tok = _tokenizer("tools")
    tok.chat_template = (
        "{% if verbose is defined and verbose %}Be verbose.{% endif %}" + TOOL_TEMPLATE
    )
    base = SHAPES["explicit_conversational"][0]
    records = [base, {**base, "chat_template_kwargs": {"verbose": False}}]
    pairs = [pair_from_record(r) for r in records]
    result = tokenize_pairs(pairs, tok, chat_template_kwargs={"verbose": True})
    texts = [tok.decode(p.sequence("chosen")) for p in result.pairs]
    assert texts[0].startswith("Be verbose.") and not texts[1].startswith("Be verbose.")
    assert texts[1] == tok.decode(_dpojax_rows([base], tok)[0]["chosen"])
