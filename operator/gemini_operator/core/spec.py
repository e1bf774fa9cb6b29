"""A GeminiJob's spec as frozen values, plus the checks the CRD schema cannot express.

The API server has already applied the schema's defaults and limits; parsing repeats the
defaults (so an object stored under an older CRD still parses) and refuses what only the
operator can judge: quantities that are negative or fractional bytes, a sidecar image the
operator cannot resolve. A refusal is a `SpecError` naming the field and what to change; the
reconciler turns it into a Failed condition, never a crash loop.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from gemini_operator.core import pod_template
from gemini_operator.core.pod_template import PodParts, TemplateError
from gemini_operator.core.quantity import QuantityError, parse_bytes, parse_quantity

MAX_JOB_NAME_LENGTH = 48  # "<name>-worker-<rank>" must fit a 63-character DNS label
MAX_RANKS = 65536
DEFAULT_MEMORY_BUDGET_BYTES = 4 << 30
MAX_ID = 2147483647  # a Linux user or group id as Kubernetes accepts it
E = TypeVar("E", bound=StrEnum)
_JOB_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class SpecError(ValueError):
    """A spec the operator refuses; `field` is the JSON path, the message says what to fix."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field_path = field_path
        self.message = message


class PlacementStrategy(StrEnum):
    DOMAIN_AWARE = "DomainAware"
    MIXED = "Mixed"


class TrafficScheduling(StrEnum):
    INTERLEAVED = "Interleaved"
    IMMEDIATE = "Immediate"


class RuleAction(StrEnum):
    FAIL_JOB = "FailJob"
    RESTART_JOB = "RestartJob"
    RESTART_JOB_AND_IGNORE_MAX_RESTARTS = "RestartJobAndIgnoreMaxRestarts"


@dataclass(frozen=True)
class Resources:
    """Requests and limits as the quantity strings the user wrote (validated)."""

    requests: Mapping[str, str] = field(default_factory=dict)
    limits: Mapping[str, str] = field(default_factory=dict)

    def to_manifest(self) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        if self.requests:
            out["requests"] = dict(self.requests)
        if self.limits:
            out["limits"] = dict(self.limits)
        return out


@dataclass(frozen=True)
class EnvVar:
    """One user env entry; `value_from` is passed through to the pod unchanged."""

    name: str
    value: str | None = None
    value_from: Mapping[str, Any] | None = None

    def to_manifest(self) -> dict[str, Any]:
        if self.value_from is not None:
            return {"name": self.name, "valueFrom": dict(self.value_from)}
        return {"name": self.name, "value": self.value or ""}


@dataclass(frozen=True)
class RunAs:
    """`template.securityContext`: the user and group the workers run as; None: the image's.
    User 0 (root) applies to the trainer container alone, the sidecar never runs as root."""

    user: int | None = None
    group: int | None = None

    @property
    def root(self) -> bool:
        return self.user == 0


@dataclass(frozen=True)
class TrainerTemplate:
    image: str
    command: tuple[str, ...]
    args: tuple[str, ...] = ()
    image_pull_policy: str = "IfNotPresent"
    working_dir: str | None = None
    env: tuple[EnvVar, ...] = ()
    resources: Resources = field(default_factory=Resources)
    run_as: RunAs = field(default_factory=RunAs)
    # The pods get no service-account token unless the template asks (they need no API access).
    automount_service_account_token: bool = False
    parts: PodParts = field(default_factory=PodParts)  # a pod template's pass-through fields


@dataclass(frozen=True)
class SidecarSpec:
    image: str
    image_pull_policy: str = "IfNotPresent"
    resources: Resources = field(default_factory=Resources)


@dataclass(frozen=True)
class CheckpointPolicy:
    sidecar: SidecarSpec
    replicas: int = 2
    placement: PlacementStrategy = PlacementStrategy.DOMAIN_AWARE
    interval_iterations: int = 1
    traffic_scheduling: TrafficScheduling = TrafficScheduling.INTERLEAVED
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES  # unset: sidecar memory limit
    peer_encryption: bool = False  # payloads between sidecars encrypted (GEMINI_PEER_ENCRYPTION)


@dataclass(frozen=True)
class Persistence:
    bucket: str
    prefix: str
    endpoint: str | None = None
    credentials_secret: str | None = None
    interval_seconds: int = 3600
    keep: int = 2

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


@dataclass(frozen=True)
class FailureRule:
    name: str
    action: RuleAction
    on_exit_codes: frozenset[int] = frozenset()
    on_pod_failure_reasons: frozenset[str] = frozenset()


