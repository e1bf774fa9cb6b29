"""`gemini fault ...`: inject failures into the local cluster (crash, power loss, partition,
slow link)."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from typing import Any

from gemini_cli import COMMANDS, CliError
from gemini_cli.output import add_output_flag, emit
from gemini_local import cluster, faults, nodes
from gemini_local.controlplane import ControlPlane, ControlPlaneError
from gemini_local.nodeagent.config import RACK_LABEL, ZONE_LABEL


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fault = subparsers.add_parser(
        "fault", help=COMMANDS["fault"].help,
        description="Crash a container, lose a node (power loss), cut a node off the network "
        "or slow its link and heal it, or add a spare node, on the cluster started by "
        "`gemini local up`.")
    fault.add_argument("--state-dir", type=Path, default=None,
                       help="the local cluster's state (default: $GEMINI_LOCAL_DIR or "
                       "~/.gemini/local)")
    verbs = fault.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True

    kill = verbs.add_parser("kill-container", help="kill a container's processes (a crash)")
    kill.add_argument("pod", metavar="[NAMESPACE/]POD")
    kill.add_argument("container")
    kill.add_argument("--signal", default="KILL",
                      help="signal name or number (default KILL: the whole process group)")
    add_output_flag(kill)
    kill.set_defaults(func=_kill_container)

    node_verbs = {
        "lose-node": (_lose_node, "power loss: kill all of a node's processes at once"),
        "partition": (_partition, "cut a node off the network (needs root and nftables)"),
        "slow-link": (_slow_link, "police a node's traffic with the rest to --rate, each way "
                      "(needs root and nftables)"),
        "heal": (_heal, "reconnect a partitioned node and end a slow link"),
    }
    for verb, (func, text) in node_verbs.items():
        parser = verbs.add_parser(verb, help=text)
        parser.add_argument("node")
        if verb == "slow-link":
            parser.add_argument("--rate", required=True,
                                help="bytes per second with an optional prefix (500k, 10Mi, "
                                "2G) or bits with 'bit' (100Mbit, 1Gbit)")
        add_output_flag(parser)
        parser.set_defaults(func=func)

    add = verbs.add_parser("add-node", help="start a fresh node (a spare)")
    add.add_argument("node", nargs="?", help="name of the new node agent (a kubelet node is "
                     "named by its address: leave it out)")
    add.add_argument("--zone", required=True)
    add.add_argument("--rack", required=True)
    add.add_argument("--cpu", default="8", help="node agents only (a kubelet node has the "
                     "machine's)")
    add.add_argument("--memory", default="32Gi", help="node agents only")
    add.add_argument("--gpus", type=int, default=1, help="node agents only")
    add_output_flag(add)
    add.set_defaults(func=_add_node)


def _state_dir(args: argparse.Namespace) -> Path:
    return Path(args.state_dir) if args.state_dir else cluster.default_state_dir()


def _report(args: argparse.Namespace, data: dict[str, Any], text: str) -> int:
    emit(args, data, lambda _d: text)
    return 0


def _parse_signal(text: str) -> int:
    if text.isdigit():
        return int(text)
    name = text.upper() if text.upper().startswith("SIG") else f"SIG{text.upper()}"
    try:
        return int(signal.Signals[name])
    except KeyError as err:
        raise CliError(f"unknown signal {text!r}; use a name like KILL or TERM, or a number") \
            from err


def _kill_container(args: argparse.Namespace) -> int:
    namespace, _, pod = args.pod.rpartition("/")
    sig = _parse_signal(args.signal)
    try:
        pid = faults.kill_container(_state_dir(args), namespace or "default", pod,
                                    args.container, sig)
    except faults.FaultError as err:
        raise CliError(str(err)) from err
    data = {"namespace": namespace or "default", "pod": pod, "container": args.container,
            "pid": pid, "signal": signal.Signals(sig).name}
    return _report(args, data, f"sent {data['signal']} to {args.pod} {args.container} "
                   f"(pid {pid})")


def _lose_node(args: argparse.Namespace) -> int:
    try:
        killed = faults.lose_node(_state_dir(args), args.node)
    except (faults.FaultError, nodes.NodeAgentError) as err:
        raise CliError(str(err)) from err
    return _report(args, {"node": args.node, "killedProcesses": killed},
                   f"node {args.node} lost: {killed} processes killed; it stops heart-beating")


def _partition(args: argparse.Namespace) -> int:
    try:
        faults.partition_node(_state_dir(args), args.node)
    except (faults.FaultError, nodes.NodeAgentError) as err:
        raise CliError(str(err)) from err
    return _report(args, {"node": args.node, "partitioned": True},
                   f"node {args.node} cut off; `gemini fault heal {args.node}` reconnects it")


def _slow_link(args: argparse.Namespace) -> int:
    try:
        rate = faults.parse_rate(args.rate)
        faults.slow_link(_state_dir(args), args.node, rate)
    except (faults.FaultError, nodes.NodeAgentError) as err:
        raise CliError(str(err)) from err
    return _report(args, {"node": args.node, "rateBytesPerSecond": rate},
                   f"node {args.node} slowed to {rate:,} bytes/s each way; "
                   f"`gemini fault heal {args.node}` ends it")


def _heal(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    try:
        partitioned = faults.is_partitioned(state_dir, args.node)
        slowed = faults.is_slowed(state_dir, args.node)
        faults.heal_node(state_dir, args.node, missing_ok=True)
    except (faults.FaultError, nodes.NodeAgentError) as err:
        raise CliError(str(err)) from err
    lifted = [what for what, was in (("reconnected", partitioned), ("back to full speed", slowed))
              if was]
    text = (f"node {args.node} {' and '.join(lifted)}" if lifted
            else f"node {args.node} was neither partitioned nor slowed")
    return _report(args, {"node": args.node, "wasPartitioned": partitioned, "wasSlowed": slowed},
                   text)


def _add_node(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    plane = ControlPlane.load(state_dir)
    if plane is None:
        raise CliError(f"no local cluster in {state_dir}; run `gemini local up` first")
    if cluster.node_kind(state_dir) == "kubelet":
        return _add_kubelet_node(args, state_dir)
    if not args.node:
        raise CliError("name the new node: gemini fault add-node NAME --zone Z --rack R")
    used = [nodes.node_config(state_dir, n).spec.index for n in nodes.node_names(state_dir)]
    spec = nodes.NodeSpec(args.node, zone=args.zone, rack=args.rack,
                          index=max(used, default=-1) + 1, cpu=args.cpu, memory=args.memory,
                          gpus=args.gpus)
    try:
        pid = faults.add_node(plane.kubeconfig, plane.pki, state_dir, spec)
    except (nodes.NodeAgentError, ValueError) as err:
        raise CliError(str(err)) from err
    return _report(args, {"node": spec.name, "zone": spec.zone, "rack": spec.rack,
                          "index": spec.index, "pid": pid},
                   f"node {spec.name} added in {spec.zone}/{spec.rack} (agent pid {pid})")


def _add_kubelet_node(args: argparse.Namespace, state_dir: Path) -> int:
    if args.node:
        raise CliError(f"kubelet nodes are named by their address: leave out {args.node!r}")
    try:
        name = cluster.add_kubelet_node(state_dir, {ZONE_LABEL: args.zone,
                                                    RACK_LABEL: args.rack})
    except ControlPlaneError as err:
        raise CliError(str(err)) from err
    return _report(args, {"node": name, "zone": args.zone, "rack": args.rack},
                   f"kubelet node {name} added in {args.zone}/{args.rack}")
