"""`gemini migrate`: a v1alpha1 GeminiJob becomes a v1beta1 one whose pods are the same."""

from __future__ import annotations

import io
import sys
from typing import Any

import pytest
import yaml

from gemini_cli import main
from gemini_cli.migrate import migrated
from gemini_operator.core import render
from gemini_operator.core.spec import parse_spec
from tests.unit.operator.builders import make_job

JOB = render.JobRef("train", "ml", "uid-1")


def legacy() -> dict[str, Any]:
    body = (make_job("train").with_nodes(2)
            .set("template.args", ["--steps", "10"]).set("template.workingDir", "/w")
            .set("template.imagePullPolicy", "Always")
            .set("template.env", [{"name": "LR", "value": "0.1"}])
            .set("template.resourcesPerNode", {"limits": {"memory": "8Gi",
                                                          "nvidia.com/gpu": 8}})
            .set("template.securityContext", {"runAsUser": 1000, "runAsGroup": 1000})
            .set("template.automountServiceAccountToken", True).obj())
    body["apiVersion"] = "gemini.io/v1alpha1"
    return body


def pods(body: dict[str, Any]) -> list[dict[str, Any]]:
    spec = parse_spec(body["spec"], "gemini:side")
    return [render.worker_pod(JOB, spec, r, 0, render.RenderConfig()) for r in range(2)]


def test_a_migrated_job_renders_the_same_pods() -> None:
    old = legacy()
    new = migrated(old)
    assert new["apiVersion"] == "gemini.io/v1beta1"
    (trainer,) = new["spec"]["template"]["spec"]["containers"]
    assert trainer["name"] == "trainer" and trainer["resources"]["limits"]["memory"] == "8Gi"
    assert pods(new) == pods(old)


def test_other_documents_and_v1beta1_jobs_pass_through(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    already = migrated(legacy())
    other = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}
    text = yaml.safe_dump_all([legacy(), other, already])
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert main(["migrate", "-"]) == 0
    out = list(yaml.safe_load_all(capsys.readouterr().out))
    assert out == [already, other, already]


def test_a_file_that_is_not_yaml_is_refused(tmp_path: Any,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    assert main(["migrate", str(bad)]) == 2
    assert "is not YAML" in capsys.readouterr().err
