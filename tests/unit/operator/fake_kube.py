"""One in-memory Kubernetes API for the operator's unit tests, in place of `KubeClient`.

The methods the operator calls, by the same names and signatures, over objects kept as the API
server returns them (camelCase dicts, copies handed out): GeminiJobs, whose status patches are
applied as JSON merge patches (resourceVersion bumped); worker pods, listed by the job's labels;
Secrets (values given in plain text, stored base64-encoded), Services and NetworkPolicies;
ConfigMaps; events. What the operator did is recorded: status patches and event messages by
job, the Secret values read, and the number of writes. Thread-safe: a work queue runs several
jobs' reconciles at once.
"""

from __future__ import annotations

import base64
import copy
import json
import threading
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from gemini_operator.cluster.kube import NotOwned, owner_uids
from gemini_operator.core import naming
from gemini_operator.core.status import merge_patched

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace, name)


class FakeKube:
    def __init__(self, jobs: Iterable[Obj] = (), pods: Iterable[Obj] = (),
                 secrets: Mapping[Key, Mapping[str, str]] | None = None) -> None:
        self.lock = threading.RLock()
        self.jobs: dict[Key, Obj] = {_key(job): copy.deepcopy(job) for job in jobs}
        self.pods: dict[Key, Obj] = {_key(pod): copy.deepcopy(pod) for pod in pods}
        # Services, Secrets and NetworkPolicies by (kind, namespace, name).
        self.objects: dict[tuple[str, str, str], Obj] = {}
        self.configmaps: dict[Key, Obj] = {}
        self.patches: dict[Key, list[Obj]] = {key: [] for key in self.jobs}  # status patches
        self.events: dict[Key, list[str]] = {key: [] for key in self.jobs}  # their messages
        self.secret_reads: list[tuple[str, str, str]] = []  # (namespace, name, key)
        self.writes = 0  # every create, patch, put and delete
        for (namespace, name), values in (secrets or {}).items():
            self.objects[("Secret", namespace, name)] = _secret(namespace, name, values)

    # --- GeminiJobs ---------------------------------------------------------------------

    def get_job(self, namespace: str, name: str) -> Obj | None:
        with self.lock:
            job = self.jobs.get((namespace, name))
            return copy.deepcopy(job) if job is not None else None

    def patch_job_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> Obj:
        with self.lock:
            self.writes += 1
            self.patches.setdefault((namespace, name), []).append(copy.deepcopy(dict(patch)))
            job = self.jobs[(namespace, name)]
            job["status"] = merge_patched(job.get("status") or {}, patch)
            meta = job["metadata"]
            meta["resourceVersion"] = str(int(meta.get("resourceVersion", "0")) + 1)
            return copy.deepcopy(job)

    # --- children -----------------------------------------------------------------------

    def list_worker_pods(self, namespace: str, job: str,
                         ranks: Iterable[int] | None = None) -> list[Obj]:
        wanted = None if ranks is None else {str(r) for r in ranks}
        with self.lock:
            found = []
            for (pod_namespace, _), pod in sorted(self.pods.items()):
                labels = pod["metadata"].get("labels") or {}
                if pod_namespace != namespace or labels.get(naming.LABEL_JOB) != job:
                    continue
                if wanted is None or labels.get(naming.LABEL_RANK) in wanted:
                    found.append(copy.deepcopy(pod))
            return found

    def owners(self, kind: str, namespace: str, name: str) -> tuple[str, ...] | None:
        with self.lock:
            found = self.objects.get((kind, namespace, name))
            return None if found is None else owner_uids(found)

    def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        with self.lock:
            self.secret_reads.append((namespace, name, key))
            secret = self.objects.get(("Secret", namespace, name)) or {}
            data = secret.get("data") or {}
            return base64.b64decode(data[key]).decode() if key in data else None

    def create(self, manifest: Mapping[str, Any]) -> bool:
        """A Pod, Service, Secret or NetworkPolicy; False when one of that name exists."""
        meta = manifest["metadata"]
        with self.lock:
            if manifest["kind"] == "Pod":
                if (meta["namespace"], meta["name"]) in self.pods:
                    return False
                self.pods[(meta["namespace"], meta["name"])] = _copy(manifest)
            else:
                key = (manifest["kind"], meta["namespace"], meta["name"])
                if key in self.objects:
                    return False
                self.objects[key] = _copy(manifest)
            self.writes += 1
            return True

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None) -> bool:
        with self.lock:
            self.writes += 1
            return self.pods.pop((namespace, name), None) is not None

    def get_configmap(self, namespace: str, name: str) -> Obj | None:
        with self.lock:
            found = self.configmaps.get((namespace, name))
            return copy.deepcopy(found) if found is not None else None

    def put_configmap(self, manifest: Mapping[str, Any]) -> None:
        meta = manifest["metadata"]
        with self.lock:
            existing = self.configmaps.get((meta["namespace"], meta["name"]))
            if existing is not None and not set(owner_uids(existing)) & set(
                    owner_uids(manifest)):
                raise NotOwned(f"the ConfigMap {meta['namespace']}/{meta['name']} exists and "
                               "is not this job's")
            self.writes += 1
            self.configmaps[(meta["namespace"], meta["name"])] = _copy(manifest)

    # --- events -------------------------------------------------------------------------

    def create_event(self, job: Mapping[str, str], reason: str, message: str, warning: bool,
                     now: datetime) -> None:
        with self.lock:
            self.writes += 1
            self.events.setdefault((job["namespace"], job["name"]), []).append(message)


def _key(obj: Mapping[str, Any]) -> Key:
    return obj["metadata"]["namespace"], obj["metadata"]["name"]


def _copy(manifest: Mapping[str, Any]) -> Obj:
    """As the API server stores it: JSON, nothing shared with the caller."""
    return dict(json.loads(json.dumps(manifest)))


def _secret(namespace: str, name: str, values: Mapping[str, str]) -> Obj:
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}}
