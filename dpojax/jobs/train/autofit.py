"""Fit by construction (`train.auto_fit`): before a training run loads its model or tokenizes a
pair, compile its step for the devices at hand (the plan's machinery, `mode=plan` with
`plan.target=local`) at the recipe's longest shapes and compare the compiled memory per device
(arguments, outputs and temporaries, the eval step's too) with what the run may use
(`dpojax.hardware.memory`). When it does not fit, the cheapest change that fits and keeps the
global batch is taken — more micro-batches, then a remat policy, then bfloat16 parameters
(`dpojax.train.fit` says which the config lets it change) — and one line says what changed and
why. A recipe that nothing fits is refused here, naming the smallest change that would fit (or,
when none does, what each try needed).

The decision is written to WORKDIR/auto_fit.json; a resumed run takes it from there without
compiling (its data position counts micro-batches of the first run's size). The steps compiled
for the decision are handed to the run (`auto_fit`'s `programs`, by `program_key`): where a batch of the
run lowers to the same program (the recipe's longest rows, the same step count) the run executes
them instead of compiling its step a second time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import jax

from dpojax import schema
from dpojax.config import Config
from dpojax.errors import ConfigProblem
from dpojax.hardware import memory
from dpojax.jobs import plan
from dpojax.models.hub import resolve_model_dir
from dpojax.train import hosts
from dpojax.train.batches import indivisible, micro_batch_pairs
from dpojax.train.fit import CHANGES, FitPolicy, full_key, parse_auto_fit

log = logging.getLogger(__name__)

RECORD = "auto_fit.json"
# Remat policies in the order of the memory they save (least first); bfloat16 parameters come
# with the most.
REMAT_LADDER = ("attention", "dots_no_batch", "dots", "full")


class DoesNotFit(ConfigProblem):
    """The recipe's step needs more memory than the devices have, and no allowed change fits."""


def _changes(base: plan.Candidate, candidate: plan.Candidate) -> dict[str, list]:
    """{key: [recipe value, new value]} of what `candidate` changes."""
    return {
        full_key(k): [getattr(base, k), getattr(candidate, k)]
        for k in CHANGES
        if getattr(base, k) != getattr(candidate, k)
    }


def _label(changes: dict[str, list]) -> str:
    return ", ".join(f"{k}={new}" for k, (_, new) in changes.items()) or "the recipe"


def ladder(config, base: plan.Candidate, policy: FitPolicy) -> list[plan.Candidate]:
    """The changes `policy` allows, cheapest first: twice the micro-batches while the batch
    splits into them (each micro-batch still divisible over the data-parallel devices); then, on
    the most micro-batches, each remat policy that saves more than the recipe's; then bfloat16
    parameters on top (and, last, bfloat16 parameters without the remat change)."""
    out, top = [], base
    data_parallel = base.mesh[0] * base.mesh[1]
    if policy.may_change("grad_accum", base.grad_accum):
        batch, accum = config.train.batch_size, base.grad_accum * 2
        while batch % accum == 0 and not indivisible(
            micro_batch_pairs(batch, accum), data_parallel, "pairs"
        ):
            top = dataclasses.replace(top, grad_accum=accum)
            out.append(top)
            accum *= 2
    accumulated = top
    if policy.may_change("remat", base.remat):
        start = REMAT_LADDER.index(base.remat) + 1 if base.remat in REMAT_LADDER else 0
        for remat in REMAT_LADDER[start:]:
            top = dataclasses.replace(top, remat=remat)
            out.append(top)
    if policy.may_change("param_dtype", base.param_dtype) and base.param_dtype == "float32":
        out.append(dataclasses.replace(top, param_dtype="bfloat16"))
        if top != accumulated:  # last: in case no remat rung compiles
            out.append(dataclasses.replace(accumulated, param_dtype="bfloat16"))
    return [dataclasses.replace(c, label=_label(_changes(base, c))) for c in out]


