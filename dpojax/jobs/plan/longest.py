"""The longest row of a plan (`plan.longest_row`): the recipe's step compiled at longer rows, one
pair per data-parallel group a step, to find the longest `data.max_length` whose step fits the
target (the plan's fit: the compiled memory against the chip's usable memory, or the compiler
running out of it).

The search doubles `data.max_length` from the recipe's until a step does not fit or the model's
`max_position_embeddings` is reached, then bisects between the last length that fit and the
first that did not on multiples of `lcm(2 * mesh.context, 128)` (every row length then divides
into the context axis's 2 * context chunks and into 128-token kernel blocks). Every compile's
figures are kept. docs/plan.md#the-longest-row.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

from dpojax import schema
from dpojax.config import Config

log = logging.getLogger(__name__)

# Row lengths are searched on multiples of this (and of 2 * mesh.context).
ROW_ALIGN = 128


def search_step(context: int) -> int:
    """The resolution of the bisection: the lengths it tries are multiples of this."""
    return math.lcm(2 * context, ROW_ALIGN)


def one_pair_config(config: Config, length: int, data_parallel: int) -> Config:
    """The recipe at `data.max_length = length` with the smallest step its mesh takes: one pair
    per data-parallel group (`data_parallel` pairs, one micro-batch), rows as the layout builds
    them (no `plan.rows` / `plan.row_length` padding, the default row lengths)."""
    return schema.replaced(
        config,
        {
            "data.max_length": length,
            "data.row_lengths": (),
            "plan.rows": 0,
            "plan.row_length": 0,
            "train.batch_size": data_parallel,
            "train.eval_batch_size": data_parallel,
            "train.grad_accum": 1,
        },
    )


def _figures(length: int, result: dict[str, Any]) -> dict[str, Any]:
    """One compile's row of the search: the length, the row the layout built, fit and memory."""
    train = result["train"]
    return {
        "max_length": length,
        "row_length": result["batch"]["row_length"],
        "rows": result["batch"]["rows"],
        "fits": result["fits"],
        "total_bytes": train.get("total_bytes"),
        "needed_bytes": train.get("needed_bytes"),
        "usable_bytes": train.get("usable_bytes") or train.get("available_bytes"),
        "compile_seconds": train.get("compile_seconds"),
    }


def longest_row(
    config: Config,
    candidate: Any,
    upper_bound: int,
    compile_one: Callable[[Config, Any], dict[str, Any]],
) -> dict[str, Any]:
    """The search (see the module docstring) for `candidate` (the recipe's configuration; its
    `mesh` is (data, fsdp, context, tensor)) up to `upper_bound` tokens a sequence;
    `compile_one(config, candidate)` compiles one configuration and returns the plan's figures of
    it (`plan.compile_candidate`). Returns the longest fitting length with its memory, the first
    length that does not fit, and every compile's figures in the order they ran."""
    data, fsdp, context, _ = candidate.mesh
    step = search_step(context)
    one = dataclasses.replace(candidate, grad_accum=1)
    compiles: dict[int, dict[str, Any]] = {}

    def fits(length: int) -> bool:
        log.info("longest row: compiling data.max_length=%d (try %d)", length, len(compiles) + 1)
        result = compile_one(one_pair_config(config, length, data * fsdp), one)
        compiles[length] = row = _figures(length, result)
        memory = row["total_bytes"] if row["total_bytes"] is not None else row["needed_bytes"]
        seconds = row["compile_seconds"]
        log.info(
            "longest row: data.max_length=%d %s (%s GiB/device, %s s to compile)",
            length,
            "fits" if result["fits"] else "does not fit",
            "?" if memory is None else f"{memory / 2**30:.2f}",
            "?" if seconds is None else f"{seconds:.0f}",
        )
        return result["fits"]

    bound = upper_bound // step * step  # the longest length the search tries but the recipe's
    good, bad = None, None
    length = config.data.max_length
    while True:  # doubling: the recipe's length, twice it, ... up to the bound
        if fits(length):
            good = length
        else:
            bad = length
            break
        if length >= bound:
            break
        length = min(2 * length, bound)
    if good is not None and bad is not None:  # bisection on multiples of `step`
        while True:
            middle = (good + bad) // 2 // step * step
            if middle <= good:
                break
            if fits(middle):
                good = middle
            else:
                bad = middle
    return _report(compiles, good, bad, step, upper_bound, data * fsdp)


def _report(compiles, good, bad, step, upper_bound, pairs) -> dict[str, Any]:
    best = compiles.get(good) or {}
    first = compiles.get(bad) or {}
    return {
        "pairs_per_step": pairs,
        "search_step": step,
        "upper_bound": upper_bound,
        "longest_max_length": good,
        "longest_row_length": best.get("row_length"),
        "memory_bytes": best.get("total_bytes"),
        "first_not_fitting_max_length": bad,
        "first_not_fitting_row_length": first.get("row_length"),
        "first_not_fitting_bytes": first.get("total_bytes") or first.get("needed_bytes"),
        "compiles": list(compiles.values()),
    }


def table(found: dict[str, Any]) -> list[str]:
    """The search's result and each compile, as text lines of the plan's table."""

    def gib(value):
        return "-" if value is None else f"{value / 2**30:.2f}"

    lines = [
        f"longest row ({found['pairs_per_step']} pairs a step, multiples of "
        f"{found['search_step']}, up to {found['upper_bound']} tokens):",
        f"  fits: data.max_length={found['longest_max_length']} (rows of "
        f"{found['longest_row_length']} tokens, {gib(found['memory_bytes'])} GiB/device); "
        f"first that does not: {found['first_not_fitting_max_length']} "
        f"({gib(found['first_not_fitting_bytes'])} GiB/device)",
    ]
    for c in found["compiles"]:
        memory = c["total_bytes"] if c["total_bytes"] is not None else c["needed_bytes"]
        lines.append(
            f"  {c['max_length']:>9} tokens  row {c['row_length']:>9}  "
            f"{'fits' if c['fits'] else 'NO':>4}  {gib(memory):>8} GiB"
        )
    return lines
