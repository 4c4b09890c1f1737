"""The assets of docs/benchmarks.md's fit-by-construction run: a random 19.8M-parameter Llama
(hidden 512, 6 layers, vocabulary 512) and 64 preference pairs whose sequences all run past
1,024 tokens (a 400-word prompt, 300-word completions), so that configs/train_pairs.py builds
1,024-token rows.

    python scripts/make_fit_assets.py /tmp/fit   # writes /tmp/fit/model and /tmp/fit/pairs.jsonl
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from dpojax.data.pair_files import write_pairs
from dpojax.data.pairs import PreferencePair
from dpojax.models.tiny import make_tiny_checkpoint

WORDS = ["good", "bad", "move", "board", "win", "draw", "play", "next", "the", "a", "x", "o"]


def main(out: Path) -> None:
    make_tiny_checkpoint(
        out / "model",
        "llama",
        seed=0,
        hidden_size=512,
        intermediate_size=1408,
        num_layers=6,
        num_heads=8,
        num_kv_heads=8,
    )
    rng = np.random.default_rng(0)

    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS, size=words))

    pairs = [
        PreferencePair(
            prompt=text(400), chosen=" " + text(300), rejected=" " + text(300), metadata={}
        )
        for _ in range(64)
    ]
    write_pairs(pairs, out / "pairs.jsonl", format="trl")
    print(f"wrote {out / 'model'} and {out / 'pairs.jsonl'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