@dataclass(frozen=True)
class FailurePolicy:
    max_restarts: int = 10
    hang_timeout_seconds: int = 600
    spare_nodes: int = 0
    rules: tuple[FailureRule, ...] = ()
    # Launchers keep a pre-imported interpreter for the next restart (single-process workers).
    warm_standby: bool = True
    # Survivors of a failure restart inside their training process (gemini_trainer.run).
    in_process_restart: bool = True


@dataclass(frozen=True)
class JobSpec:
    num_nodes: int
    template: TrainerTemplate
    checkpoint: CheckpointPolicy
    failure_policy: FailurePolicy = field(default_factory=FailurePolicy)
    num_proc_per_node: int = 1
    persistence: Persistence | None = None
    suspend: bool = False
    active_deadline_seconds: int | None = None
    ttl_seconds_after_finished: int | None = None

    @property
    def world_size(self) -> int:
        """Training processes in the job (ranks of the process group)."""
        return self.num_nodes * self.num_proc_per_node


def validate_job_name(name: str) -> None:
    """Refuse names whose children would not be valid Kubernetes names."""
    if len(name) > MAX_JOB_NAME_LENGTH:
        raise SpecError(
            "metadata.name",
            f"must be at most {MAX_JOB_NAME_LENGTH} characters (is {len(name)}): worker pods "
            "are named <name>-worker-<rank>",
        )
    if not _JOB_NAME.match(name):
        raise SpecError(
            "metadata.name", "must start with a lower-case letter and contain only a-z, 0-9 and '-'"
        )


def persist_interval_seconds(spec: Mapping[str, Any]) -> int | None:
    """spec.persistence.intervalSeconds (its default when unset); None without persistence,
    or with one `parse_spec` refuses."""
    try:
        persistence = _persistence(spec.get("persistence"))
    except SpecError:
        return None
    return None if persistence is None else persistence.interval_seconds


def parse_spec(spec: Mapping[str, Any], default_sidecar_image: str | None) -> JobSpec:
    """The typed spec, or a SpecError for what the operator refuses."""
    num_nodes = _int(spec, "numNodes", "spec.numNodes", None, minimum=1)
    num_proc = _int(spec, "numProcPerNode", "spec.numProcPerNode", 1, minimum=1)
    if num_nodes * num_proc > MAX_RANKS:
        raise SpecError(
            "spec.numNodes",
            f"numNodes x numProcPerNode is {num_nodes * num_proc}; at most {MAX_RANKS} ranks "
            "are supported",
        )
    checkpoint = _checkpoint(_obj(spec, "checkpoint"), default_sidecar_image)
    if checkpoint.replicas > num_nodes:
        raise SpecError(
            "spec.checkpoint.replicas",
            f"is {checkpoint.replicas} but must be at most spec.numNodes ({num_nodes})",
        )
    return JobSpec(
        num_nodes=num_nodes,
        num_proc_per_node=num_proc,
        template=_template(_obj(spec, "template", required=True)),
        checkpoint=checkpoint,
        failure_policy=_failure_policy(_obj(spec, "failurePolicy")),
        persistence=_persistence(spec.get("persistence")),
        suspend=bool(spec.get("suspend", False)),
        active_deadline_seconds=_optional_int(spec, "activeDeadlineSeconds", minimum=1),
        ttl_seconds_after_finished=_optional_int(spec, "ttlSecondsAfterFinished", minimum=0),
    )


def _template(raw: Mapping[str, Any]) -> TrainerTemplate:
    if pod_template.is_pod_template(raw):
        try:
            return _from_pod_template(raw)
        except TemplateError as err:
            raise SpecError(err.field_path, err.message) from err
    image = raw.get("image")
    if not isinstance(image, str) or not image:
        raise SpecError("spec.template.image", "is required: the trainer's container image")
    command = _strings(raw.get("command"), "spec.template.command")
    if not command:
        raise SpecError("spec.template.command", "is required: the training command to launch")
    return TrainerTemplate(
        image=image,
        command=command,
        args=_strings(raw.get("args"), "spec.template.args"),
        image_pull_policy=str(raw.get("imagePullPolicy", "IfNotPresent")),
        working_dir=raw.get("workingDir"),
        env=tuple(_env(item, i) for i, item in enumerate(raw.get("env") or ())),
        resources=_resources(raw.get("resourcesPerNode"), "spec.template.resourcesPerNode"),
        run_as=_run_as(raw.get("securityContext") or {}),
        automount_service_account_token=_flag(
            raw, "automountServiceAccountToken", "spec.template.automountServiceAccountToken"),
    )


