"""Whose S3 checkpoints a sidecar writes and reads: the namespace, name and uid the operator
renders into its environment, and nothing a key segment could escape from."""

from __future__ import annotations

import pytest

from gemini_sidecar.config import S3Settings, from_env
from gemini_sidecar.s3 import NO_UID, JobIdentity, job_prefix, legacy_prefix, open_store
from gemini_sidecar.s3_checkpoints import s3_identity
from tests.unit.sidecar.test_config import BASE

UID = "6f1c2b8e-0d4e-4c55-9a43-0f1e2d3c4b5a"


def test_the_rendered_namespace_and_uid_key_the_jobs_directory():
    cfg = from_env(dict(BASE, GEMINI_NAMESPACE="team-a", GEMINI_JOB_UID=UID,
                        GEMINI_S3_BUCKET="ckpt", GEMINI_S3_PREFIX="/gemini/"))
    assert s3_identity(cfg) == JobIdentity("team-a", "j1", UID)
    assert cfg.s3 is not None
    store = open_store(cfg.s3)
    assert job_prefix(store, s3_identity(cfg)) == f"gemini/team-a/j1/{UID}/"
    assert legacy_prefix(store, "j1") == "gemini/j1/"


def test_a_sidecar_started_by_hand_has_a_default_namespace_and_no_uid():
    assert s3_identity(from_env(BASE)) == JobIdentity("default", "j1", NO_UID)


@pytest.mark.parametrize("bad", ["", "a/b", "..", "../x", "x y"])
def test_a_segment_that_is_not_a_name_is_refused(bad):
    with pytest.raises(ValueError, match="cannot be an S3 key segment"):
        JobIdentity("team-a", bad, UID)
    with pytest.raises(ValueError, match="cannot be an S3 key segment"):
        legacy_prefix(open_store(S3Settings(bucket="b")), bad)
