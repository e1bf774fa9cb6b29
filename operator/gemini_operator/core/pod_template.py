"""A pod template as `spec.template` (GeminiJob v1beta1): metadata and a Kubernetes PodSpec,
as JobSet and Kubeflow Trainer take it.

The container named `trainer` is the training process: the operator wraps its command with
the launcher and adds its environment, the shared-memory volume and mount, and the native
checkpoint sidecar. Everything else passes through to every worker pod unchanged (node
selectors, tolerations, affinity, volumes, image pull secrets, service account, priority
class, scheduler, security context, host network, extended resources, other containers).
What would collide with the operator's own parts is refused here, naming the field.

`parse` gives the TrainerTemplate the v1alpha1 fields filled from the trainer container, with
the rest as PodParts; `merged` puts those parts into a rendered worker or spare pod.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gemini_operator.core import naming

TEMPLATE = "spec.template"
POD = "spec.template.spec"
# What the operator sets on every worker pod: a template setting these is refused.
OPERATOR_POD_FIELDS = ("hostname", "subdomain")
# Environment the operator sets on the trainer (the CRD's v1alpha1 env rules say the same;
# tests/unit/operator/test_pod_template.py checks that render.py writes no other names).
OPERATOR_ENV_PREFIXES = ("GEMINI_", "PET_")
OPERATOR_ENV_NAMES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"})
OPERATOR_PORT_NAMES = ("rendezvous", "launcher")
# Trainer container fields the TrainerTemplate models; the others pass through.
MODELLED_TRAINER = ("name", "image", "command", "args", "imagePullPolicy", "workingDir", "env",
                    "resources")
MODELLED_POD = ("containers", "automountServiceAccountToken")
# Pod fields a spare placeholder takes too, so it is scheduled where a worker would be.
SCHEDULING_FIELDS = ("nodeSelector", "tolerations", "affinity", "imagePullSecrets",
                     "serviceAccountName", "schedulerName", "priorityClassName", "runtimeClassName",
                     "topologySpreadConstraints", "hostNetwork", "dnsPolicy", "dnsConfig")


class TemplateError(ValueError):
    """A template the operator refuses: the field's path and what to change."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field_path, self.message = field_path, message


@dataclass(frozen=True)
class PodParts:
    """What a pod template adds to the pods the operator renders, as the user wrote it."""

    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    pod: Mapping[str, Any] = field(default_factory=dict)  # PodSpec fields but containers
    trainer: Mapping[str, Any] = field(default_factory=dict)  # trainer fields not modelled
    containers: tuple[Mapping[str, Any], ...] = ()  # the template's other containers


def operator_sets(env_name: str) -> bool:
    """Whether the operator sets this environment variable on the trainer."""
    return env_name.startswith(OPERATOR_ENV_PREFIXES) or env_name in OPERATOR_ENV_NAMES


def is_pod_template(raw: Mapping[str, Any]) -> bool:
    """Whether `spec.template` is a pod template (v1beta1) rather than the v1alpha1 fields."""
    return isinstance(raw.get("spec"), Mapping)


def trainer_container(raw: Mapping[str, Any]) -> tuple[int, Mapping[str, Any]]:
    """The index and fields of the container named `trainer`."""
    containers = raw.get("containers")
    if not isinstance(containers, list) or not containers:
        raise TemplateError(f"{POD}.containers", "is required: list the training container, "
                            f"named {naming.TRAINER_CONTAINER!r}")
    for index, container in enumerate(containers):
        if isinstance(container, Mapping) and container.get("name") == naming.TRAINER_CONTAINER:
            return index, container
    names = [c.get("name") for c in containers if isinstance(c, Mapping)]
    raise TemplateError(f"{POD}.containers", f"has no container named "
                        f"{naming.TRAINER_CONTAINER!r} (got {names}): name the training "
                        "container so; the operator wraps its command with the launcher")


def parts_of(template: Mapping[str, Any]) -> PodParts:
    """The template's pass-through parts, refusing what collides with the operator's."""
    meta = template.get("metadata") or {}
    pod = template["spec"]
    index, trainer = trainer_container(pod)
    _check_pod(pod)
    _check_trainer(trainer, f"{POD}.containers[{index}]")
    labels = dict(meta.get("labels") or {})
    for key in labels:
        if key.startswith(naming.GROUP + "/") or key in naming.worker_labels("x", 0, 0):
            raise TemplateError(f"{TEMPLATE}.metadata.labels.{key}",
                                "is a label the operator sets on its pods; use another key")
    others = tuple(c for i, c in enumerate(pod["containers"]) if i != index)
    return PodParts(
        labels=labels, annotations=dict(meta.get("annotations") or {}),
        pod={k: v for k, v in pod.items() if k not in MODELLED_POD},
        trainer={k: v for k, v in trainer.items() if k not in MODELLED_TRAINER},
        containers=others)