def _from_pod_template(raw: Mapping[str, Any]) -> TrainerTemplate:
    """v1beta1: the trainer container's fields as the v1alpha1 ones, the rest as parts."""
    parts = pod_template.parts_of(raw)
    pod = raw["spec"]
    index, trainer = pod_template.trainer_container(pod)
    path = f"spec.template.spec.containers[{index}]"
    image = trainer.get("image")
    if not isinstance(image, str) or not image:
        raise SpecError(f"{path}.image", "is required: the trainer's container image")
    command = _strings(trainer.get("command"), f"{path}.command")
    if not command:
        raise SpecError(f"{path}.command", "is required: the training command to launch (the "
                        "operator runs it under its launcher, so the image's entrypoint is not "
                        "used)")
    return TrainerTemplate(
        image=image, command=command, args=_strings(trainer.get("args"), f"{path}.args"),
        image_pull_policy=str(trainer.get("imagePullPolicy", "IfNotPresent")),
        working_dir=trainer.get("workingDir"),
        env=tuple(_env(item, i, f"{path}.env") for i, item in enumerate(trainer.get("env") or ())),
        resources=_resources(trainer.get("resources"), f"{path}.resources"),
        run_as=_run_as(pod.get("securityContext") or {}, "spec.template.spec.securityContext"),
        automount_service_account_token=_flag(
            pod, "automountServiceAccountToken", "spec.template.spec.automountServiceAccountToken"),
        parts=parts,
    )


def _run_as(raw: Mapping[str, Any], path: str = "spec.template.securityContext") -> RunAs:
    ids = {key: _optional_id(raw, key, f"{path}.{key}") for key in ("runAsUser", "runAsGroup")}
    return RunAs(user=ids["runAsUser"], group=ids["runAsGroup"])


def _optional_id(raw: Mapping[str, Any], key: str, path: str) -> int | None:
    if raw.get(key) is None:
        return None
    return _int(raw, key, path, None, minimum=0, maximum=MAX_ID)


def _env(raw: Mapping[str, Any], index: int, path: str = "spec.template.env") -> EnvVar:
    if "value" in raw and "valueFrom" in raw:
        raise SpecError(f"{path}[{index}]", "sets value or valueFrom, not both")
    return EnvVar(name=str(raw["name"]), value=raw.get("value"), value_from=raw.get("valueFrom"))


def _checkpoint(raw: Mapping[str, Any], default_sidecar_image: str | None) -> CheckpointPolicy:
    sidecar = _sidecar(_obj(raw, "sidecar"), default_sidecar_image)
    limit = sidecar.resources.limits.get("memory")
    budget = raw.get("memoryBudgetPerNode", limit)
    # A CEL rule comparing the two quantities exceeds the API server's cost budget; check here.
    if budget is not None and limit is not None and _budget(budget) > parse_quantity(limit):
        raise SpecError(
            "spec.checkpoint.memoryBudgetPerNode",
            f"is {budget} but must fit within the sidecar's memory limit ({limit}); raise "
            "spec.checkpoint.sidecar.resources.limits.memory or lower the budget",
        )
    return CheckpointPolicy(
        sidecar=sidecar,
        replicas=_int(raw, "replicas", "spec.checkpoint.replicas", 2, minimum=1, maximum=4),
        placement=_enum(raw, "placement", PlacementStrategy, PlacementStrategy.DOMAIN_AWARE),
        interval_iterations=_int(
            raw, "intervalIterations", "spec.checkpoint.intervalIterations", 1, minimum=1
        ),
        traffic_scheduling=_enum(
            raw, "trafficScheduling", TrafficScheduling, TrafficScheduling.INTERLEAVED
        ),
        memory_budget_bytes=DEFAULT_MEMORY_BUDGET_BYTES if budget is None else _budget(budget),
        peer_encryption=_flag(raw, "peerEncryption", "spec.checkpoint.peerEncryption"),
    )


def _budget(value: str | int) -> int:
    path = "spec.checkpoint.memoryBudgetPerNode"
    try:
        amount = parse_bytes(value)
    except QuantityError as err:
        raise SpecError(path, f"{err}; use e.g. 8Gi") from err
    if amount == 0:
        raise SpecError(path, "must be more than 0 bytes; use e.g. 8Gi, or leave it unset")
    return amount


def _sidecar(raw: Mapping[str, Any], default_image: str | None) -> SidecarSpec:
    image = raw.get("image") or default_image
    if not image:
        raise SpecError(
            "spec.checkpoint.sidecar.image",
            "is not set and the operator has no default sidecar image; set it, or start the "
            "operator with --sidecar-image",
        )
    return SidecarSpec(
        image=str(image),
        image_pull_policy=str(raw.get("imagePullPolicy", "IfNotPresent")),
        resources=_resources(raw.get("resources"), "spec.checkpoint.sidecar.resources"),
    )


