"""The status's per-rank detail: split off, compressed, joined back, and written to a
ConfigMap before the status names it (gemini.rank_detail, gemini_operator.cluster.status_store).
The API server is a dict here; tests/cluster runs the operator with every detail spilled."""

from __future__ import annotations

import base64
import json
import uuid
import zlib
from typing import Any

import pytest

from gemini import rank_detail
from gemini.domain.placement import Machine, domain_aware_placement
from gemini.rank_detail import RankDetailError
from gemini_operator.cluster.status_store import StatusStore
from gemini_operator.core.status import merge_patched, status_patch
from tests.unit.operator.fake_kube import FakeKube

STATUS_TARGET = 256 * 1024


def big_status(ranks: int) -> dict[str, Any]:
    """A status as the operator writes it mid-recovery for `ranks` ranks."""
    machines = [Machine(rank=r, node=f"gpu-node-{r:05d}.cluster.internal",
                        zone=f"zone-{r % 3}", rack=f"rack-{r % 100}") for r in range(ranks)]
    placement = domain_aware_placement(machines, 2).to_dict()
    placement |= {"restartAttempt": 1, "nodes": {str(m.rank): m.node for m in machines}}
    launch = {"epoch": 4, "restartAttempt": 1, "masterAddr": "10.0.0.1", "masterPort": 29500,
              "trainerRestarts": {str(r): r % 2 for r in range(ranks)},
              "podUIDs": {str(r): str(uuid.uuid4()) for r in range(ranks)}}
    plan = {"version": 120, "mode": "memory", "reason": "peers", "replaceRanks": [3],
            "sources": {str(r): {"kind": "local", "holder": None} for r in range(ranks)},
            "refetch": {"3": [2, 4]}, "newestSeen": 121}
    return {"state": "Recovering", "restarts": 1, "placement": placement, "launch": launch,
            "recovery": {"epoch": 4, "phase": "Fetching", "kind": "hardware", "plan": plan}}


def test_split_and_join_give_back_the_status_without_touching_it():
    status = big_status(64)
    before = json.dumps(status, sort_keys=True)
    slim, detail = rank_detail.split(status)
    assert "holders" not in slim["placement"] and "podUIDs" not in slim["launch"]
    assert slim["placement"]["replicas"] == 2 and slim["launch"]["epoch"] == 4
    assert "sources" not in slim["recovery"]["plan"] and slim["recovery"]["plan"]["version"] == 120
    assert rank_detail.join(slim, detail) == status
    assert json.dumps(status, sort_keys=True) == before  # neither changed the original


def test_join_puts_detail_back_only_under_parents_the_status_still_has():
    slim, detail = rank_detail.split(big_status(8))
    del slim["recovery"]  # the recovery finished after the detail was written
    joined = rank_detail.join(slim, detail)
    assert "recovery" not in joined and len(joined["placement"]["holders"]) == 8


def test_a_detail_that_does_not_match_its_digest_or_inflates_too_far_is_refused():
    digest, blob, _ = rank_detail.encode({"launch.podUIDs": {"0": "a"}})
    assert rank_detail.decode(blob, digest) == {"launch.podUIDs": {"0": "a"}}
    other, _, _ = rank_detail.encode({"launch.podUIDs": {"0": "b"}})
    with pytest.raises(RankDetailError, match="does not match"):
        rank_detail.decode(blob, other)
    with pytest.raises(RankDetailError, match="not zlib"):
        rank_detail.decode(b"not compressed", digest)
    bomb = zlib.compress(b" " * (rank_detail.MAX_DETAIL_BYTES + 10))
    with pytest.raises(RankDetailError, match="inflates past"):
        rank_detail.decode(bomb, digest)


def job(status: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "big", "namespace": "ns", "uid": "u-1"}, "status": status}


def applied(stored: dict[str, Any], patch: dict[str, Any] | None) -> dict[str, Any]:
    return job(merge_patched(stored["status"], patch or {}))


