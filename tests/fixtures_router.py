"""Fixtures for the router tests (registered in conftest.pytest_plugins)."""