def _persistence(raw: Mapping[str, Any] | None) -> Persistence | None:
    if raw is None:
        return None
    uri = str(raw.get("bucketURI", ""))
    match = re.match(r"^s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(\S*))?$", uri)
    if match is None:
        raise SpecError("spec.persistence.bucketURI", "must look like s3://bucket/prefix")
    secret = (raw.get("credentialsSecretRef") or {}).get("name")
    return Persistence(
        bucket=match.group(1),
        prefix=(match.group(2) or "").strip("/"),
        endpoint=raw.get("endpoint"),
        credentials_secret=secret,
        interval_seconds=_int(
            raw, "intervalSeconds", "spec.persistence.intervalSeconds", 3600, minimum=1
        ),
        keep=_int(raw, "keep", "spec.persistence.keep", 2, minimum=1),
    )


def _failure_policy(raw: Mapping[str, Any]) -> FailurePolicy:
    return FailurePolicy(
        max_restarts=_int(raw, "maxRestarts", "spec.failurePolicy.maxRestarts", 10, minimum=0),
        hang_timeout_seconds=_int(
            raw, "hangTimeoutSeconds", "spec.failurePolicy.hangTimeoutSeconds", 600, minimum=10
        ),
        spare_nodes=_int(raw, "spareNodes", "spec.failurePolicy.spareNodes", 0, minimum=0),
        rules=tuple(_rule(item, i) for i, item in enumerate(raw.get("rules") or ())),
        warm_standby=_flag(raw, "warmStandby", "spec.failurePolicy.warmStandby", default=True),
        in_process_restart=_flag(raw, "inProcessRestart", "spec.failurePolicy.inProcessRestart",
                                 default=True),
    )


def _flag(raw: Mapping[str, Any], key: str, path: str, default: bool = False) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(path, f"must be true or false, got {value!r}")
    return value


def _rule(raw: Mapping[str, Any], index: int) -> FailureRule:
    path = f"spec.failurePolicy.rules[{index}]"
    codes = frozenset(int(c) for c in raw.get("onExitCodes") or ())
    reasons = frozenset(str(r) for r in raw.get("onPodFailureReasons") or ())
    if not codes and not reasons:
        raise SpecError(path, "needs onExitCodes or onPodFailureReasons to say what it matches")
    try:
        action = RuleAction(str(raw.get("action")))
    except ValueError as err:
        allowed = ", ".join(a.value for a in RuleAction)
        raise SpecError(f"{path}.action", f"must be one of {allowed}") from err
    return FailureRule(str(raw.get("name", f"rule-{index}")), action, codes, reasons)


def _resources(raw: Mapping[str, Any] | None, path: str) -> Resources:
    if not raw:
        return Resources()
    lists: dict[str, dict[str, str]] = {}
    for kind in ("requests", "limits"):
        lists[kind] = {}
        for name, value in (raw.get(kind) or {}).items():
            lists[kind][name] = _non_negative_quantity(value, f"{path}.{kind}.{name}")
    return Resources(requests=lists["requests"], limits=lists["limits"])


def _non_negative_quantity(value: str | int, path: str) -> str:
    try:
        amount = parse_quantity(value)
    except QuantityError as err:
        raise SpecError(path, str(err)) from err
    if amount < 0:
        raise SpecError(path, f"is {value}; a resource amount cannot be negative")
    return str(value)


def _obj(raw: Mapping[str, Any], key: str, required: bool = False) -> Mapping[str, Any]:
    value = raw.get(key)
    if value is None:
        if required:
            raise SpecError(f"spec.{key}", "is required")
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"spec.{key}", "must be an object")
    return value


def _int(
    raw: Mapping[str, Any], key: str, path: str, default: int | None,
    minimum: int | None = None, maximum: int | None = None,
) -> int:
    value = raw.get(key, default)
    if value is None:
        raise SpecError(path, "is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(path, f"must be a whole number, not {value!r}")
    if minimum is not None and value < minimum:
        raise SpecError(path, f"is {value} but must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise SpecError(path, f"is {value} but must be at most {maximum}")
    return value


def _optional_int(raw: Mapping[str, Any], key: str, minimum: int) -> int | None:
    if raw.get(key) is None:
        return None
    return _int(raw, key, f"spec.{key}", None, minimum=minimum)


def _enum(raw: Mapping[str, Any], key: str, kind: type[E], default: E) -> E:
    value = raw.get(key, default.value)
    try:
        return kind(value)
    except ValueError as err:
        allowed = ", ".join(v.value for v in kind)
        raise SpecError(f"spec.checkpoint.{key}", f"is {value!r}; use one of {allowed}") from err


def _strings(raw: Sequence[Any] | None, path: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str) or not all(isinstance(s, str) for s in raw):
        raise SpecError(path, "must be a list of strings")
    return tuple(raw)
