"""Names, labels and well-known values shared by rendering, observing and the CRD.

Children have deterministic names so that a restarted operator finds them again:
`<job>-worker-<rank>` pods, a headless Service named like the job, `<job>-peer-auth` Secret,
`<job>-workers` NetworkPolicy.
"""

from __future__ import annotations

GROUP = "gemini.io"
VERSION = "v1beta1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "GeminiJob"
PLURAL = "geminijobs"

LABEL_JOB = "gemini.io/job-name"
LABEL_RANK = "gemini.io/rank"
LABEL_RESTART_ATTEMPT = "gemini.io/restart-attempt"
LABEL_ROLE = "gemini.io/role"
ROLE_WORKER = "worker"
ROLE_SPARE = "spare"  # a placeholder pod holding a spare node (spares.py)
LABEL_SPARE_INDEX = "gemini.io/spare-index"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "gemini-operator"
# spec.managedBy of the jobs this operator runs (also when unset); any other value is another
# controller's job (MultiKueue's: kueue.x-k8s.io/multikueue), left alone.
CONTROLLER_NAME = f"{GROUP}/gemini-operator"


def managed_elsewhere(spec: object) -> str | None:
    """The other controller a job's spec names in managedBy, or None when it is this one's."""
    managed_by = spec.get("managedBy") if isinstance(spec, dict) else None
    if not managed_by or managed_by == CONTROLLER_NAME:
        return None
    return str(managed_by)

TRAINER_CONTAINER = "trainer"
SIDECAR_CONTAINER = "gemini-sidecar"
SHM_VOLUME = "gemini-shm"
SECRET_TOKEN_KEY = "token"
# The job Secret's public key of the operator's signatures (the pods check its calls by it)
SECRET_CONTROL_PUBLIC_KEY_KEY = "control-public-key"

# Keys a persistence credentials Secret carries (the AWS SDK's names).
S3_ACCESS_KEY_KEY = "AWS_ACCESS_KEY_ID"
S3_SECRET_KEY_KEY = "AWS_SECRET_ACCESS_KEY"
S3_REGION_KEY = "AWS_REGION"


def worker_pod_name(job: str, rank: int) -> str:
    return f"{job}-worker-{rank}"


def spare_pod_name(job: str, index: int) -> str:
    return f"{job}-spare-{index}"


def service_name(job: str) -> str:
    """The headless Service; also the pods' DNS subdomain."""
    return job


def secret_name(job: str) -> str:
    return f"{job}-peer-auth"


def control_secret_name(job: str) -> str:
    """The Secret that keeps a random control token for the operator (no pod mounts it)."""
    return f"{job}-control"


def network_policy_name(job: str) -> str:
    return f"{job}-workers"


def worker_selector(job: str) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_ROLE: ROLE_WORKER}


def worker_labels(job: str, rank: int, attempt: int) -> dict[str, str]:
    return {
        **worker_selector(job),
        LABEL_RANK: str(rank),
        LABEL_RESTART_ATTEMPT: str(attempt),
        LABEL_MANAGED_BY: MANAGER,
    }


def job_labels(job: str) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_MANAGED_BY: MANAGER}
