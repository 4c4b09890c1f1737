"""dpojax: Direct Preference Optimization in JAX, fed by test-time-compute agent data.

Importing the package changes no global state; the command line (`dpojax.main`) applies its
runtime settings explicitly.
"""

__version__ = "0.1.0"
