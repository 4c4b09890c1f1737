"""`dpojax.losses`: the preference losses under the name they had before the package was
reorganised (their home is `dpojax.train.losses`; docs/losses.md)."""

from dpojax.train.losses import (
    F_DIVERGENCE_TYPES,
    LOSS_TYPES,
    finalize_metrics,
    preference_loss,
    wpo_pair_weights,
)

__all__ = [
    "F_DIVERGENCE_TYPES",
    "LOSS_TYPES",
    "finalize_metrics",
    "preference_loss",
    "wpo_pair_weights",
]
