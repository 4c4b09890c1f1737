"""What `train.auto_fit` lets the fit check change (the check itself: `dpojax.jobs.train.autofit`).

    on     change what the config leaves at its default, cheapest first: more micro-batches
           (train.grad_accum), a remat policy (model.remat), bfloat16 parameters (model.param_dtype)
    off    no check: the run starts as configured
    grad_accum,remat
           a comma-separated list: only these, even where the config sets them

Every change keeps the global batch (train.batch_size) and so the run's updates: more
micro-batches give the same update, remat recomputes the same activations; bfloat16 parameters
are the one change that alters the numbers, and come last.
"""

from __future__ import annotations

import dataclasses

# Config keys the check may change, cheapest first, with their defaults (a value other than its
# default is the user's choice, which "on" keeps).
CHANGES = {
    "grad_accum": ("train", 1),
    "remat": ("model", "none"),
    "param_dtype": ("model", "float32"),
}


@dataclasses.dataclass(frozen=True)
class FitPolicy:
    """`enabled`: run the check; `keys`: the keys it may change; `explicit`: whether those may
    change even where the config sets them (a list) or only at their defaults ("on")."""

    enabled: bool
    keys: tuple[str, ...] = ()
    explicit: bool = False

    def may_change(self, key: str, value) -> bool:
        if not self.enabled or key not in self.keys:
            return False
        return self.explicit or value == CHANGES[key][1]


def parse_auto_fit(value: str) -> FitPolicy:
    """The policy of a `train.auto_fit` value; ValueError naming the accepted values."""
    text = str(value).strip().lower()
    if text in ("on", "true", "1", "yes"):
        return FitPolicy(True, tuple(CHANGES))
    if text in ("off", "false", "0", "no", ""):
        return FitPolicy(False)
    keys = tuple(k.strip() for k in text.split(","))
    unknown = [k for k in keys if k not in CHANGES]
    if unknown:
        raise ValueError(
            f"{value!r}: use on, off, or a comma-separated list of {', '.join(CHANGES)} "
            f"(unknown: {', '.join(unknown)})"
        )
    return FitPolicy(True, tuple(k for k in CHANGES if k in keys), explicit=True)


def full_key(key: str) -> str:
    return f"{CHANGES[key][0]}.{key}"
