"""`gemini operator run`: the GeminiJob operator (kopf) in this process."""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from gemini_cli import COMMANDS

# The Helm chart sets it to the pod's name and uid: a container the kubelet restarts in the same
# pod retakes its Lease at once instead of waiting for it to expire.
IDENTITY_ENV = "GEMINI_OPERATOR_IDENTITY"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "operator", help=COMMANDS["operator"].help,
        description="Runs the Kubernetes operator that turns GeminiJobs into running jobs.",
    )
    commands = parser.add_subparsers(dest="operator_command", metavar="COMMAND")
    commands.required = True
    run_parser = commands.add_parser(
        "run", help="run the operator until interrupted",
        description=(
            "Watches GeminiJobs, their worker pods and the nodes, and reconciles. Several "
            "replicas may run: a Lease elects the one that acts. The CRD (crds/geminijob.yaml) "
            "must be installed first."
        ),
    )
    run_parser.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, "
                            "~/.kube/config, or the in-cluster service account)")
    run_parser.add_argument("--namespace", help="watch only this namespace (default: all)")
    run_parser.add_argument("--sidecar-image",
                            help="checkpoint sidecar image for jobs that do not name one")
    run_parser.add_argument("--lease-namespace", default=None,
                            help="namespace of the leader-election Lease (default: --namespace "
                            "or 'default')")
    run_parser.add_argument("--identity", default=os.environ.get(IDENTITY_ENV, ""),
                            help="this operator's name in the leader-election Lease; a "
                            "process of the same identity retakes the Lease at once, so give "
                            "each pod its own, e.g. its name and uid (default: "
                            f"${IDENTITY_ENV}, else host name, pid and a random suffix)")
    run_parser.add_argument("--metrics-port", type=int, default=None,
                            help="serve Prometheus metrics (GET /metrics) and the probes' "
                            "GET /healthz and /readyz on this port")
    run_parser.add_argument("--health-port", type=int, default=None,
                            help="also serve the probes' GET /healthz and /readyz alone on "
                            "this port, where a flood of connections to the others cannot "
                            "starve them (the Helm chart's probes use it; default: none)")
    run_parser.add_argument("--hint-port", type=int, default=None,
                            help="serve launchers' failure hints on this port, so a failed "
                            "trainer is acted on at once, not at the next poll (default: none)")
    run_parser.add_argument("--hint-url", default=None,
                            help="the hint server's URL as the worker pods reach it, e.g. "
                            "http://gemini-operator-hints.gemini-system.svc:8090 (required "
                            "with --hint-port)")
    run_parser.add_argument("--worker-priority-class", default="gemini-worker",
                            help="PriorityClass of worker pods; '' for none (default: "
                            "%(default)s)")
    run_parser.add_argument("--spare-priority-class", default="gemini-spare",
                            help="PriorityClass of spare placeholder pods, below the workers' "
                            "(default: %(default)s)")
    run_parser.add_argument("--create-priority-classes", action=argparse.BooleanOptionalAction,
                            default=True,
                            help="create the two PriorityClasses when missing (default: yes; "
                            "the Helm chart creates them and passes --no-create-priority-classes)")
    run_parser.add_argument("--worker-network-policy", action=argparse.BooleanOptionalAction,
                            default=True,
                            help="give each job a NetworkPolicy admitting only its own pods "
                            "and the operator (default: yes)")
    run_parser.add_argument("--operator-pod-labels", type=_labels,
                            default="app.kubernetes.io/name=gemini-operator",
                            help="labels of the operator's pods, admitted by the jobs' "
                            "NetworkPolicies to the launcher and sidecar APIs (default: "
                            "%(default)s)")
    run_parser.add_argument("--operator-namespace-labels", type=_labels, default=None,
                            help="labels of the operator's namespace, e.g. "
                            "kubernetes.io/metadata.name=gemini-system; '' admits the "
                            "operator's pod labels from any namespace, which any tenant can "
                            "put on a pod (default: the lease namespace's name)")
    run_parser.add_argument("--worker-metrics-from", type=_peers, default="[]",
                            help="JSON list of NetworkPolicy peers admitted to the sidecars' "
                            "/metrics port, e.g. your Prometheus (default: none)")
    run_parser.add_argument("--token-key-file", default=None,
                        help="derive each job's peer-auth token from this key (at least 32 "
                        "bytes) instead of reading it back from the job's Secret, so the "
                        "operator needs no `get` on Secrets (default: $GEMINI_OPERATOR_TOKEN_KEY;"
                        " neither: random tokens, read back)")
    run_parser.add_argument("--status-inline-bytes", type=_non_negative, default=64 * 1024,
                            help="per-rank status detail (placement, launch, recovery plan "
                            "maps) larger than this, serialized, goes to the ConfigMap "
                            "<job>-rank-detail; 0: always (default: 65536)")
    run_parser.add_argument("--log-level", default="INFO",
                            choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    run_parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gemini_cli import CliError
    from gemini_operator.calls.tokens import TokenKeyError, load_key
    from gemini_operator.core.render import RenderConfig
    from gemini_operator.runtime.main import OperatorOptions
    from gemini_operator.runtime.main import run as run_operator

    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # kopf logs every handled watch event at INFO: too much with a thousand pods.
    logging.getLogger("kopf").setLevel(max(logging.WARNING, logging.getLevelName(args.log_level)))
    try:
        token_key = load_key(path=args.token_key_file)
    except (TokenKeyError, OSError) as err:
        raise CliError(f"--token-key-file / $GEMINI_OPERATOR_TOKEN_KEY: {err}",
                       exit_code=2) from err
    if (args.hint_port is None) != (args.hint_url is None):
        raise CliError("--hint-port and --hint-url go together: the port the operator "
                       "listens on and the URL the worker pods call it at", exit_code=2)
    lease_namespace = args.lease_namespace or args.namespace or "default"
    options = OperatorOptions(
        kubeconfig=args.kubeconfig,
        namespace=args.namespace,
        sidecar_image=args.sidecar_image,
        lease_namespace=lease_namespace,
        identity=args.identity,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        render=RenderConfig(worker_priority_class=args.worker_priority_class,
                            spare_priority_class=args.spare_priority_class,
                            network_policy=args.worker_network_policy,
                            operator_pod_labels=args.operator_pod_labels,
                            operator_namespace_labels=operator_namespace_labels(
                                args.operator_namespace_labels, lease_namespace),
                            metrics_from=args.worker_metrics_from,
                            hint_url=args.hint_url),
        create_priority_classes=args.create_priority_classes,
        token_key=token_key,
        status_inline_bytes=args.status_inline_bytes,
        hint_bind=None if args.hint_port is None else ("0.0.0.0", args.hint_port),
    )
    try:
        run_operator(options)
    except OSError as err:
        raise CliError(f"the operator could not start: {err}") from err
    return 0


def operator_namespace_labels(given: dict[str, str] | None, lease_namespace: str
                              ) -> dict[str, str]:
    """The namespace whose operator-labelled pods the jobs' NetworkPolicies admit: the one
    given ({}: any), else the lease namespace's own name (the operator runs there)."""
    if given is not None:
        return given
    return {"kubernetes.io/metadata.name": lease_namespace}


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from err
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value}")
    return value


def _labels(text: str) -> dict[str, str]:
    """"k=v,k2=v2" as a dict (argparse applies it to the default string too)."""
    pairs = [item.partition("=") for item in text.split(",") if item.strip()]
    if any(not key.strip() or sep != "=" for key, sep, _ in pairs):
        raise argparse.ArgumentTypeError(f"expected key=value[,key=value...], got {text!r}")
    return {key.strip(): value.strip() for key, _, value in pairs}


def _peers(text: str) -> tuple[dict[str, Any], ...]:
    try:
        peers = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from err
    if not isinstance(peers, list) or not all(isinstance(p, dict) for p in peers):
        raise argparse.ArgumentTypeError("expected a JSON list of NetworkPolicy peers")
    return tuple(peers)
