"""The worker pod of a GeminiJob, rendered from the typed spec: spec in, dicts out; and what
every child of the job shares (JobRef, RenderConfig, the owner reference, stable host names).
The job's other children (Service, NetworkPolicy, Secrets, the rank-detail ConfigMap) are
rendered in children.py.

One worker pod per rank: the trainer container runs the user's command under `gemini launch`
(which can restart it in place), the checkpoint sidecar is a native sidecar (an init container
with `restartPolicy: Always`, started first and stopped last), and both share a memory-backed
emptyDir. Required anti-affinity keeps one worker (or spare placeholder, spares.py) per node,
so a node loss costs one rank.

Hardened by default (Pod Security `restricted`): non-root, no privilege escalation, every
capability dropped, seccomp RuntimeDefault, no service-account token. A template that asks for
user 0 gets a root trainer with the runtime's default capabilities (`baseline`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gemini.control.paths import HEALTHZ_PATH
from gemini.control.signing import CONTROL_PUBLIC_KEY_ENV
from gemini_operator.core import naming
from gemini_operator.core.pod_template import merged
from gemini_operator.core.spec import JobSpec, Persistence, RunAs, TrainerTemplate

Manifest = dict[str, Any]


@dataclass(frozen=True)
class JobRef:
    """The GeminiJob that owns the children."""

    name: str
    namespace: str
    uid: str


@dataclass(frozen=True)
class RenderConfig:
    """Operator-wide settings that shape the children."""

    sidecar_port: int = 7070  # peer data protocol; the sidecar's HTTP API is the next port
    launcher_port: int = 7080
    rendezvous_port: int = 29500
    shm_mount_path: str = "/gemini/shm"
    cluster_domain: str = "cluster.local"
    launcher_command: tuple[str, ...] = ("gemini", "launch", "--")
    sidecar_command: tuple[str, ...] = ("gemini", "sidecar")
    # Workers outrank the spare placeholders, so a replacement preempts one (spares.py);
    # "" leaves the field out (the cluster's default priority).
    worker_priority_class: str = "gemini-worker"
    spare_priority_class: str = "gemini-spare"
    spare_command: tuple[str, ...] = ("sleep", "infinity")
    # Each job's NetworkPolicy admits the operator's pods, found by these labels in the
    # namespaces these labels select (empty: every namespace); the Helm chart passes its own.
    network_policy: bool = True
    operator_pod_labels: Mapping[str, str] = field(
        default_factory=lambda: {"app.kubernetes.io/name": "gemini-operator"})
    operator_namespace_labels: Mapping[str, str] = field(default_factory=dict)
    # NetworkPolicy peers (e.g. Prometheus) admitted to the sidecar's API port for /metrics.
    metrics_from: tuple[Mapping[str, Any], ...] = ()
    # The operator's hint server as the pods reach it (gemini_operator.calls.hints): a launcher
    # whose training failed calls it, so the operator polls the job at once. None: no hints.
    hint_url: str | None = None

    @property
    def sidecar_api_port(self) -> int:
        return self.sidecar_port + 1

    @property
    def sidecar_probe_port(self) -> int:
        """The kubelet's probes alone (gemini.serving.probes): a flood cannot starve them."""
        return self.sidecar_port + 2


@dataclass(frozen=True)
class PeerAssignment:
    """One rank's part of the placement: whose shards it holds, whom it sends its own to, and
    the peer addresses for those ranks. Unknown before scheduling under DomainAware placement;
    then the operator delivers it to the running sidecar instead."""

    hold_ranks: tuple[int, ...]
    send_to: tuple[int, ...]
    peers: Mapping[int, str] = field(default_factory=dict)  # rank -> host:port


