"""Pure pod-spec logic of the node agent: quantities, environment, downward API, pod phase.

Everything here is a function of plain dicts (the JSON the API server returns), so it is
unit-tested without a cluster. The rules follow the kubelet's (pkg/kubelet/kubelet_pods.go).
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

Obj = dict[str, Any]

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL: dict[str, Fraction | int] = {
    "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": 1, "k": 10**3,
    "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE]|)$")


class ConfigError(Exception):
    """A pod cannot start as specified (missing ConfigMap key, bad field path...)."""


def parse_quantity(text: str | int | float) -> Fraction:
    """A Kubernetes quantity ("500m", "32Gi", "1e3") as an exact number."""
    match = _QUANTITY.match(str(text).strip())
    if not match:
        raise ConfigError(f"not a quantity: {text!r}")
    number, suffix = Fraction(match.group(1)), match.group(2)
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    return number * Fraction(10 ** int(suffix[1:])) if int(suffix[1:]) >= 0 else \
        number / Fraction(10 ** -int(suffix[1:]))


def expand(text: str, env: Mapping[str, str]) -> str:
    """Expand $(VAR) from `env`; $$ escapes; unknown references stay as written (kubelet rule)."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2 : end]
            out.append(env.get(name, text[i : end + 1]))
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


@dataclass(frozen=True)
class PodFacts:
    """What the downward API can expose about a pod on this node."""

    pod: Obj
    pod_ip: str
    host_ip: str
    node_allocatable: Mapping[str, str]


def field_value(path: str, facts: PodFacts) -> str:
    """The value of a downward API `fieldRef.fieldPath`."""
    meta = facts.pod.get("metadata", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": facts.pod.get("spec", {}).get("nodeName", ""),
        "spec.serviceAccountName": facts.pod.get("spec", {}).get("serviceAccountName", ""),
        "status.podIP": facts.pod_ip,
        "status.podIPs": facts.pod_ip,
        "status.hostIP": facts.host_ip,
        "status.hostIPs": facts.host_ip,
    }
    if path in simple:
        return str(simple[path])
    for kind in ("labels", "annotations"):
        if path == f"metadata.{kind}":
            items = sorted((meta.get(kind) or {}).items())
            return "\n".join(f'{k}="{v}"' for k, v in items)
        match = re.fullmatch(rf"metadata\.{kind}\['([^']*)'\]", path)
        if match:
            return str((meta.get(kind) or {}).get(match.group(1), ""))
    raise ConfigError(f"unsupported downward API fieldPath {path!r}")


def resource_value(ref: Obj, container: Obj, facts: PodFacts) -> str:
    """The value of a `resourceFieldRef`: limits fall back to the node's allocatable."""
    resource = ref["resource"]
    kind, _, name = resource.partition(".")
    resources = container.get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    if kind == "limits":
        raw = limits.get(name, facts.node_allocatable.get(name, "0"))
    elif kind == "requests":
        raw = requests.get(name, limits.get(name, "0"))
    else:
        raise ConfigError(f"unsupported resourceFieldRef resource {resource!r}")
    divisor = parse_quantity(ref.get("divisor") or "1")
    if divisor == 0:
        raise ConfigError(f"resourceFieldRef {resource!r} has divisor 0")
    return str(math.ceil(parse_quantity(raw) / divisor))


def decode_data(obj: Obj, secret: bool) -> dict[str, bytes]:
    """ConfigMap data/binaryData or Secret data as bytes by key."""
    out = {str(k): base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}
    for key, text in (obj.get("data") or {}).items():
        out[str(key)] = base64.b64decode(text) if secret else str(text).encode()
    for key, text in (obj.get("stringData") or {}).items():
        out[str(key)] = str(text).encode()
    return out


Lookup = Mapping[tuple[str, str], Obj | None]  # ("configmap"|"secret", name) -> object or None


def container_env(
    container: Obj, facts: PodFacts, objects: Lookup, base: Mapping[str, str]
) -> dict[str, str]:
    """The environment of one container: `base`, then envFrom, then env (in order, expanded)."""
    env = dict(base)
    for source in container.get("envFrom") or []:
        kind, ref = _env_from_ref(source)
        data = _referenced(objects, kind, ref)
        if data is None:
            continue
        for key, raw in data.items():
            env[source.get("prefix", "") + key] = raw.decode(errors="replace")
    for var in container.get("env") or []:
        value = _env_value(var, container, facts, objects, env)
        if value is not None:
            env[var["name"]] = value
    return env


def _env_from_ref(source: Obj) -> tuple[str, Obj]:
    if "configMapRef" in source:
        return "configmap", source["configMapRef"]
    if "secretRef" in source:
        return "secret", source["secretRef"]
    raise ConfigError(f"unsupported envFrom source {sorted(source)}")


