"""`gemini operator run`: the GeminiJob operator (kopf) in this process."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from gemini_cli import COMMANDS


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
    run_parser.add_argument("--metrics-port", type=int, default=None,
                            help="serve Prometheus metrics on this port")
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
    run_parser.add_argument("--log-level", default="INFO",
                            choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    run_parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gemini_cli import CliError
    from gemini_operator.main import OperatorOptions
    from gemini_operator.main import run as run_operator
    from gemini_operator.render import RenderConfig

    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # kopf logs every handled watch event at INFO: too much with a thousand pods.
    logging.getLogger("kopf").setLevel(max(logging.WARNING, logging.getLevelName(args.log_level)))
    options = OperatorOptions(
        kubeconfig=args.kubeconfig,
        namespace=args.namespace,
        sidecar_image=args.sidecar_image,
        lease_namespace=args.lease_namespace or args.namespace or "default",
        metrics_port=args.metrics_port,
        render=RenderConfig(worker_priority_class=args.worker_priority_class,
                            spare_priority_class=args.spare_priority_class),
        create_priority_classes=args.create_priority_classes,
    )
    try:
        run_operator(options)
    except OSError as err:
        raise CliError(f"the operator could not start: {err}") from err
    return 0
