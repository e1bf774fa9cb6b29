"""A sidecar whose S3 endpoint does not answer says so: /persist answers 502 with the S3
error (the operator puts it in status.checkpoint.persistError), not an anonymous 500."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from gemini_sidecar.app import Sidecar
from gemini_sidecar.config import S3Settings
from tests.integration.sidecar.conftest import (
    TOKEN,
    free_port,
    make_config,
    payload,
    write_local,
)

pytestmark = pytest.mark.integration


async def test_persisting_to_an_unreachable_s3_answers_502_naming_the_endpoint(
    tmp_path: Path,
) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    s3 = S3Settings(bucket="gone", prefix="p", endpoint_url=endpoint, access_key="k",
                    secret_key="s")
    car = Sidecar(make_config(0, 1, tmp_path, {0: free_port()}, s3=s3))
    await car.start()
    try:
        write_local(car.cfg, 3, payload(3, 4096))
        async with aiohttp.ClientSession() as http, http.post(
            f"http://127.0.0.1:{car.api_port}/persist", json={"version": 3},
            headers={"Authorization": f"Bearer {TOKEN.decode()}"},
        ) as resp:
            doc = await resp.json()
            assert resp.status == 502, doc
    finally:
        await car.stop()
    assert doc["error"].startswith("S3 request failed"), doc
    assert endpoint in doc["error"], doc