def step_bytes(figures: dict[str, Any]) -> float:
    """Memory per device of one compiled step (`plan`'s figures): XLA's peak where it counts
    everything, else arguments + outputs (less what they share) + temporaries, whichever is
    larger (the CPU's peak leaves the temporaries out); what the compiler said it needed when
    it refused the program; infinite when neither is known."""
    m = figures.get("memory_bytes")
    if m:
        return float(max(m["peak"], m["argument"] + m["output"] - m["alias"] + m["temp"]))
    return float(figures.get("needed_bytes") or float("inf"))


def needed_bytes(result: dict[str, Any]) -> float:
    """The most memory per device that a compiled candidate's steps (train, eval) need."""
    return max(step_bytes(result[name]) for name in ("train", "eval") if name in result)


def _usable(config) -> memory.Usable:
    found = memory.usable(jax.local_devices()[0], config.train.usable_memory_gib)
    if jax.process_count() > 1:  # every process takes the same decision: the tightest host's
        least = min(hosts.allgather_json(found.bytes))
        found = dataclasses.replace(found, bytes=least)
    return found


class _Search:
    """Compiles candidates (each once) and remembers what each needed and its executables."""

    def __init__(self, config, target: plan.Target, usable: memory.Usable):
        self.config, self.target, self.usable = config, target, usable
        self.needs: dict[str, float] = {}
        self.programs: dict[str, dict[str, Any]] = {}

    def _need(self, candidate: plan.Candidate) -> float:
        log.info("compiling %s for the local devices (train.auto_fit)", candidate.label)
        programs = self.programs.setdefault(candidate.label, {})
        try:
            return needed_bytes(
                plan.compile_candidate(self.config, self.target, candidate, programs=programs)
            )
        except Exception as e:  # noqa: BLE001 - a change that cannot compile is not taken
            if candidate.label == "the recipe":
                raise
            log.warning("auto-fit: %s does not compile (%s); not taken", candidate.label, e)
            return float("inf")

    def first_fit(self, candidates: list[plan.Candidate]) -> plan.Candidate | None:
        for candidate in candidates:
            if candidate.label not in self.needs:
                self.needs[candidate.label] = self._need(candidate)
            if self.needs[candidate.label] <= self.usable.bytes:
                return candidate
        return None


def _gib(n: float) -> str:
    """Bytes in GiB (MiB below 1 GiB, where two decimals of GiB say nothing)."""
    if n != float("inf") and n < 2**30:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**30:.2f} GiB"


def _refusal(search: _Search, base, fit: plan.Candidate | None, policy_text: str) -> DoesNotFit:
    need, usable = search.needs["the recipe"], search.usable
    head = (
        f"the train step needs {_gib(need)} per device and {_gib(usable.bytes)} is usable "
        f"({usable.source})"
    )
    if fit is not None:
        changes = _changes(base, fit)
        names = ",".join(k.split(".")[1] for k in changes)
        return DoesNotFit(
            f"{head}; the smallest change that fits is {fit.label} "
            f"({_gib(search.needs[fit.label])}), which train.auto_fit={policy_text} may not "
            f"make: set it, or let the check change it (--config.train.auto_fit={names})"
        )
    tried = "; ".join(
        f"{label}: {_gib(n) if n != float('inf') else 'did not compile'}"
        for label, n in search.needs.items()
    )
    return DoesNotFit(
        f"{head}, and no change of train.grad_accum, model.remat or model.param_dtype fits "
        f"({tried}); lower data.max_length or train.batch_size, use more devices, or set "
        "train.usable_memory_gib if the figure is wrong"
    )


def _apply(config: Config, changes: dict[str, list]) -> Config:
    return schema.replaced(config, {key: new for key, (_, new) in changes.items()})


