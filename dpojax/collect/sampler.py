"""`dpojax.collect.sampler`: the KV-cache sampler under the name it had before the package was
reorganised (its home is `dpojax.models.sampler`)."""

from dpojax.models.sampler import generate

__all__ = ["generate"]
