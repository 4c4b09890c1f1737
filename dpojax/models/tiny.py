"""Tiny models and a tiny tokenizer, built locally (no downloads), for tests and the default recipe.

`build_tokenizer()` trains a byte-level BPE tokenizer with the `tokenizers` library on a small
built-in corpus (deterministic), with Llama-style BOS handling and a chat template.
`tiny_config(family)` gives a small ModelConfig that exercises the features of each family, and
`make_tiny_checkpoint(path, family)` writes a random-weight HF directory.

    python -m dpojax.models.tiny --out runs/tiny-llama --family llama
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path

from dpojax.models.families import TINY_PRESETS
from dpojax.models.model_config import ModelConfig

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)
# A minimal chat format: <|bos|><|role|>\ncontent<|end|>\n ... ; generation prompt <|assistant|>\n
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_WORDS = (
    "the a an and or of to in on at for with from by is are was be it this that you your we our "
    "board move moves player players game games win wins draw loss lose turn next best play plays "
    "position square row column center corner edge empty mark marks opponent choose answer "
    "question agent tool step plan reason score candidate prompt response chosen rejected "
    "good bad better worse yes no true false one two three four five six seven eight nine zero"
).split()


def _corpus() -> list[str]:
    """A small deterministic corpus: English-like sentences, tic-tac-toe boards and digits."""
    lines = []
    for i, (a, b, c) in enumerate(itertools.product(_WORDS[:24], _WORDS[24:40], _WORDS[40:56])):
        if i % 7 == 0:
            lines.append(f"The {a} {b} {c}. You play {c} {b}, {a} {i}.")
    cells = "XO."
    for i, board in enumerate(itertools.product(cells, repeat=9)):
        if i % 37 == 0:
            rows = ["".join(board[r * 3 : r * 3 + 3]) for r in range(3)]
            lines.append("Board:\n" + "\n".join(rows) + f"\nYou are X. Your move: {i % 9 + 1}")
    lines.extend(str(n) for n in range(0, 1000, 3))
    return lines


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer (transformers fast tokenizer) trained on the built-in corpus.

    It adds BOS at the start of every encoded text (like Llama's), has EOS and PAD tokens distinct
    from each other, and a chat template with role tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


# Gemma's shared traits (head_dim 32 != hidden / heads, a query scale of its own).


def tiny_config(family: str = "llama", *, vocab_size: int = 512, **overrides) -> ModelConfig:
    """A small config per tiny preset (`TINY_FAMILIES`), each exercising its family's features:
    the presets are the `tiny` entries of the records in `dpojax.models.families`.
    """
    base = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=176,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family not in TINY_PRESETS:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {sorted(TINY_PRESETS)}")
    model_type, preset = TINY_PRESETS[family]
    return ModelConfig(**{**base, "model_type": model_type, **preset, **overrides})


# The tiny presets, one or more per family (`dpojax.models.families`).
TINY_FAMILIES = tuple(TINY_PRESETS)


def make_tiny_checkpoint(
    path: str | os.PathLike, family: str = "llama", *, seed: int = 0, tokenizer=None, **overrides
) -> Path:
    """Writes a random-weight HF directory (weights, config.json, tokenizer) for `family`."""
    from dpojax.models.hf import save_pretrained
    from dpojax.models.transformer import init_model

    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = tiny_config(family, vocab_size=len(tokenizer), **{**ids, **overrides})
    return save_pretrained(init_model(config, seed=seed), tokenizer, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory to write the HF checkpoint to")
    parser.add_argument("--family", default="llama", choices=TINY_FAMILIES)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import jax.numpy as jnp
    import numpy as np

    from dpojax.models.hf import from_pretrained

    path = make_tiny_checkpoint(args.out, args.family, seed=args.seed)
    model, tokenizer = from_pretrained(path)
    ids = tokenizer("Board:\nX.O\n.X.\n..O\nYou are X. Your move:")["input_ids"]
    logits = np.asarray(model(jnp.asarray([ids])))
    c = model.config
    print(
        f"wrote {path}: {c.model_type}, {c.num_params():,} parameters, vocab {c.vocab_size}, "
        f"{c.num_layers} layers, hidden {c.hidden_size}"
    )
    print(
        f"reloaded it: {len(ids)} prompt tokens -> logits {logits.shape}, "
        f"next token {tokenizer.decode([int(logits[0, -1].argmax())])!r}"
    )


if __name__ == "__main__":
    main()