def owner_reference(job: JobRef) -> dict[str, Any]:
    return {
        "apiVersion": naming.API_VERSION,
        "kind": naming.KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def worker_pod(
    job: JobRef, spec: JobSpec, rank: int, attempt: int, config: RenderConfig,
    assignment: PeerAssignment | None = None,
) -> Manifest:
    """The pod of `rank` for restart attempt `attempt`, with what a pod template adds."""
    name = naming.worker_pod_name(job.name, rank)
    return merged({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": job.namespace,
            "labels": naming.worker_labels(job.name, rank, attempt),
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {
            # The launcher outlives a failed training process (in-process restarts), or exits
            # (--exit-on-failure) and the node restarts the container in place; either way the
            # pod (and the sidecar's memory) stays. A launcher that exits 0 (training done) is
            # not restarted.
            "restartPolicy": "OnFailure",
            "hostname": name,
            "subdomain": naming.service_name(job.name),
            "enableServiceLinks": False,
            "automountServiceAccountToken": spec.template.automount_service_account_token,
            "securityContext": pod_security_context(spec.template.run_as),
            "affinity": one_pod_per_node(job.name),
            **({"priorityClassName": config.worker_priority_class}
               if config.worker_priority_class else {}),
            "initContainers": [_sidecar(job, spec, rank, config, assignment)],
            "containers": [_trainer(job, spec, rank, config)],
            "volumes": [_shm_volume(spec)],
        },
    }, spec.template.parts)


def pod_security_context(run_as: RunAs) -> Manifest:
    """Pod level: non-root, seccomp RuntimeDefault; a non-root user the template names applies
    to both containers (they share files in the memory volume, created mode 0600)."""
    context: Manifest = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    if run_as.user is not None and not run_as.root:
        context["runAsUser"] = run_as.user
    if run_as.group is not None:
        context["runAsGroup"] = run_as.group
    return context


def container_security_context() -> Manifest:
    """Every container but a root trainer: no privilege escalation, no capabilities."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def trainer_security_context(template: TrainerTemplate) -> Manifest:
    """A template asking for user 0 gets root with the runtime's default capabilities (what
    root is usually wanted for); still no privilege escalation."""
    if not template.run_as.root:
        return container_security_context()
    return {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False}


def sidecar_probes(config: RenderConfig) -> Manifest:
    """The sidecar's /healthz (503 when a listener is dead) on its probe port, a listener
    of its own that connections held to the API port cannot starve. Startup: up to
    30 s for the API to listen (the trainer starts after it); liveness: a restart after about
    30 s of a dead listener or no answer; readiness: out of Ready after two bad answers."""
    def probe(period: int, timeout: int, failures: int) -> Manifest:
        return {"httpGet": {"path": HEALTHZ_PATH, "port": "sidecar-probe"},
                "periodSeconds": period, "timeoutSeconds": timeout, "failureThreshold": failures}

    return {"startupProbe": probe(1, 1, 30), "livenessProbe": probe(10, 3, 3),
            "readinessProbe": probe(5, 2, 2)}


def rendezvous_host(job: JobRef, config: RenderConfig) -> str:
    """Rank 0's stable DNS name: the torch.distributed rendezvous."""
    return worker_host(job, 0, config)


def worker_host(job: JobRef, rank: int, config: RenderConfig) -> str:
    return (
        f"{naming.worker_pod_name(job.name, rank)}.{naming.service_name(job.name)}."
        f"{job.namespace}.svc.{config.cluster_domain}"
    )


def one_pod_per_node(job: str) -> dict[str, Any]:
    """At most one worker or spare placeholder of `job` per node (both carry this)."""
    return {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [{
                "labelSelector": {
                    "matchLabels": {naming.LABEL_JOB: job},
                    "matchExpressions": [{"key": naming.LABEL_ROLE, "operator": "In",
                                          "values": [naming.ROLE_WORKER, naming.ROLE_SPARE]}],
                },
                "topologyKey": "kubernetes.io/hostname",
            }]
        }
    }


def _launcher_command(spec: JobSpec, config: RenderConfig) -> list[str]:
    """With in-process restarts the launcher outlives a failed training process and tells
    the operator through the sidecar (no container restart, no kubelet back-off); without,
    it exits (--exit-on-failure) and the node restarts the container, which the pod watch
    sees at once."""
    command = list(config.launcher_command)
    if not spec.failure_policy.in_process_restart and "--exit-on-failure" not in command:
        command.insert(command.index("--") if "--" in command else len(command),
                       "--exit-on-failure")
    return command


