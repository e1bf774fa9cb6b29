"""`gemini local ...`: bring a real local Kubernetes cluster up, inspect it, take it down."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gemini_cli import COMMANDS, CliError
from gemini_cli.output import add_output_flag, emit, format_table
from gemini_local import cluster
from gemini_local.controlplane import ControlPlaneError
from gemini_local.kueue import KueueError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    local = subparsers.add_parser(
        "local", help=COMMANDS["local"].help,
        description="A real control plane (etcd, kube-apiserver, kube-controller-manager, "
        "kube-scheduler) on loopback, with node agents that run pods as local processes, or "
        "real kubelets with containerd (--kubelet).",
    )
    local.add_argument("--state-dir", type=Path, default=None,
                       help="where the cluster keeps its state (default: $GEMINI_LOCAL_DIR "
                       "or ~/.gemini/local)")
    verbs = local.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True

    up = verbs.add_parser("up", help="start the cluster and wait until it is healthy")
    up.add_argument("--nodes", type=int, default=4, help="number of nodes (default 4)")
    up.add_argument("--zones", type=int, default=None,
                    help="zones the racks are spread over (default min(2, racks))")
    up.add_argument("--racks", type=int, default=None,
                    help="racks the nodes are spread over (default min(2, nodes))")
    up.add_argument("--with-s3", action="store_true",
                    help="also start a real S3 server (Ceph RADOS Gateway) with a bucket")
    up.add_argument("--with-kueue", action="store_true",
                    help="also start Kueue with a queue `local` holding every node's CPU and "
                    "memory (label jobs kueue.x-k8s.io/queue-name: local)")
    up.add_argument("--with-monitoring", action="store_true",
                    help="also start Prometheus, configured by the Prometheus Operator from every "
                    "ServiceMonitor, PodMonitor and PrometheusRule (its URL is printed)")
    up.add_argument("--kubelet", action="store_true",
                    help="real kubelet nodes (kubelet, containerd, runc, bridge CNI; root, at "
                    "most 16, one such cluster per machine) instead of node agents")
    up.add_argument("--images", default="", metavar="TARGETS",
                    help="with --kubelet: the Dockerfile's images to build (cached) and import "
                    "into every node, comma-separated (operator,sidecar,trainer,examples)")
    add_output_flag(up)
    up.set_defaults(func=_up)

    down = verbs.add_parser("down", help="stop everything the cluster started")
    add_output_flag(down)
    down.set_defaults(func=_down)

    status = verbs.add_parser("status", help="components, nodes and their health")
    add_output_flag(status)
    status.set_defaults(func=_status)

    kubeconfig = verbs.add_parser("kubeconfig", help="print the path of the admin kubeconfig")
    kubeconfig.set_defaults(func=_kubeconfig)


def _state_dir(args: argparse.Namespace) -> Path:
    return Path(args.state_dir) if args.state_dir else cluster.default_state_dir()


def _up(args: argparse.Namespace) -> int:
    racks = args.racks if args.racks is not None else min(2, args.nodes)
    zones = args.zones if args.zones is not None else min(2, racks)
    try:
        topology = cluster.Topology(nodes=args.nodes, zones=zones, racks=racks)
        info = cluster.up(_state_dir(args), topology, with_s3=args.with_s3,
                          with_kueue=args.with_kueue, kubelet=args.kubelet,
                          images=tuple(t for t in args.images.split(",") if t),
                          with_monitoring=args.with_monitoring)
    except (ValueError, ControlPlaneError, KueueError) as err:
        raise CliError(str(err)) from err
    emit(args, info, _render_up)
    return 0


def _render_up(info: dict[str, Any]) -> str:
    lines = [
        f"local cluster up in {info['startupSeconds']} s: {info['topology']['nodes']} "
        f"{'kubelet ' if info.get('nodeKind') == 'kubelet' else ''}nodes",
        f"  API server:  {info['apiServer']}",
        f"  kubeconfig:  export KUBECONFIG={info['kubeconfig']}",
    ]
    if info.get("s3"):
        s3 = info["s3"]
        lines += [
            f"  S3:          {s3['url']}  bucket {s3['bucket']}",
            f"               AWS_ACCESS_KEY_ID={s3['access_key']} "
            f"AWS_SECRET_ACCESS_KEY={s3['secret_key']}",
        ]
    if info.get("images"):
        lines.append("  images:      " + ", ".join(info["images"].values())
                     + " (in every node's containerd)")
    if info.get("kueue"):
        queue = info["kueue"]
        memory = int(queue["quota"]["memory"]) / 2**30
        lines.append(f"  Kueue:       LocalQueue {queue['localQueue']}, quota "
                     f"{queue['quota']['cpu']} CPUs, {memory:g} GiB of memory")
    if info.get("monitoring"):
        lines.append(_monitoring_line(info["monitoring"]))
    lines.append("  next:        kubectl get nodes -L topology.kubernetes.io/zone")
    return "\n".join(lines)


def _monitoring_line(monitoring: dict[str, Any]) -> str:
    state = "" if monitoring.get("running", True) \
        else "  (NOT RUNNING: `gemini local down`, then up)"
    return (f"  Prometheus:  {monitoring['url']}  (Prometheus {monitoring['prometheus']}; "
            f"curl {monitoring['url']}/api/v1/targets){state}")


def _down(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    stopped = cluster.down(state_dir)
    if not stopped:
        print(f"no local cluster is running in {state_dir}; nothing to stop", file=sys.stderr)
        return 0
    emit(args, {"stopped": stopped}, lambda d: "stopped: " + ", ".join(d["stopped"]))
    return 0


def _status(args: argparse.Namespace) -> int:
    info = cluster.status(_state_dir(args))
    emit(args, info, _render_status)
    return 0 if info["running"] else 3


def _render_status(info: dict[str, Any]) -> str:
    comps = format_table(
        ["COMPONENT", "RUNNING", "PID"],
        [[n, "yes" if c["running"] else "no", c["pid"] or "-"]
         for n, c in info["components"].items()],
    )
    if info.get("monitoring"):
        comps += "\n" + _monitoring_line(info["monitoring"]).strip()
    if not info["nodes"]:
        return comps + "\n\nno nodes (the API server is not running)"
    nodes = format_table(
        ["NODE", "READY", "ZONE", "RACK", "REASON"],
        [[n["name"], n["ready"], n["zone"], n["rack"], n["reason"]] for n in info["nodes"]],
    )
    return f"{comps}\n\n{nodes}"


def _kubeconfig(args: argparse.Namespace) -> int:
    path = _state_dir(args) / "kubeconfig"
    if not path.exists():
        raise CliError(f"no local cluster was started in {path.parent}; run `gemini local up`")
    print(path)
    return 0
