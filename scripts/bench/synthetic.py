"""The benchmark's inputs, the same for both frameworks: a random Llama (dpojax `init_model`, exported
with `save_pretrained`), a word-level tokenizer whose vocabulary has exactly the model's size (token
id i is the word `w{i}`, so random token ids become text that tokenizes back to the same ids in both
pipelines), random token-level preference pairs, and the work a padded trainer computes on them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

MODELS = {
    "tiny": dict(
        hidden_size=256, num_layers=4, num_heads=4, intermediate_size=704, vocab_size=2048
    ),
    "medium": dict(  # ~21M parameters: the size of the fit-by-construction run's model
        hidden_size=512, num_layers=6, num_heads=8, intermediate_size=1408, vocab_size=2048
    ),
    "large": dict(
        hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048, vocab_size=8192
    ),
}
DENSE_LENGTHS = {
    "tiny": (64, 64),
    "medium": (128, 128),
    "large": (128, 128),
}  # (prompt, completion) tokens
SPECIAL = ("<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>")  # ids 0..3; word w{i} has id i >= 4
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_WORD = len(SPECIAL)


def word_tokenizer(vocab_size: int):
    """A fast word-level tokenizer: `w{i}` <-> id i, whitespace-split, BOS prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        model_max_length=1 << 20,
    )


def build_model_dir(path: Path, size: str, seed: int):
    """Writes the random model + tokenizer as a HF directory; returns its `ModelConfig`."""
    from dpojax.models import ModelConfig, init_model, save_pretrained

    dims = MODELS[size]
    config = ModelConfig(
        model_type="llama",
        num_kv_heads=dims["num_heads"],
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **dims,
    )
    save_pretrained(init_model(config, seed=seed), word_tokenizer(dims["vocab_size"]), path)
    return config


def _words(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(FIRST_WORD, vocab, size=n).tolist()


def dense_data(n_pairs: int, prompt: int, completion: int, vocab: int, seed: int) -> list[dict]:
    """Token-level pairs: `prompt` tokens with BOS, completions of `completion` tokens with EOS."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_pairs):
        p = _words(rng, prompt - 1, vocab)
        c, r = _words(rng, completion - 1, vocab), _words(rng, completion - 1, vocab)
        out.append(dict(prompt=p, chosen=c, rejected=r, turn=i))
    return out


def agent_data(n_pairs: int, candidates: int, vocab: int, seed: int) -> list[dict]:
    """TTC-like turns: a long prompt, `candidates` short completions, every pair of them."""
    rng = np.random.default_rng(seed)
    out: list[dict] = []
    turn = 0
    while len(out) < n_pairs:
        prompt_len = 512 + int(512 * rng.random() ** 2)  # 512..1024, more short than long
        p = _words(rng, prompt_len - 1, vocab)
        lengths = np.clip(np.rint(rng.lognormal(np.log(16), 0.6, candidates)), 8, 64)
        cands = [_words(rng, int(n) - 1, vocab) for n in lengths]
        for i in range(candidates):
            for j in range(i + 1, candidates):
                c, r = (i, j) if rng.random() < 0.5 else (j, i)
                out.append(dict(prompt=p, chosen=cands[c], rejected=cands[r], turn=turn))
        turn += 1
    return out[:n_pairs]


def benchmark_pairs(
    size: str, data: str, n_pairs: int, *, seq: int, candidates: int, seed: int
) -> list[dict]:
    """The `--data` pairs for model `size`: dense (`seq` tokens per sequence, or the model's dense
    lengths when 0) or agent-like (`candidates` completions per turn)."""
    vocab = MODELS[size]["vocab_size"]
    if data == "agent":
        return agent_data(n_pairs, candidates, vocab, seed)
    prompt, completion = DENSE_LENGTHS[size]
    if seq:
        prompt, completion = seq // 2, seq - seq // 2
    return dense_data(n_pairs, prompt, completion, vocab, seed)


def text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def pair_texts(pair: dict) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) text; each pipeline adds BOS and appends EOS itself."""
    return text(pair["prompt"]), " " + text(pair["chosen"]), " " + text(pair["rejected"])


def expected_sequences(pair: dict) -> tuple[list[int], list[int], int]:
    """(chosen sequence, rejected sequence, prompt length) in token ids."""
    prompt = [BOS_ID, *pair["prompt"]]
    return prompt + pair["chosen"] + [EOS_ID], prompt + pair["rejected"] + [EOS_ID], len(prompt)


def check_tokens(got: list[tuple[list[int], list[int], int]], data: list[dict], who: str):
    """Exits naming the first pair `who` tokenized differently from the benchmark's ids."""
    for i, (pair, (c, r, k)) in enumerate(zip(data, got, strict=True)):
        want_c, want_r, want_k = expected_sequences(pair)
        if c != want_c or r != want_r or k != want_k:
            raise SystemExit(f"{who}: pair {i} tokenized differently from the benchmark's ids")


def sequence_work(data: list[dict]) -> tuple[int, int, int]:
    """(tokens, causal attention pairs, scored tokens) of the pairs as 2 separate sequences each
    (what a padded trainer such as TRL computes, padding excluded)."""
    tokens = pairs = scored = 0
    for pair in data:
        for seq in ("chosen", "rejected"):
            n = 1 + len(pair["prompt"]) + len(pair[seq]) + 1
            tokens += n
            pairs += n * (n + 1) // 2
            scored += len(pair[seq]) + 1
    return tokens, pairs, scored
