"""Preference losses (public entry point); implemented in `dpojax.train.losses`."""

from dpojax.train.losses import (  # noqa: F401
    F_DIVERGENCE_TYPES,
    LOSS_TYPES,
    finalize_metrics,
    preference_loss,
)
