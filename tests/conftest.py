"""Shared pytest configuration: fixtures live in tests/fixtures/, one module per real part."""

pytest_plugins: list[str] = [
    "tests.fixtures.cluster",
    "tests.fixtures.nodes",
    "tests.fixtures.s3",
    "tests.fixtures.operator",
    "tests.fixtures.trainers",
    "tests.fixtures.helm",
    "tests.fixtures.kwok",
    "tests.fixtures.isolated_nodes",
]
