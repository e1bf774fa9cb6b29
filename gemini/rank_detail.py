"""Per-rank detail of a GeminiJob's status, kept beside the object once it is large.

A job's status carries maps with one entry per rank: where each shard's copies live
(placement.holders, .groups, .nodes), what each rank's trainer had done when the epoch
started (launch.trainerRestarts, .podUIDs), and where each rank restores from during a
recovery (recovery.plan.sources, .refetch). At 8,192 ranks they reach about 1 MiB, near etcd's
1.5 MiB object limit, and every status write would carry them. Beyond a size
(`--status-detail-inline-bytes`, 64 KiB by default) the operator moves exactly these fields
into a ConfigMap owned by the job, compressed, and the status keeps a reference to it:

    status.rankDetail: {configMap: <job>-rank-detail, digest: <sha256 prefix>, bytes, ranks}

The ConfigMap's binaryData holds the detail under its digest, written before the status that
names it, so a status always names a detail that exists (the one it replaced is kept until the
next write). Readers (the operator, `kubectl gemini`) `join` it back and check the digest.

Stdlib only: the operator, the CLI and the benchmarks share it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from collections.abc import Callable, Mapping
from typing import Any

REF = "rankDetail"  # the status field that names the ConfigMap and the digest
FIELDS: tuple[tuple[str, ...], ...] = (
    ("placement", "holders"),
    ("placement", "groups"),
    ("placement", "nodes"),
    ("launch", "trainerRestarts"),
    ("launch", "podUIDs"),
    ("recovery", "plan", "sources"),
    ("recovery", "plan", "refetch"),
)
DEFAULT_INLINE_BYTES = 64 * 1024
# A decompressed detail larger than this is refused: 8,192 ranks need about 1 MiB.
MAX_DETAIL_BYTES = 16 * 1024 * 1024
DIGEST_CHARS = 32


class RankDetailError(ValueError):
    """A stored detail is missing, corrupt or does not match the digest its status names."""


def configmap_name(job: str) -> str:
    return f"{job}-rank-detail"


def split(status: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the status without the per-rank fields, those fields by dotted path). The reference
    to an earlier detail is dropped from the slim status: the caller sets the new one."""
    slim = _copy_paths(status)
    slim.pop(REF, None)
    detail: dict[str, Any] = {}
    for path in FIELDS:
        parent = _parent(slim, path)
        if parent is not None and path[-1] in parent:
            detail[".".join(path)] = parent.pop(path[-1])
    return slim, detail


def join(status: Mapping[str, Any], detail: Mapping[str, Any]) -> dict[str, Any]:
    """The status with the per-rank fields put back (only under parents it still has), and
    without the reference."""
    full = _copy_paths(status)
    full.pop(REF, None)
    for path in FIELDS:
        value = detail.get(".".join(path))
        parent = _parent(full, path)
        if value is not None and parent is not None:
            parent[path[-1]] = value
    return full


def canonical(detail: Mapping[str, Any]) -> bytes:
    """The detail as canonical JSON: equal details give equal bytes, hence equal digests."""
    return json.dumps(detail, sort_keys=True, separators=(",", ":")).encode()


def digest_of(text: bytes) -> str:
    return hashlib.sha256(text).hexdigest()[:DIGEST_CHARS]


def compress(text: bytes) -> bytes:
    return zlib.compress(text, 6)


def encode(detail: Mapping[str, Any]) -> tuple[str, bytes, int]:
    """(digest, compressed bytes, uncompressed size) of a detail."""
    text = canonical(detail)
    return digest_of(text), compress(text), len(text)


def touched_by(patch: Mapping[str, Any]) -> bool:
    """Whether the merge patch `patch` may change a per-rank field: it reaches one of them,
    or replaces or removes a document on the way to one."""
    for path in FIELDS:
        node: Any = patch
        for key in path:
            if key not in node:
                break
            node = node[key]
            if not isinstance(node, Mapping):
                return True
        else:
            return True
    return False


def decode(blob: bytes, digest: str) -> dict[str, Any]:
    """The detail stored as `blob`, checked against `digest`."""
    inflater = zlib.decompressobj()
    try:
        text = inflater.decompress(blob, MAX_DETAIL_BYTES + 1)
    except zlib.error as err:
        raise RankDetailError(f"rank detail {digest} is not zlib data: {err}") from err
    if len(text) > MAX_DETAIL_BYTES or inflater.unconsumed_tail:
        raise RankDetailError(f"rank detail {digest} inflates past {MAX_DETAIL_BYTES} bytes")
    if digest_of(text) != digest:
        raise RankDetailError(f"rank detail does not match its digest {digest}")
    detail = json.loads(text)
    if not isinstance(detail, dict):
        raise RankDetailError(f"rank detail {digest} is not a JSON object")
    return detail


def reference(status: Mapping[str, Any]) -> tuple[str, str] | None:
    """(ConfigMap name, digest) that `status` names, or None when its detail is inline."""
    ref = status.get(REF)
    if not isinstance(ref, Mapping):
        return None
    name, digest = ref.get("configMap"), ref.get("digest")
    if not isinstance(name, str) or not isinstance(digest, str) or not name or not digest:
        raise RankDetailError(f"status.{REF} names no configMap and digest: {dict(ref)}")
    return name, digest


def resolve(status: Mapping[str, Any],
            read_configmap: Callable[[str], Mapping[str, Any] | None]) -> dict[str, Any]:
    """The full status: `status` itself when its detail is inline, else joined with the
    detail read from the ConfigMap it names (`read_configmap(name)`: the raw object, None
    when missing)."""
    ref = reference(status)
    if ref is None:
        return dict(status)
    name, digest = ref
    return join(status, detail_of(read_configmap(name), name, digest))


def detail_of(configmap: Mapping[str, Any] | None, name: str, digest: str) -> dict[str, Any]:
    """The detail `digest` in a ConfigMap as the API returns it (binaryData in base64)."""
    return decode(blob_of(configmap, name, digest), digest)


def blob_of(configmap: Mapping[str, Any] | None, name: str, digest: str) -> bytes:
    """The compressed detail `digest` in a ConfigMap as the API returns it."""
    if configmap is None:
        raise RankDetailError(f"ConfigMap {name} with the status's rank detail is missing")
    encoded = (configmap.get("binaryData") or {}).get(digest)
    if not isinstance(encoded, str):
        raise RankDetailError(f"ConfigMap {name} holds no rank detail {digest}")
    try:
        return base64.b64decode(encoded, validate=True)
    except ValueError as err:
        raise RankDetailError(f"ConfigMap {name}: rank detail {digest} is not base64") from err


def reference_doc(job: str, digest: str, size: int, ranks: int) -> dict[str, Any]:
    return {"configMap": configmap_name(job), "digest": digest, "bytes": size, "ranks": ranks}


def rank_count(detail: Mapping[str, Any]) -> int:
    """How many ranks the detail describes (the largest per-rank map)."""
    return max((len(v) for v in detail.values() if isinstance(v, Mapping | list)), default=0)


def _copy_paths(status: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `status` whose documents on the detail paths are copies too (the rest is
    shared with the original, which is never changed in place)."""
    out = dict(status)
    for path in FIELDS:
        node = out
        for key in path[:-1]:
            child = node.get(key)
            if not isinstance(child, Mapping):
                break
            node[key] = node = dict(child)
    return out


def _parent(status: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    node: Any = status
    for key in path[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None
