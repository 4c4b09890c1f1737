"""A disk cache of tokenized pairs: tokenize a dataset once, reuse it on every later run.

Tokenization bounds the first pass over a dataset (the fast tokenizer encodes ~2M tokens/s on two
cores), while building batches from token ids is an order of magnitude faster. A resumed run, a
second run with other hyper-parameters, or every host of a multi-host run reading the same file
would otherwise tokenize it again. `tokenize_pairs_cached` keys the result of `tokenize_pairs` by
everything it depends on and stores it as one `.npz` file:

- the pairs' texts (prompt, chosen, rejected; chat messages with every key), their tools and
  chat-template arguments, their turn keys (`tokenize.group_key`) and their dataset ids;
- the tokenizer: its full serialised form (vocabulary, merges, normaliser, pre-tokeniser, special
  tokens), its chat template and EOS token;
- `max_length`, `truncation_mode`, the chat-template arguments of the run and the cache format
  version.

So editing one character of the data, or swapping the tokenizer, misses the cache. Files are
written to a temporary name and renamed, so concurrent writers (several hosts sharing a workdir)
and a crash mid-write never leave a partial file under the final name; an unreadable cache file is
reported, ignored and rewritten. Only fast (Rust) tokenizers can be fingerprinted; with any other,
`tokenize_pairs_cached` tokenizes without caching and says so once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpojax.data.pairs import PreferencePair
from dpojax.data.tokenize import TokenizedPair, TokenizeResult, group_key, tokenize_pairs

logger = logging.getLogger("dpojax.data")

CACHE_VERSION = 2
_SEP = b"\x00\x1f"


def tokenizer_fingerprint(tokenizer: Any) -> str | None:
    """A digest of everything that decides the tokenizer's ids, or None when that cannot be known
    (a Python-only tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return None
    h = hashlib.blake2b(digest_size=20)
    h.update(type(tokenizer).__name__.encode())
    h.update(_SEP + backend.to_str().encode())
    template = getattr(tokenizer, "chat_template", None)
    h.update(_SEP + json.dumps(template, sort_keys=True, default=str).encode())
    h.update(_SEP + str(tokenizer.eos_token).encode())
    h.update(_SEP + json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()


def pairs_digest(pairs: Sequence[PreferencePair], pair_ids: Sequence[int]) -> str:
    """A digest of the pairs' texts, turn keys and ids, in order."""
    h = hashlib.blake2b(digest_size=20)
    update = h.update
    for pair, pid in zip(pairs, pair_ids, strict=True):
        for part in (pair.prompt, pair.chosen, pair.rejected):
            if isinstance(part, str):
                update(b"s" + part.encode("utf-8", "surrogatepass") + _SEP)
            else:
                update(b"m" + json.dumps(part, sort_keys=True, default=str).encode() + _SEP)
        if pair.tools is not None or pair.chat_kwargs is not None:
            extra = [pair.tools, pair.chat_kwargs]
            update(b"t" + json.dumps(extra, sort_keys=True, default=str).encode() + _SEP)
        update(repr(group_key(pair)).encode("utf-8", "surrogatepass"))
        update(_SEP + str(int(pid)).encode() + b"\x1e")
    return h.hexdigest()


def cache_key(
    pairs: Sequence[PreferencePair],
    pair_ids: Sequence[int],
    tokenizer_fp: str,
    *,
    max_length: int | None,
    truncation_mode: str,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    settings = json.dumps(
        {
            "version": CACHE_VERSION,
            "tokenizer": tokenizer_fp,
            "max_length": max_length,
            "truncation_mode": truncation_mode,
            "chat_template_kwargs": chat_template_kwargs or {},
            "n": len(pairs),
        },
        sort_keys=True,
        default=str,
    )
    h = hashlib.blake2b(settings.encode(), digest_size=16)
    h.update(pairs_digest(pairs, pair_ids).encode())
    return h.hexdigest()


def save_result(path: Path, result: TokenizeResult, pair_ids: Sequence[int]) -> None:
    """Writes `result` (whose pairs carry ids from `pair_ids`) to `path` atomically."""
    index = {int(pid): i for i, pid in enumerate(pair_ids)}
    kept = np.array([index[p.pair_id] for p in result.pairs], np.int64)
    lengths = np.array(
        [(len(p.prompt_ids), len(p.chosen_ids), len(p.rejected_ids)) for p in result.pairs],
        np.int64,
    ).reshape(-1, 3)
    prompt_lens = np.array(
        [(p.chosen_prompt_len, p.rejected_prompt_len) for p in result.pairs], np.int32
    ).reshape(-1, 2)
    parts = [x for p in result.pairs for x in (p.prompt_ids, p.chosen_ids, p.rejected_ids)]
    tokens = np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)
    meta = {
        "version": CACHE_VERSION,
        "dropped": result.dropped,
        "boundary_merges": result.boundary_merges,
        "truncated": result.truncated,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(
                f,
                tokens=tokens,
                lengths=lengths,
                prompt_lens=prompt_lens,
                kept=kept,
                meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
            )
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_result(
    path: Path, pairs: Sequence[PreferencePair], pair_ids: Sequence[int]
) -> TokenizeResult:
    """The `TokenizeResult` stored at `path` for these `pairs`; raises ValueError when the file
    is not a readable cache of this format."""
    try:
        with np.load(path, allow_pickle=False) as f:
            meta = json.loads(f["meta"].tobytes())
            tokens, lengths = f["tokens"], f["lengths"]
            prompt_lens, kept = f["prompt_lens"], f["kept"]
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable token cache ({type(e).__name__}: {e})") from e
    n = len(kept)
    if (
        meta.get("version") != CACHE_VERSION
        or lengths.shape != (n, 3)
        or prompt_lens.shape != (n, 2)
        or int(lengths.sum()) != len(tokens)
        or (n and (kept.min() < 0 or kept.max() >= len(pairs)))
    ):
        raise ValueError(f"{path}: token cache does not match its format (version {CACHE_VERSION})")
    pieces = np.split(tokens, np.cumsum(lengths.reshape(-1))[:-1]) if n else []
    out = []
    for i in range(n):
        j = int(kept[i])
        out.append(
            TokenizedPair(
                prompt_ids=pieces[3 * i],
                chosen_ids=pieces[3 * i + 1],
                rejected_ids=pieces[3 * i + 2],
                chosen_prompt_len=int(prompt_lens[i, 0]),
                rejected_prompt_len=int(prompt_lens[i, 1]),
                pair_id=int(pair_ids[j]),
                group=group_key(pairs[j]),
            )
        )
    return TokenizeResult(
        out,
        dropped={k: [int(x) for x in v] for k, v in meta["dropped"].items()},
        boundary_merges=int(meta["boundary_merges"]),
        truncated=int(meta["truncated"]),
    )


def tokenize_pairs_cached(
    pairs: Sequence[PreferencePair],
    tokenizer: Any,
    *,
    cache_dir: str | os.PathLike | None,
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
    pair_ids: Sequence[int] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[TokenizeResult, bool]:
    """`tokenize_pairs` through the cache in `cache_dir` (None: no cache).

    Returns (result, hit): the result equals `tokenize_pairs(pairs, tokenizer, ...)` exactly
    (same ids, prompt lengths, drops and counters); `hit` says whether it came from the cache.
    """
    ids = list(range(len(pairs))) if pair_ids is None else [int(x) for x in pair_ids]
    kwargs = dict(
        max_length=max_length,
        truncation_mode=truncation_mode,
        pair_ids=ids,
        chat_template_kwargs=chat_template_kwargs,
    )
    fp = tokenizer_fingerprint(tokenizer) if cache_dir is not None else None
    if fp is None:
        if cache_dir is not None:
            logger.info("token cache off: %s is not a fast tokenizer", type(tokenizer).__name__)
        return tokenize_pairs(pairs, tokenizer, **kwargs), False
    key = cache_key(
        pairs,
        ids,
        fp,
        max_length=max_length,
        truncation_mode=truncation_mode,
        chat_template_kwargs=chat_template_kwargs,
    )
    path = Path(cache_dir) / f"tokens-{key}.npz"
    if path.is_file():
        try:
            result = load_result(path, pairs, ids)
        except ValueError as e:
            logger.warning("%s; tokenizing again and rewriting it", e)
        else:
            if result.dropped or result.boundary_merges:
                logger.warning("tokenization (from the cache %s): %s", path.name, result)
            return result, True
    result = tokenize_pairs(pairs, tokenizer, **kwargs)
    try:
        save_result(path, result, ids)
    except OSError as e:  # a read-only or full disk costs the cache, not the run
        logger.warning("could not write the token cache %s: %s", path, e)
    return result, False
