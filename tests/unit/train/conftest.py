"""The train tests' shared fixtures."""

import jax
import jax.numpy as jnp
import pytest


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    """Float dtype of the inputs; float64 runs with x64 enabled."""
    if request.param == "float64":
        with jax.enable_x64(True):
            yield jnp.float64
    else:
        yield jnp.float32
