"""What one checkpoint costs in S3, measured on the demo's own server: the S3-only baseline
of the paper's wasted-time model (checkpoint time, retrieval time)."""

from __future__ import annotations

import re
import time
from typing import Any

_STEP = re.compile(r"^(.*/)?step-(\d+)/")  # the step's directory, its number


def checkpoint_costs(s3: Any, bucket: str, prefix: str) -> tuple[float, float, int] | None:
    """(seconds to write, seconds to read back, bytes) of the newest persisted checkpoint
    under `prefix`, timed now against the same server; None when nothing was persisted."""
    listing = s3.list_objects_v2(Bucket=bucket, Prefix=prefix.rstrip("/") + "/")
    objects = listing.get("Contents", [])
    # Each job has its own directory (<prefix>/<namespace>/<job>/<uid>/step-<v>/): the
    # newest step's shards are those of one directory, never a mix of two jobs' objects.
    steps = {(int(m.group(2)), m.group(0)) for o in objects if (m := _STEP.match(o["Key"]))}
    if not steps:
        return None
    newest = max(steps)[1]
    shards = [o for o in objects if o["Key"].startswith(newest) and o["Key"].endswith(".bin")]
    if not shards:
        return None
    started = time.monotonic()
    payloads = [s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in shards]
    read_s = time.monotonic() - started
    scratch = f"{prefix.rstrip('/')}/cost-probe/"
    started = time.monotonic()
    for index, payload in enumerate(payloads):
        s3.put_object(Bucket=bucket, Key=f"{scratch}{index}.bin", Body=payload)
    write_s = time.monotonic() - started
    for index in range(len(payloads)):
        s3.delete_object(Bucket=bucket, Key=f"{scratch}{index}.bin")
    return write_s, read_s, sum(len(p) for p in payloads)
