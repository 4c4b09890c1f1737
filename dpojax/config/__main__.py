"""`python -m dpojax.config`: prints docs/config.md, every key with its default and meaning."""

from dpojax.config.reference import reference_page

print(reference_page(), end="")
