"""Shared pytest configuration: fixtures live in tests/fixtures/, one module per real part."""

pytest_plugins: list[str] = []
