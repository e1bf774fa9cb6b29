"""The shipped example GeminiJobs (examples/geminijob-zero3.yaml: DeepSpeed ZeRO-3,
examples/geminijob-fsdp.yaml: PyTorch FSDP2) run to Succeeded on the local cluster, the FSDP
one through a trainer crash, and rank 0's per-step losses equal an uninterrupted loopback run
of the same script with the same arguments.

The manifests are loaded from examples/ and changed only where the local cluster needs it
(see `localize`); everything else (placement, failure policy, resources, budgets) is applied
as shipped.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from gemini_demo.reference import ReferenceRun
from gemini_demo.reference_cache import ReferenceCache
from gemini_local import faults
from gemini_operator.core import naming
from tests.cluster.test_operator import Jobs, wait_for
from tests.cluster.test_operator_recovery import losses, newest_step
from tests.fixtures.operator import OperatorThread
from tests.fixtures.s3 import S3Server, create_credentials_secret

# Node-agent twin of a kubelet-node proof: `./dev long` only (tests/proofs.py).
pytestmark = [pytest.mark.cluster, pytest.mark.e2e, pytest.mark.s3, pytest.mark.long]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
MANIFESTS = {"zero3": EXAMPLES / "geminijob-zero3.yaml", "fsdp": EXAMPLES / "geminijob-fsdp.yaml"}
WORKERS = 2
# A tiny model for 12 steps, paced so that a crash lands mid-run (the 2-core CI box).
TINY = {"--steps": "12", "--layers": "1", "--d-model": "32", "--step-sleep": "0.3"}


def with_options(args: list[str], options: dict[str, str]) -> list[str]:
    """`args` with each `--flag value` of `options` replaced, or appended when absent."""
    out = list(args)
    for flag, value in options.items():
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


def localize(manifest: dict[str, Any], namespace: str, s3: S3Server, prefix: str
             ) -> dict[str, Any]:
    """The shipped manifest with the local cluster's edits, and only those."""
    job = copy.deepcopy(manifest)
    spec = job["spec"]
    job["metadata"]["namespace"] = namespace
    template = trainer_of(job)
    # Pods run as local processes from this checkout (images are not pulled): the image's
    # /app is the repository here.
    template["command"] = [str(REPO / c[len("/app/"):]) if c.startswith("/app/") else c
                           for c in template["command"]]
    # A tiny model on 2 workers with 1 thread each: the box has 2 cores and 4 nodes.
    template["args"] = with_options(template.get("args", []), TINY)
    template["env"] = [e for e in template.get("env", []) if e["name"] != "OMP_NUM_THREADS"]
    template["env"].append({"name": "OMP_NUM_THREADS", "value": "1"})
    spec["numNodes"] = WORKERS
    spec["checkpoint"]["replicas"] = min(spec["checkpoint"].get("replicas", 2), WORKERS)
    # The local S3 server (Ceph RGW) in place of AWS; the credentials Secret the manifest's
    # comment tells users to create is created by the test.
    endpoint = s3.endpoint
    spec["persistence"].update(bucketURI=f"s3://{endpoint.bucket}/{prefix.rstrip('/')}",
                               endpoint=endpoint.url)
    return job


def create_credentials(core: client.CoreV1Api, namespace: str, job: dict[str, Any],
                       s3: S3Server) -> None:
    create_credentials_secret(core, namespace, s3.endpoint,
                              job["spec"]["persistence"]["credentialsSecretRef"]["name"])


def trainer_of(job: dict[str, Any]) -> dict[str, Any]:
    """The pod template's container named trainer."""
    (trainer,) = [c for c in job["spec"]["template"]["spec"]["containers"]
                  if c["name"] == "trainer"]
    return trainer  # the job's own dict: edits to it edit the job


def script_and_args(job: dict[str, Any]) -> tuple[Path, list[str]]:
    """The training script and its arguments as the localized job runs them."""
    trainer = trainer_of(job)
    command = trainer["command"]
    assert command[0] == "python" and len(command) == 2, command
    return Path(command[1]), list(trainer["args"])


@pytest.fixture
def run_example(local_cluster: Any, gemini_operator: OperatorThread, kube_api: client.ApiClient,
                job_namespace: str, s3_server: S3Server, s3_prefix: str, tmp_path: Path
                ) -> Iterator[Any]:
    """Applies one localized example, with its loopback reference run started alongside."""
    jobs = Jobs(kube_api, job_namespace)
    started: list[ReferenceRun] = []

    def apply(example: str) -> tuple[Jobs, dict[str, Any], ReferenceRun]:
        manifest = yaml.safe_load(MANIFESTS[example].read_text())
        job = localize(manifest, job_namespace, s3_server, s3_prefix)
        script, args = script_and_args(job)
        reference = ReferenceRun(script, args, WORKERS, tmp_path / "reference",
                                 cache=ReferenceCache()).start()
        started.append(reference)
        create_credentials(jobs.core, job_namespace, job, s3_server)
        jobs.custom.create_namespaced_custom_object(naming.GROUP, naming.VERSION, job_namespace,
                                                    naming.PLURAL, job)
        return jobs, job, reference

    yield apply
    for reference in started:
        reference.stop()


def finish(jobs: Jobs, name: str) -> dict[str, Any]:
    wait_for(lambda: jobs.state(name) in ("Succeeded", "Failed"), 420, f"{name} to finish")
    status: dict[str, Any] = jobs.get(name)["status"]
    assert status["state"] == "Succeeded", status
    return status


def assert_reference_losses(state_dir: Path, namespace: str, name: str,
                            reference: ReferenceRun) -> None:
    expected = reference.wait(timeout=300)
    assert sorted(expected) == list(range(1, int(TINY["--steps"]) + 1))
    got, conflicts = losses(state_dir, namespace, f"{name}-worker-0")
    assert not conflicts, conflicts
    assert got == expected


@pytest.mark.proves("shipped-examples")
def test_the_zero3_example_trains_to_the_reference_losses(local_cluster: Any,
                                                          run_example: Any) -> None:
    jobs, job, reference = run_example("zero3")
    name = job["metadata"]["name"]
    status = finish(jobs, name)
    assert status.get("checkpoint", {}).get("persistedStep"), status  # S3 as configured
    assert_reference_losses(local_cluster.state_dir, jobs.ns, name, reference)
    jobs.delete(name)


@pytest.mark.proves("shipped-examples", "trainer-crash")
def test_the_fsdp_example_recovers_a_trainer_crash_with_the_reference_losses(
    local_cluster: Any, run_example: Any,
) -> None:
    jobs, job, reference = run_example("fsdp")
    name = job["metadata"]["name"]
    state = local_cluster.state_dir
    wait_for(lambda: newest_step(state, jobs.ns, f"{name}-worker-0") >= 4, 300,
             "training to reach step 4")
    launch_epoch = jobs.get(name)["status"]["launch"]["epoch"]
    faults.kill_container(state, jobs.ns, f"{name}-worker-1", "trainer")
    killed_at = time.monotonic()

    def recovered() -> Any:
        last = ((jobs.get(name) or {}).get("status") or {}).get("lastRecovery")
        return last if last and last["epoch"] > launch_epoch else None

    last = wait_for(recovered, 180, "the recovery to finish")
    print(f"fsdp example: recovered in {time.monotonic() - killed_at:.1f} s, {last}")
    assert (last["cause"], last["source"]) == ("software", "Local"), last
    status = finish(jobs, name)
    assert status["restarts"] >= 1, status
    assert_reference_losses(state, jobs.ns, name, reference)
    jobs.delete(name)
