"""The job's status as stored: per-rank detail beside the object once it is large.

The reconciler and its executors read and write the full status (every per-rank map in
place). This store turns a cached GeminiJob into that full view (`full_job`) and a status
written in full terms into the merge patch the API server gets (`stored_patch`): when the
per-rank detail (gemini.rank_detail.FIELDS) serializes to more than `inline_bytes`, it goes
into the job's ConfigMap `<job>-rank-detail` first, and the status names it by digest.
Details seen are remembered by job and digest, so a reconcile reads the ConfigMap only after
an operator restart or another replica's write.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from gemini import rank_detail
from gemini.rank_detail import RankDetailError
from gemini_operator.cluster.kube import KubeClient
from gemini_operator.core import children, render
from gemini_operator.core.status import merge_patched, status_patch

log = logging.getLogger(__name__)
# Both blobs (the one the status names and its successor) must fit a ConfigMap (1 MiB).
CONFIGMAP_BUDGET = 1000 * 1024


class StatusStore:
    def __init__(self, kube: KubeClient, inline_bytes: int = rank_detail.DEFAULT_INLINE_BYTES
                 ) -> None:
        self._kube = kube
        self.inline_bytes = inline_bytes
        self._lock = threading.Lock()
        # "namespace/name" -> digest -> (detail, compressed): the detail the status names,
        # and the one written for a status write that may not have landed.
        self._known: dict[str, dict[str, tuple[dict[str, Any], bytes]]] = {}

    def full_job(self, job: Mapping[str, Any]) -> Mapping[str, Any]:
        """`job` with its status's per-rank detail joined in (the object itself when inline)."""
        status = job.get("status") or {}
        try:
            ref = rank_detail.reference(status)
            if ref is None:
                return job
            detail = self._detail(job, *ref)
        except RankDetailError as err:
            # A deleted or damaged ConfigMap: without its maps the placement is computed and
            # delivered again; a launch or plan without them starts from empty maps.
            log.warning("GeminiJob %s: %s; going on without the per-rank detail",
                        _name(job), err)
            slim = dict(status)
            slim.pop(rank_detail.REF, None)
            slim.pop("placement", None)
            return {**job, "status": slim}
        return {**job, "status": rank_detail.join(status, detail)}

    def stored_patch(self, job: Mapping[str, Any], patch: Mapping[str, Any]
                     ) -> dict[str, Any] | None:
        """The merge patch that takes the stored status of `job` (as cached) to the full
        status `patch` makes of it, after writing any new detail to the ConfigMap."""
        stored = job.get("status") or {}
        if not rank_detail.touched_by(patch):
            # Most writes (steps, conditions) leave every per-rank map as stored: no need to
            # serialize and hash a megabyte of detail at 8,192 ranks for each.
            return status_patch(stored, merge_patched(stored, patch))
        full = merge_patched(self.full_job(job).get("status") or {}, patch)
        slim, detail = rank_detail.split(full)
        text = rank_detail.canonical(detail)
        if len(text) <= self.inline_bytes:
            full.pop(rank_detail.REF, None)
            return status_patch(stored, full)
        digest, current = rank_detail.digest_of(text), rank_detail.reference(stored)
        if current is None or current[1] != digest:
            self._write(job, digest, rank_detail.compress(text), detail,
                        None if current is None else current[1])
        slim[rank_detail.REF] = rank_detail.reference_doc(
            _meta(job, "name"), digest, len(text), rank_detail.rank_count(detail))
        return status_patch(stored, slim)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._known.pop(f"{namespace}/{name}", None)

    def _detail(self, job: Mapping[str, Any], name: str, digest: str) -> dict[str, Any]:
        key = _name(job)
        with self._lock:
            known = self._known.get(key, {}).get(digest)
        if known is not None:
            return known[0]
        blob = rank_detail.blob_of(self._kube.get_configmap(_meta(job, "namespace"), name),
                                   name, digest)
        detail = rank_detail.decode(blob, digest)
        with self._lock:
            self._known[key] = {digest: (detail, blob)}
        return detail

    def _write(self, job: Mapping[str, Any], digest: str, blob: bytes,
               detail: dict[str, Any], keep: str | None) -> None:
        """Write the new detail beside the one the status names now (`keep`): if the status
        write after this fails, the status still names a detail that exists."""
        key = _name(job)
        with self._lock:
            kept = self._known.get(key, {}).get(keep or "")
        blobs = {digest: blob}
        if kept is not None and len(kept[1]) + len(blob) <= CONFIGMAP_BUDGET:
            blobs[keep or ""] = kept[1]
        ref = render.JobRef(_meta(job, "name"), _meta(job, "namespace"), _meta(job, "uid"))
        self._kube.put_configmap(children.rank_detail_configmap(ref, blobs))
        with self._lock:
            self._known[key] = {
                **({keep: kept} if keep and kept is not None else {}),
                digest: (detail, blob)}


def _meta(job: Mapping[str, Any], key: str) -> str:
    return str((job.get("metadata") or {}).get(key, ""))


def _name(job: Mapping[str, Any]) -> str:
    return f"{_meta(job, 'namespace')}/{_meta(job, 'name')}"
