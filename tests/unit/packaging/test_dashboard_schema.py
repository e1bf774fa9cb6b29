"""The dashboard against Grafana's published dashboard schema, as its foundation SDK types it
(grafana-foundation-sdk, Apache-2.0, generated from that schema; Grafana's server is not used).
The SDK's decoder keeps only the fields the schema defines: a round trip that drops nothing
means every field of the dashboard is one Grafana knows, where a misspelled `targets` or
`fieldConfig` would silently vanish from the panel."""

from __future__ import annotations

import copy
import json
from typing import Any

from grafana_foundation_sdk.models.dashboard import Dashboard

from tests.unit.packaging.test_dashboard import DASHBOARD


def _round_trip(dashboard: dict[str, Any]) -> Any:
    typed = Dashboard.from_json(dashboard).to_json()
    return json.loads(json.dumps(typed, default=lambda o: o.to_json()))


def dropped(before: Any, after: Any, path: str = "") -> list[str]:
    """The paths of `before` that `after` lacks (or holds as another shape)."""
    if isinstance(before, dict):
        if not isinstance(after, dict):
            return [f"{path} (not an object after)"]
        return [p for key, value in before.items()
                for p in ([f"{path}.{key}"] if key not in after
                          else dropped(value, after[key], f"{path}.{key}"))]
    if isinstance(before, list):
        if not isinstance(after, list) or len(before) != len(after):
            return [f"{path} (not the same list after)"]
        return [p for i, (b, a) in enumerate(zip(before, after, strict=True))
                for p in dropped(b, a, f"{path}[{i}]")]
    return []


def test_every_field_of_the_dashboard_is_one_grafanas_schema_defines():
    assert dropped(DASHBOARD, _round_trip(DASHBOARD)) == []


def test_a_misspelled_panel_field_is_caught():
    broken = copy.deepcopy(DASHBOARD)
    panel = next(p for p in broken["panels"] if p.get("targets"))
    panel["target"] = panel.pop("targets")
    index = broken["panels"].index(panel)
    assert dropped(broken, _round_trip(broken)) == [f".panels[{index}].target"]
