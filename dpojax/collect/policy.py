"""A model + tokenizer as the candidate generator and greedy policy that workflows call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dpojax.data.records import Prompt
from dpojax.models.sampler import generate


class ModelPolicy:
    """Generates response texts for prompts (plain strings or chat messages) with the KV-cache
    sampler. Each call of `candidates` uses a new seed derived from `seed`, so rounds and runs
    draw fresh samples while the whole run stays reproducible."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_new_tokens: int = 4,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        distinct: bool = True,
        seed: int = 0,
        greedy_max_new_tokens: int | None = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens = max_new_tokens
        self.greedy_max_new_tokens = greedy_max_new_tokens or max_new_tokens
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.distinct = distinct
        self.seed = seed
        self.calls = 0

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def encode_all(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """`encode` of each prompt; plain strings in one batched call of the tokenizer."""
        if prompts and all(isinstance(p, str) for p in prompts):
            return [list(ids) for ids in self.tokenizer(list(prompts))["input_ids"]]
        return [self.encode(p) for p in prompts]

    def candidates(self, prompts: Sequence[Prompt], k: int) -> list[list[str]]:
        self.calls += 1
        results = generate(
            self.model,
            self.encode_all(prompts),
            n=k,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed * 100_003 + self.calls,
            distinct=self.distinct,
            tokenizer=self.tokenizer,
        )
        return [[c.text for c in cands] for cands in results]

    __call__ = candidates

    def greedy(self, prompts: Sequence[Prompt]) -> list[str]:
        results = generate(
            self.model,
            self.encode_all(prompts),
            n=1,
            max_new_tokens=self.greedy_max_new_tokens,
            temperature=0.0,
            tokenizer=self.tokenizer,
        )
        return [cands[0].text for cands in results]
