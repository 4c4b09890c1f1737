"""dpojax: Direct Preference Optimization in JAX, fed by test-time-compute agent data."""

__version__ = "0.1.0"
