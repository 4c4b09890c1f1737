"""`python -m dpojax.customizer.server`: the documented alias of `python -m
dpojax.customizer_server`, the local Customizer-compatible server (its home since the server
became a wing of its own; this alias stays for one release)."""

from dpojax.customizer_server import *  # noqa: F403 - the names the old package exported
from dpojax.customizer_server import __all__, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
