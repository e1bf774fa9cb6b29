"""From a profile and the scheduler's chunks to per-peer send plans."""

from __future__ import annotations

import json

from gemini.domain.traffic import LinkModel
from gemini_sidecar.pacing import load_profile, plan, profile_from_json

LINK = LinkModel(alpha_seconds=1e-4, bandwidth_bytes_per_second=1e9)
PROFILE = {"iterations": [
    {"length": 1.0, "ops": [[0.0, 0.1], [0.3, 0.5], [0.9, 1.0]]},
    {"length": 1.0, "ops": [[0.0, 0.12], [0.3, 0.5], [0.88, 1.0]]},
]}


def _check_cover(chunks, length):
    pos = 0
    for c in chunks:
        assert c.offset == pos and c.offset % 8 == 0 and c.length > 0
        pos += c.length
    assert pos == length


def test_without_a_profile_every_chunk_goes_at_once_to_every_peer():
    plans = plan(10_000_003, 2, 1 << 20, None, LINK)
    assert plans.schedule is None and len(plans.per_copy) == 2
    for chunks in plans.per_copy:
        _check_cover(chunks, 10_000_003)
        assert {c.delay_s for c in chunks} == {0.0}


def test_chunks_wait_for_the_idle_spans_of_the_profile():
    size = 300_000_001  # 0.3 s at 1 GB/s: needs more than the first idle span
    plans = plan(size, 1, 8 << 20, profile_from_json(PROFILE), LINK)
    assert plans.schedule is not None
    chunks = plans.per_copy[0]
    _check_cover(chunks, size)
    delays = sorted({c.delay_s for c in chunks})
    assert delays[0] > 0.1 and len(delays) >= 2  # after the first op, in more than one gap
    assert all(d in {0.12, 0.5, 1.0} for d in delays)


def test_a_profile_file_is_read_and_a_broken_one_ignored(tmp_path):
    path = tmp_path / "p.json"
    assert load_profile(path) is None
    path.write_text(json.dumps(PROFILE))
    assert load_profile(path) is not None
    path.write_text('{"iterations": [{"length": 1}]}')
    assert load_profile(path) is None
