from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.unit.control.server import Scripted, serve


@pytest.fixture
def scripted() -> Iterator[tuple[Scripted, int]]:
    """A scripted loopback server and its port."""
    script = Scripted()
    server, port = serve(script)
    try:
        yield script, port
    finally:
        server.shutdown()
        server.server_close()