def _check_pod(pod: Mapping[str, Any]) -> None:
    for key in OPERATOR_POD_FIELDS:
        if key in pod:
            raise TemplateError(f"{POD}.{key}", "is set by the operator (each worker's stable "
                                "DNS name); remove it")
    if pod.get("restartPolicy") not in (None, "OnFailure"):
        raise TemplateError(f"{POD}.restartPolicy", "must be OnFailure or unset: the launcher "
                            "exits on a failed run and is restarted in place")
    reserved = {naming.SIDECAR_CONTAINER}
    for kind in ("containers", "initContainers"):
        for i, container in enumerate(pod.get(kind) or ()):
            if container.get("name") in reserved:
                raise TemplateError(f"{POD}.{kind}[{i}].name", f"{container.get('name')!r} is "
                                    "the operator's checkpoint sidecar; use another name")
    for i, volume in enumerate(pod.get("volumes") or ()):
        if volume.get("name") == naming.SHM_VOLUME:
            raise TemplateError(f"{POD}.volumes[{i}].name", f"{naming.SHM_VOLUME!r} is the "
                                "operator's checkpoint memory volume; use another name")


def _check_trainer(trainer: Mapping[str, Any], path: str) -> None:
    for i, env in enumerate(trainer.get("env") or ()):
        if operator_sets(str(env.get("name"))):
            raise TemplateError(f"{path}.env[{i}].name", f"{env.get('name')} is set by the "
                                "operator for the launcher and training; remove it")
    for i, port in enumerate(trainer.get("ports") or ()):
        if port.get("name") in OPERATOR_PORT_NAMES:
            raise TemplateError(f"{path}.ports[{i}].name", f"{port.get('name')!r} is a port "
                                "the operator opens on the trainer; use another name")
    for i, mount in enumerate(trainer.get("volumeMounts") or ()):
        if mount.get("name") == naming.SHM_VOLUME:
            raise TemplateError(f"{path}.volumeMounts[{i}].name", "the operator mounts its "
                                "checkpoint memory volume itself; remove this mount")


# -- rendering -------------------------------------------------------------------------------

def merged(pod: Mapping[str, Any], parts: PodParts, scheduling_only: bool = False
           ) -> dict[str, Any]:
    """`pod` (rendered by the operator) with the template's parts: labels and annotations
    added (the operator's win), PodSpec fields passed through, lists joined (containers,
    init containers, volumes, the trainer's mounts, ports and env), the anti-affinity merged
    with the user's affinity, security contexts overlaid on the hardened defaults. A spare
    placeholder (`scheduling_only`) takes only what decides where it can run."""
    out = copy.deepcopy(dict(pod))
    meta = out.setdefault("metadata", {})
    meta["labels"] = {**parts.labels, **meta.get("labels", {})}
    if parts.annotations and not scheduling_only:
        meta["annotations"] = {**parts.annotations, **meta.get("annotations", {})}
    spec = out["spec"]
    user = copy.deepcopy(dict(parts.pod))
    if scheduling_only:
        user = {k: v for k, v in user.items() if k in SCHEDULING_FIELDS}
    _merge_affinity(spec, user.pop("affinity", None))
    if "securityContext" in user:
        spec["securityContext"] = {**spec.get("securityContext", {}),
                                   **user.pop("securityContext")}
    for key in ("initContainers", "volumes"):
        if key in user:  # the user's init containers run before the sidecar starts
            spec[key] = [*user.pop(key), *spec.get(key, [])]
    spec.update(user)
    if not scheduling_only:
        _merge_trainer(spec, parts)
    return out


def _merge_affinity(spec: dict[str, Any], user: Mapping[str, Any] | None) -> None:
    if not user:
        return
    ours = spec.get("affinity", {})
    affinity = {**copy.deepcopy(dict(user))}
    anti = dict(affinity.get("podAntiAffinity") or {})
    key = "requiredDuringSchedulingIgnoredDuringExecution"
    terms = [*(anti.get(key) or []), *ours.get("podAntiAffinity", {}).get(key, [])]
    if terms:
        anti[key] = terms
        affinity["podAntiAffinity"] = anti
    spec["affinity"] = affinity


def _merge_trainer(spec: dict[str, Any], parts: PodParts) -> None:
    trainer = next(c for c in spec["containers"] if c["name"] == naming.TRAINER_CONTAINER)
    extra = copy.deepcopy(dict(parts.trainer))
    if "securityContext" in extra:
        trainer["securityContext"] = {**trainer.get("securityContext", {}),
                                      **extra.pop("securityContext")}
    for key in ("volumeMounts", "ports"):
        if key in extra:
            trainer[key] = [*trainer.get(key, []), *extra.pop(key)]
    trainer.update(extra)
    spec["containers"] = [*spec["containers"], *copy.deepcopy(list(parts.containers))]


# -- migration from v1alpha1 -----------------------------------------------------------------

LEGACY_TRAINER = {"image": "image", "imagePullPolicy": "imagePullPolicy", "command": "command",
                  "args": "args", "workingDir": "workingDir", "env": "env",
                  "resourcesPerNode": "resources"}


def from_v1alpha1(template: Mapping[str, Any]) -> dict[str, Any]:
    """A v1alpha1 `spec.template` (the trainer's fields) as the v1beta1 pod template that
    renders the same pods. A pod template is returned unchanged."""
    if is_pod_template(template):
        return copy.deepcopy(dict(template))
    trainer: dict[str, Any] = {"name": naming.TRAINER_CONTAINER}
    for old, new in LEGACY_TRAINER.items():
        if old in template:
            trainer[new] = copy.deepcopy(template[old])
    pod: dict[str, Any] = {"containers": [trainer]}
    if template.get("securityContext"):
        pod["securityContext"] = copy.deepcopy(dict(template["securityContext"]))
    if "automountServiceAccountToken" in template:
        pod["automountServiceAccountToken"] = template["automountServiceAccountToken"]
    return {"spec": pod}
