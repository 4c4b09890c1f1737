"""dpojax: Direct Preference Optimization in JAX, fed by test-time-compute agent data."""

from dpojax.xla_env import apply_cpu_flags

__version__ = "0.1.0"

apply_cpu_flags()