def _referenced(objects: Lookup, kind: str, ref: Obj) -> dict[str, bytes] | None:
    obj = objects.get((kind, ref["name"]))
    if obj is None:
        if ref.get("optional"):
            return None
        raise ConfigError(f"{kind} {ref['name']!r} not found")
    return decode_data(obj, secret=kind == "secret")


def _env_value(
    var: Obj, container: Obj, facts: PodFacts, objects: Lookup, env: Mapping[str, str]
) -> str | None:
    if "valueFrom" not in var:
        return expand(str(var.get("value", "")), env)
    source = var["valueFrom"]
    if "fieldRef" in source:
        return field_value(source["fieldRef"]["fieldPath"], facts)
    if "resourceFieldRef" in source:
        return resource_value(source["resourceFieldRef"], container, facts)
    for key, kind in (("configMapKeyRef", "configmap"), ("secretKeyRef", "secret")):
        if key in source:
            ref = source[key]
            data = _referenced(objects, kind, ref)
            if data is None:
                return None
            if ref["key"] not in data:
                if ref.get("optional"):
                    return None
                raise ConfigError(f"key {ref['key']!r} not found in {kind} {ref['name']!r}")
            return data[ref["key"]].decode(errors="replace")
    raise ConfigError(f"unsupported valueFrom in env var {var['name']!r}")


def referenced_objects(pod: Obj) -> set[tuple[str, str]]:
    """Every (kind, name) of ConfigMap/Secret the pod's env and volumes refer to."""
    refs: set[tuple[str, str]] = set()
    spec = pod.get("spec", {})
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        for source in c.get("envFrom") or []:
            kind, ref = _env_from_ref(source)
            refs.add((kind, ref["name"]))
        for var in c.get("env") or []:
            value_from = var.get("valueFrom") or {}
            if "configMapKeyRef" in value_from:
                refs.add(("configmap", value_from["configMapKeyRef"]["name"]))
            if "secretKeyRef" in value_from:
                refs.add(("secret", value_from["secretKeyRef"]["name"]))
    for volume in spec.get("volumes") or []:
        sources = [volume, *((volume.get("projected") or {}).get("sources") or [])]
        for source in sources:
            if "configMap" in source:
                refs.add(("configmap", source["configMap"]["name"]))
            if "secret" in source:
                refs.add(("secret", source["secret"].get("secretName") or source["secret"]["name"]))
    return refs


# --- restart policy, back-off and phase ------------------------------------------------------

BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 10.0
# A container that ran this long before exiting starts its back-off afresh.
BACKOFF_RESET_AFTER_S = 20.0


def restart_delay(consecutive_failures: int) -> float:
    """Seconds before restart number n of a crash loop: 0, then 1 s doubling up to 10 s."""
    if consecutive_failures <= 1:
        return 0.0
    return float(min(BACKOFF_INITIAL_S * 2 ** (consecutive_failures - 2), BACKOFF_MAX_S))


def should_restart(restart_policy: str, exit_code: int) -> bool:
    """Whether a main container is restarted after exiting with `exit_code`."""
    if restart_policy == "Always":
        return True
    if restart_policy == "OnFailure":
        return exit_code != 0
    return False


def is_sidecar(container: Obj) -> bool:
    """A native sidecar: an init container with restartPolicy Always."""
    return container.get("restartPolicy") == "Always"


def pod_phase(
    restart_policy: str, initialized: bool, init_failed: bool, main_states: Sequence[Obj],
    main_restarting: Sequence[bool],
) -> str:
    """The pod phase from the main containers' states (kubelet getPhase, simplified).

    `main_states` are containerStatus.state dicts; `main_restarting[i]` says whether container
    i ran before and will be started again (so it counts as running while it waits).
    """
    if init_failed:
        return "Failed"
    if not initialized:
        return "Pending"
    running = waiting_first = succeeded = failed = 0
    for state, restarting in zip(main_states, main_restarting, strict=True):
        if "running" in state or restarting:
            running += 1
        elif "terminated" in state:
            if state["terminated"].get("exitCode", 1) == 0:
                succeeded += 1
            else:
                failed += 1
        else:
            waiting_first += 1
    if waiting_first:
        return "Running" if running else "Pending"
    if running:
        return "Running"
    if restart_policy == "Always":
        return "Running"
    return "Failed" if failed else "Succeeded"


def condition(
    kind: str, status: bool, now: str, reason: str = "", previous: Obj | None = None
) -> Obj:
    """A pod condition; lastTransitionTime kept from `previous` when the status is unchanged."""
    value = "True" if status else "False"
    since = now
    if previous and previous.get("status") == value:
        since = previous.get("lastTransitionTime") or now
    cond: Obj = {"type": kind, "status": value, "lastProbeTime": None, "lastTransitionTime": since}
    if reason:
        cond["reason"] = reason
    return cond