def test_at_8192_ranks_the_stored_status_stays_small_and_reads_back_whole():
    kube = FakeKube()
    store = StatusStore(kube)  # type: ignore[arg-type]
    full = big_status(8192)
    assert len(json.dumps(full)) > 1024 * 1024  # what the status would carry inline
    stored = applied(job({}), store.stored_patch(job({}), full))
    size = len(json.dumps(stored["status"]))
    assert size <= STATUS_TARGET, size
    ref = stored["status"][rank_detail.REF]
    assert ref["configMap"] == "big-rank-detail" and ref["ranks"] == 8192
    configmap = kube.configmaps[("ns", "big-rank-detail")]
    assert configmap["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    blob_bytes = sum(len(base64.b64decode(b)) for b in configmap["binaryData"].values())
    assert blob_bytes < 512 * 1024, blob_bytes  # a ConfigMap holds 1 MiB: two of these fit
    # A fresh operator (nothing remembered) reads the detail back from the ConfigMap.
    fresh = StatusStore(kube)  # type: ignore[arg-type]
    # (The API server drops nulls of a merge patch, e.g. a source's "holder": null.)
    assert fresh.full_job(stored)["status"] == merge_patched({}, full)


def test_a_new_detail_is_written_beside_the_one_the_status_still_names():
    kube = FakeKube()
    store = StatusStore(kube, inline_bytes=0)  # type: ignore[arg-type]
    first = applied(job({}), store.stored_patch(job({}), big_status(16)))
    old_digest = first["status"][rank_detail.REF]["digest"]
    patch = {"launch": {"podUIDs": {"3": "replaced-pod"}}}
    second = applied(first, store.stored_patch(first, patch))
    new_digest = second["status"][rank_detail.REF]["digest"]
    assert new_digest != old_digest
    assert set(kube.configmaps[("ns", "big-rank-detail")]["binaryData"]) == {
        old_digest, new_digest}
    # Had the status write failed, the status naming the old digest still reads whole.
    assert StatusStore(kube).full_job(first)["status"] == big_status_like(first, store)
    assert store.full_job(second)["status"]["launch"]["podUIDs"]["3"] == "replaced-pod"
    # A write that changes no per-rank map touches no ConfigMap.
    writes = kube.writes
    third = store.stored_patch(second, {"state": "Running"})
    assert third == {"state": "Running"} and kube.writes == writes


def big_status_like(stored: dict[str, Any], store: StatusStore) -> dict[str, Any]:
    return dict(store.full_job(stored)["status"])


def test_a_small_detail_stays_inline_and_a_shrinking_one_comes_back_inline():
    kube = FakeKube()
    store = StatusStore(kube, inline_bytes=4096)  # type: ignore[arg-type]
    small = big_status(4)
    assert store.stored_patch(job({}), small) == merge_patched({}, small)
    assert not kube.configmaps
    spilled = applied(job({}), store.stored_patch(job({}), big_status(64)))
    assert rank_detail.REF in spilled["status"]
    shrunk = {"state": "Running", "placement": small["placement"]}
    back = applied(spilled, store.stored_patch(
        spilled, status_patch(store.full_job(spilled)["status"], shrunk)))
    assert rank_detail.REF not in back["status"]
    assert back["status"]["placement"] == small["placement"]


def test_a_missing_configmap_drops_the_placement_so_it_is_computed_again():
    store = StatusStore(FakeKube())  # type: ignore[arg-type]
    status = {"state": "Running", "placement": {"replicas": 2}, "launch": {"epoch": 2},
              rank_detail.REF: {"configMap": "big-rank-detail", "digest": "0" * 32}}
    seen = store.full_job(job(status))["status"]
    assert "placement" not in seen and rank_detail.REF not in seen
    assert seen["launch"] == {"epoch": 2}


def test_a_write_that_reaches_no_per_rank_map_skips_the_detail():
    assert not rank_detail.touched_by({"state": "Running", "placement": {"restartAttempt": 2},
                                       "checkpoint": {"inMemoryStep": 9}})
    assert rank_detail.touched_by({"launch": {"podUIDs": {"3": "x"}}})
    assert rank_detail.touched_by({"recovery": None})  # removes the plan's maps
    assert rank_detail.touched_by({"placement": {"holders": None}})
