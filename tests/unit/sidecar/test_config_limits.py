"""The listeners' limits from the environment: defaults, overrides, refusals naming the fix."""

from __future__ import annotations

import pytest

from gemini_sidecar.config import ConfigError, ServerLimits, from_env
from tests.unit.sidecar.test_config import BASE


def test_the_limits_default_when_unset():
    assert from_env(BASE).limits == ServerLimits(
        header_timeout_s=10.0, read_timeout_s=30.0, max_connections=256,
        max_connections_per_host=32)


def test_the_limits_are_read_from_the_environment():
    env = dict(BASE, GEMINI_HEADER_TIMEOUT_S="2.5", GEMINI_READ_TIMEOUT_S="60",
               GEMINI_MAX_CONNECTIONS="1000", GEMINI_MAX_CONNECTIONS_PER_HOST="100")
    assert from_env(env).limits == ServerLimits(2.5, 60.0, 1000, 100)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"GEMINI_HEADER_TIMEOUT_S": "0"}, "GEMINI_HEADER_TIMEOUT_S must be between 0.1 and"),
        ({"GEMINI_HEADER_TIMEOUT_S": "nan"}, "GEMINI_HEADER_TIMEOUT_S must be between"),
        ({"GEMINI_READ_TIMEOUT_S": "soon"}, "GEMINI_READ_TIMEOUT_S must be a number"),
        ({"GEMINI_MAX_CONNECTIONS": "0"}, "GEMINI_MAX_CONNECTIONS must be between 1 and"),
        ({"GEMINI_MAX_CONNECTIONS": "10", "GEMINI_MAX_CONNECTIONS_PER_HOST": "20"},
         "GEMINI_MAX_CONNECTIONS_PER_HOST must be between 1 and 10"),
    ],
)
def test_bad_limits_are_refused_with_a_message_naming_the_fix(change, message):
    with pytest.raises(ConfigError, match=message):
        from_env(dict(BASE, **change))