def _decide(config: Config, policy: FitPolicy) -> tuple[dict[str, Any], dict[str, Any]]:
    """Compiles the recipe and, when it does not fit, the allowed changes; (the decision, the
    chosen candidate's compiled steps by program key)."""
    start = time.perf_counter()
    c = schema.replaced(config, {"plan.model_config": str(resolve_model_dir(config.model.path))})
    target = plan.resolve_target("local")
    usable = _usable(config)
    base = dataclasses.replace(plan.candidates(c, len(target.devices))[0], label="the recipe")
    search = _Search(c, target, usable)
    fit = search.first_fit([base]) or search.first_fit(ladder(c, base, policy))
    if fit is None:  # what would fit if the config let the check change everything
        anything = FitPolicy(True, tuple(CHANGES), explicit=True)
        fit = search.first_fit(ladder(c, base, anything))
        raise _refusal(search, base, fit, config.train.auto_fit)
    changes = _changes(base, fit)
    decision = {
        "changed": changes,
        "needed_bytes": search.needs[fit.label],
        "recipe_needed_bytes": search.needs["the recipe"],
        "usable_bytes": usable.bytes,
        "usable_source": usable.source,
        "compiles": len(search.needs),
        "tried": search.needs,
        "seconds": time.perf_counter() - start,
    }
    return decision, search.programs.get(fit.label, {})


def describe(decision: dict[str, Any]) -> str:
    """The one line a run prints about its fit."""
    usable = f"{_gib(decision['usable_bytes'])} usable, {decision['usable_source']}"
    if not decision["changed"]:
        return f"auto-fit: the recipe fits ({_gib(decision['needed_bytes'])} per device; {usable})"
    changes = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in decision["changed"].items())
    return (
        f"auto-fit: {changes}, because the recipe's step needs "
        f"{_gib(decision['recipe_needed_bytes'])} per device and {usable}; with the change it "
        f"needs {_gib(decision['needed_bytes'])} (same global batch of "
        f"{decision['batch_size']} pairs)"
    )


def auto_fit(
    config: Config,
    workdir: Path,
    *,
    resuming: bool,
    known: dict[str, Any] | None = None,
    programs: dict[str, Any] | None = None,
) -> tuple[Config, dict[str, Any] | None]:
    """(the config to train with, the decision recorded in summary.json or None when the check
    is off). A resumed run takes the first run's decision from WORKDIR/auto_fit.json; `known`,
    the decision of an earlier run of the same shapes (a loop's first round), is taken without
    compiling. The steps compiled for the decision go into `programs` (by `program_key`), for
    the run's `Stepper.adopt`."""
    policy = parse_auto_fit(config.train.auto_fit)
    record = workdir / RECORD
    if resuming:  # process 0's record (the workdir may be its alone)
        mine = (
            json.loads(record.read_text())
            if jax.process_index() == 0 and record.is_file()
            else None
        )
        decision = hosts.broadcast_json(mine)
        if decision is None:  # the first run did not check
            return config, None
        log.info("auto-fit: resuming with the first run's settings (%s)", record)
        return _apply(config, decision["changed"]), {**decision, "resumed": True}
    if not policy.enabled:
        return config, None
    if known is not None:
        decision = {k: v for k, v in known.items() if k != "resumed"}
        _record(record, decision)
        return _apply(config, decision.get("changed", {})), {**decision, "reused": True}
    try:
        decision, compiled = _decide(config, policy)
    except DoesNotFit:
        raise
    except Exception as e:  # noqa: BLE001 - a step the plan cannot build is not refused
        line = f"auto-fit: not checked, the plan cannot compile this recipe's step ({e})"
        log.warning("%s", line)
        return config, {"changed": {}, "skipped": line}
    decision["batch_size"] = config.train.batch_size
    line = describe(decision)
    (log.warning if decision["changed"] else log.info)("%s", line)
    decision["line"] = line
    _record(record, decision)
    if programs is not None:
        programs.update(compiled)
    return _apply(config, decision["changed"]), decision


def _record(record: Path, decision: dict[str, Any]) -> None:
    """WORKDIR/auto_fit.json (process 0): what a resumed run takes."""
    if jax.process_index() == 0:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(decision, indent=2))
