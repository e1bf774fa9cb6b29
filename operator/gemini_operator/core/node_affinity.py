"""Steering a rendered pod off lost nodes and towards spare ones, within the node affinity the
job's pod template already gives it (a GPU job's nodeAffinity must survive a recovery).

Kubernetes ORs the required terms and ANDs the requirements of a term, and a `metadata.name`
field requirement takes one value: so "not on node X" joins every term, one requirement per
node; preferred terms are added to the template's own.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

Manifest = dict[str, Any]
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"
SPARE_WEIGHT = 100


def avoiding_nodes(manifest: Manifest, nodes: Sequence[str]) -> Manifest:
    """`manifest` kept off `nodes` (lost ones the scheduler may not know about yet)."""
    if not nodes:
        return manifest
    out = copy.deepcopy(manifest)
    keep_off = [{"key": "metadata.name", "operator": "NotIn", "values": [node]}
                for node in nodes]
    required = _node_affinity(out).setdefault(REQUIRED, {})
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [
        {**term, "matchFields": [*(term.get("matchFields") or []), *keep_off]}
        for term in terms]
    return out


def preferring_nodes(manifest: Manifest, names: Sequence[str]) -> Manifest:
    """`manifest` with a preference for each of `names` (one term per node), after the
    template's own preferences."""
    if not names:
        return manifest
    out = copy.deepcopy(manifest)
    node_affinity = _node_affinity(out)
    node_affinity[PREFERRED] = [*(node_affinity.get(PREFERRED) or []), *(
        {"weight": SPARE_WEIGHT, "preference": {"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [name]}]}}
        for name in names)]
    return out


def _node_affinity(manifest: Manifest) -> dict[str, Any]:
    affinity: dict[str, Any] = manifest["spec"].setdefault("affinity", {})
    return affinity.setdefault("nodeAffinity", {})  # type: ignore[no-any-return]