def _trainer(job: JobRef, spec: JobSpec, rank: int, config: RenderConfig) -> Manifest:
    template = spec.template
    container: Manifest = {
        "name": naming.TRAINER_CONTAINER,
        "image": template.image,
        "imagePullPolicy": template.image_pull_policy,
        "command": [*_launcher_command(spec, config), *template.command],
        "args": list(template.args),
        "env": _trainer_env(job, spec, rank, config) + [e.to_manifest() for e in template.env],
        "ports": [
            _container_port("rendezvous", config.rendezvous_port),
            _container_port("launcher", config.launcher_port),
        ],
        "volumeMounts": [{"name": naming.SHM_VOLUME, "mountPath": config.shm_mount_path}],
        # A failed run's last log lines land in its terminated state: the message of a job
        # that fails names them (an ImportError, a bad path) without a trip to the logs.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": trainer_security_context(template),
    }
    if template.working_dir:
        container["workingDir"] = template.working_dir
    resources = template.resources.to_manifest()
    if resources:
        container["resources"] = resources
    return container


def _sidecar(
    job: JobRef, spec: JobSpec, rank: int, config: RenderConfig,
    assignment: PeerAssignment | None,
) -> Manifest:
    sidecar = spec.checkpoint.sidecar
    env = [
        *_common_env(job, spec, rank, config),
        _value("GEMINI_TRAFFIC_MODE", spec.checkpoint.traffic_scheduling.value.lower()),
        _value("GEMINI_PEER_ENCRYPTION", "on" if spec.checkpoint.peer_encryption else "off"),
        _value("GEMINI_HEARTBEAT_FILE", heartbeat_path(config)),  # reported by /inventory
    ]
    env += _assignment_env(assignment)
    if spec.persistence is not None:
        env += _s3_env(job, spec.persistence)
    container: Manifest = {
        "name": naming.SIDECAR_CONTAINER,
        "image": sidecar.image,
        "imagePullPolicy": sidecar.image_pull_policy,
        "command": list(config.sidecar_command),
        "restartPolicy": "Always",  # a native sidecar: up before the trainer, down after it
        "env": env,
        "ports": [
            _container_port("peer", config.sidecar_port),
            _container_port("sidecar-api", config.sidecar_api_port),
            _container_port("sidecar-probe", config.sidecar_probe_port),
        ],
        "volumeMounts": [{"name": naming.SHM_VOLUME, "mountPath": config.shm_mount_path}],
        "securityContext": container_security_context(),
        **sidecar_probes(config),
    }
    resources = sidecar.resources.to_manifest()
    if resources:
        container["resources"] = resources
    return container


def heartbeat_path(config: RenderConfig) -> str:
    """The trainer's heartbeat file, in the volume both containers mount."""
    return f"{config.shm_mount_path}/heartbeat"


def _common_env(job: JobRef, spec: JobSpec, rank: int, config: RenderConfig) -> list[Manifest]:
    """What both containers need. Checkpoint ranks are node ranks: one sidecar per node."""
    return [
        _value("GEMINI_JOB", job.name),
        _value("GEMINI_NAMESPACE", job.namespace),
        _value("GEMINI_JOB_UID", job.uid),  # tells a job from an older one of the same name
        _value("GEMINI_RANK", rank),
        _value("GEMINI_WORLD_SIZE", spec.num_nodes),
        {"name": "GEMINI_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        _value("GEMINI_SIDECAR_PORT", config.sidecar_port),
        _value("GEMINI_SIDECAR_API_PORT", config.sidecar_api_port),
        _value("GEMINI_SIDECAR_PROBE_PORT", config.sidecar_probe_port),
        _value("GEMINI_SHM_DIR", config.shm_mount_path),
        # The trainer checks its first snapshot against the budget; the sidecar holds to it.
        _value("GEMINI_MEMORY_BUDGET_BYTES", spec.checkpoint.memory_budget_bytes),
        # m: a version is acknowledged to the trainer once m-1 peers have it
        _value("GEMINI_REPLICAS", spec.checkpoint.replicas),
        {"name": "GEMINI_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": naming.secret_name(job.name), "key": naming.SECRET_TOKEN_KEY}}},
        # not optional: a pod without it would let the job token make every call. A Secret
        # made by an operator before signatures has none: re-create such a job (install.md).
        {"name": CONTROL_PUBLIC_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": naming.secret_name(job.name), "key": naming.SECRET_CONTROL_PUBLIC_KEY_KEY}}},
    ]


