"""The local Customizer server fixtures (tests/helpers/customizer.py) for `mode=submit` runs."""

from tests.helpers.customizer import server, start_server  # noqa: F401 - fixtures
