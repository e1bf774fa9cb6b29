"""`kubectl gemini`: a kubectl plugin to inspect and steer GeminiJobs.

kubectl runs the executable `kubectl-gemini` (installed with this package) for
`kubectl gemini ...`. Subcommands:

  status JOB    workers, placement groups, replica coverage, newest steps in memory and S3,
                recoveries and conditions
  plan JOB      the recovery probability for random node failures under the job's placement,
                and the recovery plan if the given nodes, zones or racks failed now
  persist JOB   ask the operator for an S3 checkpoint now (annotation gemini.io/persist-requested)

The cluster is found like kubectl finds it: --kubeconfig, else $KUBECONFIG, else
~/.kube/config (or the in-cluster service account); --context picks a context and
-n/--namespace the namespace (default: the context's namespace, else "default").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from urllib3.exceptions import HTTPError

from gemini import rank_detail
from gemini_cli import CliError, run
from gemini_cli.kubectl_objects import (
    FINISHED_STATES,
    PERSIST_ANNOTATION,
    job_info,
    node_infos,
    worker_infos,
)
from gemini_cli.kubectl_plan import FailureRequest, plan_report, render_plan
from gemini_cli.kubectl_status import render_status, status_report
from gemini_cli.output import add_output_flag, emit
from gemini_operator.core import naming

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
T = TypeVar("T")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubectl gemini", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_cluster_flags(parser, None)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True

    status = _subcommand(subparsers, "status", "show a GeminiJob's workers, placement, "
                         "checkpoints and recoveries")
    add_output_flag(status)
    status.set_defaults(func=run_status)

    plan = _subcommand(subparsers, "plan", "what would happen if nodes, zones or racks "
                       "failed now")
    plan.add_argument("--fail-node", action="append", default=[], metavar="NODE",
                      help="a node that fails (repeatable)")
    plan.add_argument("--fail-zone", action="append", default=[], metavar="ZONE",
                      help="a zone whose nodes all fail (label topology.kubernetes.io/zone)")
    plan.add_argument("--fail-rack", action="append", default=[], metavar="RACK",
                      help="a rack whose nodes all fail (label topology.gemini.io/rack; "
                      "ZONE/RACK when rack names repeat across zones)")
    plan.add_argument("-k", "--failures", type=int, metavar="K",
                      help="also show the probability for K random node failures")
    add_output_flag(plan)
    plan.set_defaults(func=run_plan)

    persist = _subcommand(subparsers, "persist", "request an S3 checkpoint now")
    persist.add_argument("-o", "--output", choices=["table", "json"], default="table",
                         help="output format (default: table)")
    persist.set_defaults(func=run_persist)
    return parser


def _subcommand(subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
                help_text: str) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    parser.add_argument("job", metavar="JOB", help="the GeminiJob's name")
    # Also accepted after the subcommand; SUPPRESS keeps a value given before it.
    _add_cluster_flags(parser, argparse.SUPPRESS)
    return parser


def _add_cluster_flags(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("--kubeconfig", default=default,
                        help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)")
    parser.add_argument("--context", default=default, help="kubeconfig context to use")
    parser.add_argument("-n", "--namespace", default=default,
                        help="namespace of the job (default: the context's, else default)")


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


# --- subcommands -------------------------------------------------------------------------------


def run_status(args: argparse.Namespace) -> int:
    kube = Kube.connect(args)
    job = job_info(kube.get_job(args.job))
    workers = worker_infos(kube.worker_pods(args.job))
    nodes = node_infos(kube.nodes())
    emit(args, status_report(job, workers, nodes, kube.job_events(args.job)), render_status)
    return 0


def run_plan(args: argparse.Namespace) -> int:
    kube = Kube.connect(args)
    job = job_info(kube.get_job(args.job))
    request = FailureRequest(tuple(args.fail_node), tuple(args.fail_zone), tuple(args.fail_rack))
    workers = worker_infos(kube.worker_pods(args.job))
    nodes = node_infos(kube.nodes())
    emit(args, plan_report(job, workers, nodes, request, args.failures), render_plan)
    return 0


def run_persist(args: argparse.Namespace) -> int:
    kube = Kube.connect(args)
    job = job_info(kube.get_job(args.job))
    if not job.persistence:
        raise CliError(f"geminijob {job.name} has no spec.persistence: set "
                       "spec.persistence.bucketURI (while suspended) to checkpoint to S3")
    if job.state in FINISHED_STATES or job.suspended:
        raise CliError(f"geminijob {job.name} is {'suspended' if job.suspended else job.state}: "
                       "no running worker can write a checkpoint")
    requested = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    kube.annotate_job(args.job, {PERSIST_ANNOTATION: requested})
    checkpoint = job.status.get("checkpoint") or {}
    result = {
        "job": job.name, "namespace": kube.namespace, "annotation": PERSIST_ANNOTATION,
        "requested": requested, "persistedStepBefore": checkpoint.get("persistedStep"),
        "inMemoryStep": checkpoint.get("inMemoryStep"),
        "watch": f"kubectl get geminijob {job.name} -n {kube.namespace} -w",
    }
    emit(args, result, _render_persist)
    return 0


def _render_persist(result: dict[str, Any]) -> str:
    before = result["persistedStepBefore"]
    return "\n".join([
        f"requested an S3 checkpoint of {result['namespace']}/{result['job']} at "
        f"{result['requested']} (annotation {result['annotation']})",
        f"the operator persists the newest step complete in memory (now "
        f"{_or_none(result['inMemoryStep'])}); the newest step in S3 is "
        f"{_or_none(before)}",
        f"watch the S3-Step column change: {result['watch']}",
    ])


def _or_none(value: object) -> str:
    return "none" if value is None else str(value)


# --- the Kubernetes API ------------------------------------------------------------------------


@dataclass
class Kube:
    """The few API calls the plugin makes, with errors turned into sentences."""

    api: client.ApiClient
    namespace: str

    @staticmethod
    def connect(args: argparse.Namespace) -> Kube:
        api, namespace = _load_config(args.kubeconfig, args.context)
        return Kube(api, args.namespace or namespace)

    def get_job(self, name: str) -> dict[str, Any]:
        custom = client.CustomObjectsApi(self.api)
        found: Any = self._call(f"geminijob {name}", lambda: custom.get_namespaced_custom_object(
            naming.GROUP, naming.VERSION, self.namespace, naming.PLURAL, name))
        job: dict[str, Any] = dict(found)
        try:  # per-rank maps kept beside a large job's status (gemini.rank_detail)
            job["status"] = rank_detail.resolve(job.get("status") or {}, self._configmap)
        except rank_detail.RankDetailError as err:
            raise CliError(f"geminijob {name}: {err}") from err
        return job

    def _configmap(self, name: str) -> dict[str, Any] | None:
        core = client.CoreV1Api(self.api)
        try:
            raw: Any = core.read_namespaced_config_map(name, self.namespace,
                                                       _preload_content=False)
        except ApiException as err:
            if err.status == 404:
                return None
            raise CliError(_api_error(err, f"configmap {name}", self.namespace)) from err
        return dict(json.loads(raw.data))

    def worker_pods(self, job: str) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in naming.worker_selector(job).items())
        pods = self._call("worker pods", lambda: client.CoreV1Api(self.api).list_namespaced_pod(
            self.namespace, label_selector=selector))
        return self._plain(pods.items)

    def nodes(self) -> list[dict[str, Any]]:
        found = self._call("nodes", lambda: client.CoreV1Api(self.api).list_node())
        return self._plain(found.items)

    def job_events(self, job: str) -> list[dict[str, Any]]:
        selector = f"involvedObject.name={job},involvedObject.kind={naming.KIND}"
        try:
            found = client.CoreV1Api(self.api).list_namespaced_event(
                self.namespace, field_selector=selector)
        except ApiException:  # events are a nicety: a user may not be allowed to list them
            return []
        return self._plain(found.items)

    def annotate_job(self, name: str, annotations: dict[str, str]) -> None:
        custom = client.CustomObjectsApi(self.api)
        body = {"metadata": {"annotations": annotations}}
        self._call(f"geminijob {name}", lambda: custom.patch_namespaced_custom_object(
            naming.GROUP, naming.VERSION, self.namespace, naming.PLURAL, name, body))

    def _plain(self, items: Sequence[Any]) -> list[dict[str, Any]]:
        # camelCase JSON dicts, as the API serves them (the views read those).
        return [self.api.sanitize_for_serialization(item) for item in items]

    def _call(self, what: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except ApiException as err:
            raise CliError(_api_error(err, what, self.namespace)) from err
        except HTTPError as err:
            host = self.api.configuration.host
            raise CliError(f"cannot reach the API server at {host}: {err}") from err


def _api_error(err: ApiException, what: str, namespace: str) -> str:
    try:
        body = json.loads(err.body or "{}")
    except ValueError:
        body = {}
    message = str(body.get("message") or err.reason)
    if err.status == 404 and what.startswith("geminijob"):
        if not (body.get("details") or {}).get("name"):
            return ("the GeminiJob API (geminijobs.gemini.io) is not installed in this cluster: "
                    "install the operator's CRD first (see docs/install.md)")
        return (f"{what} not found in namespace {namespace} "
                f"(list them with `kubectl get geminijobs -n {namespace}`)")
    if err.status in (401, 403):
        return f"not allowed to read or change {what} in namespace {namespace}: {message}"
    return f"{what}: the API server answered {err.status}: {message}"


def _load_config(kubeconfig: str | None, context: str | None) -> tuple[client.ApiClient, str]:
    """An API client and the default namespace, resolved the way kubectl does it."""
    path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    in_cluster = (not kubeconfig and not os.environ.get("KUBECONFIG")
                  and not os.path.exists(path) and os.environ.get("KUBERNETES_SERVICE_HOST"))
    try:
        if in_cluster:
            config.load_incluster_config()
            return client.ApiClient(), _service_account_namespace()
        if kubeconfig and not os.path.exists(kubeconfig):
            raise CliError(f"--kubeconfig {kubeconfig}: no such file")
        api = config.new_client_from_config(config_file=path, context=context,
                                            persist_config=False)
        contexts, active = config.list_kube_config_contexts(config_file=path)
        if context:
            active = next((c for c in contexts if c["name"] == context), active)
    except ConfigException as err:
        raise CliError(f"no usable kubeconfig ({err}); pass --kubeconfig or set KUBECONFIG"
                       ) from err
    namespace = ((active or {}).get("context") or {}).get("namespace") or "default"
    return api, str(namespace)


def _service_account_namespace() -> str:
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as handle:
            return handle.read().strip() or "default"
    except OSError:
        return "default"


if __name__ == "__main__":
    sys.exit(main())
