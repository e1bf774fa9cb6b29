"""The only module that talks to the Kubernetes API (the `kubernetes` client, synchronous).

Reads return plain camelCase dicts (the raw JSON, not the client's models: cheaper at a
thousand pods, and what the pure code parses). Writes are idempotent where the operator
needs them to be: creating what exists and deleting what is gone are not errors.
The reconciler calls these from worker threads, never from the event loop.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any, cast

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from gemini_operator.core import naming
from gemini_operator.core.apitime import api_time

Obj = dict[str, Any]
CONNECTIONS = 32
KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
KUEUE_MISSING = ("Kueue's API (kueue.x-k8s.io/v1beta2 Workloads) is not served: the job names "
                 "a queue (label kueue.x-k8s.io/queue-name); install Kueue >= 0.15 or remove "
                 "the label")


class KubeError(RuntimeError):
    """An API call failed in a way the caller should retry later; the message says which."""


class Invalid(KubeError):
    """The API server refused an object as invalid (422), or a field of it as unknown (400,
    strict field validation): retrying the same one cannot help."""


class NotOwned(KubeError):
    """An object of the name a job's child takes exists and is not that job's: it is neither
    adopted nor replaced (a tenant could plant one: a Secret with a token it knows, a
    ConfigMap, a permissive NetworkPolicy)."""


def owner_uids(obj: Mapping[str, Any]) -> tuple[str, ...]:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return tuple(str(r.get("uid", "")) for r in refs)


@dataclass(frozen=True)
class Connection:
    """How to reach the API server (handed to kopf so both use the same credentials)."""

    server: str
    ca_path: str | None
    certificate_path: str | None
    private_key_path: str | None
    token: str | None
    insecure: bool


class KubeClient:
    def __init__(self, api: client.ApiClient) -> None:
        self._api = api
        self._core = client.CoreV1Api(api)
        self._custom = client.CustomObjectsApi(api)
        self._coordination = client.CoordinationV1Api(api)
        self._scheduling = client.SchedulingV1Api(api)
        self._networking = client.NetworkingV1Api(api)

    @staticmethod
    def connect(kubeconfig: str | None = None) -> KubeClient:
        """From `kubeconfig`, else $KUBECONFIG or ~/.kube/config, else the in-cluster account."""
        path = kubeconfig or os.environ.get("KUBECONFIG")
        cfg = client.Configuration()
        if path or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_kube_config(config_file=path, client_configuration=cfg)
        else:
            config.load_incluster_config(client_configuration=cfg)
        # Creating a thousand pods runs many requests at once; the default pool holds 4.
        cfg.connection_pool_maxsize = CONNECTIONS
        return KubeClient(client.ApiClient(cfg))

    def connection(self) -> Connection:
        cfg = self._api.configuration
        token = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
        if token and token.lower().startswith("bearer "):  # in-cluster config says "bearer"
            token = token[len("bearer "):]
        return Connection(
            server=cfg.host, ca_path=cfg.ssl_ca_cert, certificate_path=cfg.cert_file,
            private_key_path=cfg.key_file, token=token, insecure=not cfg.verify_ssl,
        )

    # --- GeminiJobs ---------------------------------------------------------------------

    def get_job(self, namespace: str, name: str) -> Obj | None:
        return self._read(lambda: self._custom.get_namespaced_custom_object(
            naming.GROUP, naming.VERSION, namespace, naming.PLURAL, name,
            _preload_content=False))

    def patch_job_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> Obj:
        """Merge-patch the status subresource; returns the updated GeminiJob."""
        raw = self._call(f"patch the status of GeminiJob {namespace}/{name}", lambda: (
            self._custom.patch_namespaced_custom_object_status(
                naming.GROUP, naming.VERSION, namespace, naming.PLURAL, name,
                {"status": dict(patch)}, _preload_content=False)))
        return dict(json.loads(raw.data))

    def delete_job(self, namespace: str, name: str) -> None:
        self._ignore(404, f"delete GeminiJob {namespace}/{name}", lambda: (
            self._custom.delete_namespaced_custom_object(
                naming.GROUP, naming.VERSION, namespace, naming.PLURAL, name,
                propagation_policy="Background")))

    # --- children -----------------------------------------------------------------------

    def list_worker_pods(self, namespace: str, job: str,
                         ranks: Iterable[int] | None = None) -> list[Obj]:
        """The job's worker pods; only those of `ranks` when given (a thousand-rank job's
        full list is megabytes, slow on a busy API server)."""
        selector = ",".join(f"{k}={v}" for k, v in naming.worker_selector(job).items())
        if ranks is not None:
            wanted = sorted(ranks)
            if not wanted:
                return []
            selector += f",{naming.LABEL_RANK} in ({','.join(str(r) for r in wanted)})"
        raw = self._call(f"list the pods of {namespace}/{job}", lambda: (
            self._core.list_namespaced_pod(namespace, label_selector=selector,
                                           _preload_content=False)))
        return list(json.loads(raw.data)["items"])

    def get_node(self, name: str) -> Obj | None:
        return self._read(lambda: self._core.read_node(name, _preload_content=False))

    def owners(self, kind: str, namespace: str, name: str) -> tuple[str, ...] | None:
        """The owners' uids of the Service, Secret or NetworkPolicy `name`; None: there is
        none of that name."""
        readers: dict[str, Callable[..., Any]] = {
            "Service": self._core.read_namespaced_service,
            "Secret": self._core.read_namespaced_secret,
            "NetworkPolicy": self._networking.read_namespaced_network_policy,
        }
        read = readers[kind]
        found = self._read(lambda: read(name, namespace, _preload_content=False))
        return None if found is None else owner_uids(found)

    def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        """One decoded value of a Secret, or None when the Secret or key is missing. The
        operator reads its own jobs' peer-auth Secrets only: a job's S3 credentials Secret
        goes to the job's pods alone (RBAC cannot narrow `get` to names not known ahead)."""
        secret = self._read(lambda: self._core.read_namespaced_secret(
            name, namespace, _preload_content=False))
        data = (secret or {}).get("data") or {}
        return base64.b64decode(data[key]).decode() if key in data else None

    def create(self, manifest: Mapping[str, Any]) -> bool:
        """Create a Pod, Service, Secret or NetworkPolicy; False when it already exists. Pods
        are created with strict field validation: a field the API does not know (a
        misspelled `nodeSelecter` of the user's template) is refused (Invalid), not dropped
        with a warning nobody reads."""
        kind, namespace = manifest["kind"], manifest["metadata"]["namespace"]
        creators: dict[str, Callable[..., Any]] = {
            "Pod": partial(self._core.create_namespaced_pod, field_validation="Strict"),
            "Service": self._core.create_namespaced_service,
            "Secret": self._core.create_namespaced_secret,
            "NetworkPolicy": self._networking.create_namespaced_network_policy,
        }
        create = creators[kind]
        what = f"create {kind} {namespace}/{manifest['metadata']['name']}"
        return self._ignore(409, what, lambda: create(namespace, dict(manifest))) is not None

    def get_configmap(self, namespace: str, name: str) -> Obj | None:
        return self._read(lambda: self._core.read_namespaced_config_map(
            name, namespace, _preload_content=False))

    def put_configmap(self, manifest: Mapping[str, Any]) -> None:
        """Create the ConfigMap, or replace the one of that name when it has the manifest's
        owner (the operator is its only writer); NotOwned when it is someone else's."""
        namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
        what, body = f"write ConfigMap {namespace}/{name}", cast(Any, dict(manifest))
        if self._ignore(409, what, lambda: self._core.create_namespaced_config_map(
                namespace, body)) is not None:
            return
        existing = self.get_configmap(namespace, name)
        if existing is not None and not set(owner_uids(manifest)) & set(owner_uids(existing)):
            raise NotOwned(f"the ConfigMap {namespace}/{name} exists and is not this job's")
        self._call(what, lambda: self._core.replace_namespaced_config_map(name, namespace, body))

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None) -> bool:
        """Delete a pod; False when it was already gone."""
        body = client.V1DeleteOptions(grace_period_seconds=grace_seconds)
        return self._ignore(404, f"delete Pod {namespace}/{name}", lambda: (
            self._core.delete_namespaced_pod(name, namespace, body=body))) is not None

    def create_priority_class(self, manifest: Mapping[str, Any]) -> bool:
        """Create a (cluster-scoped) PriorityClass; False when one of that name exists."""
        what = f"create PriorityClass {manifest['metadata']['name']}"
        body: Any = dict(manifest)
        return self._ignore(409, what, lambda: self._scheduling.create_priority_class(
            body)) is not None

    # --- Kueue (queueing.py) --------------------------------------------------------------

    def get_workload(self, namespace: str, name: str) -> Obj | None:
        return self._read(lambda: self._custom.get_namespaced_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads", name, _preload_content=False))

    def get_resource_flavor(self, name: str) -> Obj | None:
        return self._read(lambda: self._custom.get_cluster_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, "resourceflavors", name, _preload_content=False))

    def priority_value(self, name: str, workload_class: bool) -> int | None:
        """The value of a Kueue WorkloadPriorityClass or a PriorityClass; None if missing."""
        if workload_class:
            found = self._read(lambda: self._custom.get_cluster_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, "workloadpriorityclasses", name,
                _preload_content=False))
        else:
            found = self._read(lambda: self._scheduling.read_priority_class(
                name, _preload_content=False))
        return int(found["value"]) if found is not None else None

    def create_workload(self, manifest: Mapping[str, Any]) -> bool:
        """Create a Workload; False when it already exists."""
        namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
        try:
            self._custom.create_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads", dict(manifest))
        except ApiException as err:
            if err.status == 409:
                return False
            raise _kueue_error(err, f"create Workload {namespace}/{name}") from err
        return True

    def delete_workload(self, namespace: str, name: str) -> None:
        self._ignore(404, f"delete Workload {namespace}/{name}", lambda: (
            self._custom.delete_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads", name)))

    def patch_workload_status(self, namespace: str, name: str, patch: Mapping[str, Any]
                              ) -> bool:
        """Merge-patch a Workload's status; False on a conflict (it changed since read)."""
        try:
            self._custom.patch_namespaced_custom_object_status(
                KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads", name, dict(patch))
        except ApiException as err:
            if err.status == 409:
                return False
            raise _kueue_error(err, f"patch the status of Workload {namespace}/{name}") from err
        return True

    # --- events -------------------------------------------------------------------------

    def create_event(
        self, job: Mapping[str, str], reason: str, message: str, warning: bool, now: datetime,
    ) -> None:
        """A core/v1 Event about the GeminiJob `job` (name, namespace, uid)."""
        stamp = api_time(now)
        body: Any = {
            "metadata": {"generateName": f"{job['name']}.", "namespace": job["namespace"]},
            "involvedObject": {"apiVersion": naming.API_VERSION, "kind": naming.KIND,
                               "name": job["name"], "namespace": job["namespace"],
                               "uid": job["uid"]},
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": naming.MANAGER},
            "reportingComponent": naming.MANAGER,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        self._call(f"record event {reason}", lambda: (
            self._core.create_namespaced_event(job["namespace"], body)))

    # --- leases (leader election) -------------------------------------------------------

    def get_lease(self, namespace: str, name: str) -> Obj | None:
        return self._read(lambda: self._coordination.read_namespaced_lease(
            name, namespace, _preload_content=False))

    def write_lease(self, namespace: str, lease: Mapping[str, Any]) -> bool:
        """Create (no resourceVersion) or replace (with it) a Lease; False if someone else
        wrote it first (a conflict): the caller lost the race."""
        name = lease["metadata"]["name"]
        body: Any = dict(lease)
        try:
            if lease["metadata"].get("resourceVersion"):
                self._coordination.replace_namespaced_lease(name, namespace, body)
            else:
                self._coordination.create_namespaced_lease(namespace, body)
        except ApiException as err:
            if err.status == 409:
                return False
            raise KubeError(f"could not write Lease {namespace}/{name}: {_why(err)}") from err
        return True

    # --- plumbing -----------------------------------------------------------------------

    def _read(self, call: Any) -> Obj | None:
        try:
            response = call()
        except ApiException as err:
            if err.status == 404:
                return None
            raise KubeError(f"read failed: {_why(err)}") from err
        return dict(json.loads(response.data))

    def _call(self, what: str, call: Any) -> Any:
        try:
            return call()
        except ApiException as err:
            raise KubeError(f"could not {what}: {_why(err)}") from err

    def _ignore(self, status: int, what: str, call: Any) -> Any:
        try:
            return call()
        except ApiException as err:
            if err.status == status:
                return None
            raise _refusal(err, what) from err
        except ValidationError as err:  # the client's own models refused the body
            raise Invalid(f"could not {what}: {_fields_refused(err)}") from err


def _refusal(err: ApiException, what: str) -> KubeError:
    """422 (invalid) and 400 (a strict decoding error: an unknown or duplicate field) are the
    object's own fault: Invalid. Anything else may pass: KubeError (retried)."""
    kind = Invalid if err.status in (400, 422) else KubeError
    return kind(f"could not {what}: {_why(err)}")


def _fields_refused(err: ValidationError) -> str:
    """The fields the client's models refused, as the API server names them: an unknown
    field as strict field validation says it (`unknown field "spec.nodeSelecter"`)."""
    said = []
    for problem in err.errors()[:5]:
        path = ".".join(str(p) for p in problem.get("loc", ()) if not isinstance(p, int))
        if problem.get("type") == "extra_forbidden":
            said.append(f'unknown field "{path}"')
        else:
            said.append(f"{path}: {problem.get('msg', 'invalid')}")
    return "; ".join(said) or str(err)


def _kueue_error(err: ApiException, what: str) -> KubeError:
    if err.status == 404:
        return KubeError(KUEUE_MISSING)
    kind = Invalid if err.status == 422 else KubeError
    return kind(f"could not {what}: {_why(err)}")


def _why(err: ApiException) -> str:
    try:
        return str(json.loads(err.body or "")["message"])
    except (TypeError, ValueError, KeyError):
        return f"HTTP {err.status} {err.reason}"
