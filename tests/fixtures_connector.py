"""Fixtures for the connector tests (registered in conftest.pytest_plugins)."""