def _trainer_env(job: JobRef, spec: JobSpec, rank: int, config: RenderConfig) -> list[Manifest]:
    master = rendezvous_host(job, config)
    env = [
        *_common_env(job, spec, rank, config),
        _value("GEMINI_NUM_PROC_PER_NODE", spec.num_proc_per_node),
        _value("GEMINI_CHECKPOINT_INTERVAL", spec.checkpoint.interval_iterations),
        _value("GEMINI_LAUNCHER_PORT", config.launcher_port),
        # Listen on the pod IP and wait for the operator's first /restart, which names this
        # epoch's rendezvous (rank 0's pod IP; a replaced rank 0 has a new one).
        _value("GEMINI_LAUNCHER_HOST", "$(GEMINI_POD_IP)"),
        _value("GEMINI_LAUNCHER_HOLD", 1),
        *([_value("GEMINI_LAUNCHER_STANDBY", 1)] if spec.failure_policy.warm_standby else []),
        _value("GEMINI_LAUNCHER_IN_PROCESS", int(spec.failure_policy.in_process_restart)),
        *([_value("GEMINI_OPERATOR_HINT_URL", config.hint_url)] if config.hint_url else []),
        # $(VAR) is expanded by the kubelet from the entries above.
        _value("GEMINI_SIDECAR_URL", "http://$(GEMINI_POD_IP):$(GEMINI_SIDECAR_API_PORT)"),
        _value("GEMINI_HEARTBEAT_FILE", heartbeat_path(config)),
        _value("MASTER_ADDR", master),
        _value("MASTER_PORT", config.rendezvous_port),
        _value("NODE_RANK", rank),
        # torchrun reads PET_* (as Kubeflow Trainer sets them).
        _value("PET_NNODES", spec.num_nodes),
        _value("PET_NPROC_PER_NODE", spec.num_proc_per_node),
        _value("PET_NODE_RANK", rank),
        _value("PET_MASTER_ADDR", master),
        _value("PET_MASTER_PORT", config.rendezvous_port),
    ]
    if spec.num_proc_per_node == 1:
        # One process per node: the process group can start from env alone, no torchrun.
        env += [_value("RANK", rank), _value("WORLD_SIZE", spec.num_nodes),
                _value("LOCAL_RANK", 0), _value("LOCAL_WORLD_SIZE", 1)]
    return env


def _assignment_env(assignment: PeerAssignment | None) -> list[Manifest]:
    if assignment is None:
        return []
    peers = ",".join(f"{r}={addr}" for r, addr in sorted(assignment.peers.items()))
    return [
        _value("GEMINI_PEERS", peers),
        _value("GEMINI_HOLD_RANKS", _ranks(assignment.hold_ranks)),
        _value("GEMINI_SEND_TO", _ranks(assignment.send_to)),
    ]


def _s3_env(job: JobRef, persistence: Persistence) -> list[Manifest]:
    env = [
        _value("GEMINI_S3_BUCKET", persistence.bucket),
        _value("GEMINI_S3_PREFIX", persistence.prefix or "gemini"),
        _value("GEMINI_S3_RETAIN", persistence.keep),
    ]
    if persistence.endpoint:
        env.append(_value("GEMINI_S3_ENDPOINT", persistence.endpoint))
    if persistence.credentials_secret:
        secret = persistence.credentials_secret
        env += [
            _secret_env("GEMINI_S3_ACCESS_KEY", secret, naming.S3_ACCESS_KEY_KEY),
            _secret_env("GEMINI_S3_SECRET_KEY", secret, naming.S3_SECRET_KEY_KEY),
            _secret_env("GEMINI_S3_REGION", secret, naming.S3_REGION_KEY, optional=True),
        ]
    return env


def _shm_volume(spec: JobSpec) -> Manifest:
    # The budget bounds checkpoint memory on the node; the tmpfs may not grow past it.
    return {
        "name": naming.SHM_VOLUME,
        "emptyDir": {"medium": "Memory", "sizeLimit": str(spec.checkpoint.memory_budget_bytes)},
    }


def _value(name: str, value: object) -> Manifest:
    return {"name": name, "value": str(value)}


def _secret_env(name: str, secret: str, key: str, optional: bool = False) -> Manifest:
    ref: dict[str, Any] = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(str(r) for r in ranks)


def _container_port(name: str, port: int) -> Manifest:
    return {"name": name, "containerPort": port, "protocol": "TCP"}
