"""Fixtures for the cluster tests (registered in conftest.pytest_plugins)."""
