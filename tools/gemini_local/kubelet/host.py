"""The host state a real kubelet node changes, recorded before its start and put back after.

Machine-wide, outside the node's state folder: sysctls the kubelet and the bridge plugin set,
the cgroup root in every hierarchy, pods' network namespaces, the kubelet's iptables chains
(and the nftables tables iptables-nft made for them), mounts, and fixed paths containerd 1.6
and the kubelet create whatever their configuration says.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from gemini_local import processes

CGROUP_ROOT = "/gemini-kubelet"
CGROUP_FS = Path("/sys/fs/cgroup")
SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops", "net/ipv4/ip_forward")
# Fixed paths containerd 1.6 and the kubelet create whatever their configuration says.
FIXED_PATHS = (Path("/run/containerd"), Path("/var/lib/cni"), Path("/var/lib/kubelet"),
               Path("/var/log/containers"), Path("/run/netns"))
NETNS_DIR = Path("/run/netns")


def record(state_dir: Path) -> None:
    """Write what the node's start may change (sysctls, fixed paths, network namespaces,
    iptables chains, nftables tables) to `state_dir/host.json`, for `restore`."""
    path = state_dir / "host.json"
    if path.exists():  # a start after a failed teardown: keep the first record
        return
    path.write_text(json.dumps({
        "sysctls": {s: (Path("/proc/sys") / s).read_text().strip() for s in SYSCTLS},
        "existing": [str(p) for p in FIXED_PATHS if p.exists()],
        "netns": sorted(p.name for p in NETNS_DIR.glob("*")) if NETNS_DIR.exists() else [],
        "iptables_chains": sorted(iptables_chains()),
        "nft_tables": sorted(nft_tables()),
    }))


# The kubelet's own iptables chains (kubelet_network_linux.go), in every table it makes them.
_KUBELET_CHAINS = (("mangle", "KUBE-IPTABLES-HINT"), ("mangle", "KUBE-KUBELET-CANARY"),
                   ("nat", "KUBE-KUBELET-CANARY"), ("filter", "KUBE-KUBELET-CANARY"),
                   ("filter", "KUBE-FIREWALL"))
_IPTABLES = {"iptables": "ip", "ip6tables": "ip6"}  # command -> nftables family


def iptables_chains() -> set[str]:
    """`<command>/<table>/<chain>` of every chain the kubelet makes that exists now."""
    found = set()
    for cmd in _IPTABLES:
        if shutil.which(cmd) is None:
            continue
        for table in ("mangle", "nat", "filter"):
            out = subprocess.run([cmd, "-w", "-t", table, "-S"], capture_output=True, text=True,
                                 check=False).stdout
            found |= {f"{cmd}/{table}/{line.split()[1]}" for line in out.splitlines()
                      if line.startswith("-N KUBE-")}
    return found


def nft_tables() -> set[str]:
    """The `ip` and `ip6` nftables tables (iptables-nft's; the node agents' are `inet`)."""
    if shutil.which("nft") is None:
        return set()
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                         check=False).stdout
    return {" ".join(line.split()[1:3]) for line in out.splitlines()
            if line.startswith(("table ip ", "table ip6 "))}


def remove_iptables(host: dict[str, Any], problems: list[str]) -> None:
    """Remove the kubelet's chains (and the nftables tables iptables-nft made for them when
    they hold no other rule) that were not there before the start."""
    before = set(host.get("iptables_chains", []))
    for cmd, family in _IPTABLES.items():
        if shutil.which(cmd) is None:
            continue
        for table, chain in _KUBELET_CHAINS:
            if f"{cmd}/{table}/{chain}" in before:
                continue
            rules = subprocess.run([cmd, "-w", "-t", table, "-S"], capture_output=True,
                                   text=True, check=False).stdout.splitlines()
            for rule in rules:  # the jumps into the chain first, then the chain itself
                if rule.startswith("-A ") and rule.endswith(f"-j {chain}"):
                    run([cmd, "-w", "-t", table, "-D", *rule.split()[1:]], problems)
            if f"-N {chain}" in rules:
                run([cmd, "-w", "-t", table, "-F", chain], problems)
                run([cmd, "-w", "-t", table, "-X", chain], problems)
        for table in ("mangle", "nat", "filter"):
            if f"{family} {table}" in host.get("nft_tables", []):
                continue
            rules = subprocess.run([cmd, "-w", "-t", table, "-S"], capture_output=True,
                                   text=True, check=False).stdout.splitlines()
            if f"{family} {table}" in nft_tables() and not any(
                    r.startswith(("-A ", "-N ")) for r in rules):
                run(["nft", "delete", "table", family, table], problems)


def _cgroup_mounts() -> list[tuple[Path, str]]:
    """(mount point, filesystem type) of every cgroup hierarchy: each v1 controller and the
    unified one (`/sys/fs/cgroup/unified` on hybrid hosts, `/sys/fs/cgroup` on pure v2)."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        fstype = fields[fields.index("-") + 1]
        if fstype in ("cgroup", "cgroup2") and fields[4].startswith(str(CGROUP_FS)):
            mounts.append((Path(fields[4]), fstype))
    return sorted(set(mounts))


def cgroup_dirs(sub: str = "") -> list[Path]:
    """The nodes' cgroup root (or `sub` below it, one node's) in every cgroup hierarchy."""
    return [point / CGROUP_ROOT.lstrip("/") / sub if sub else point / CGROUP_ROOT.lstrip("/")
            for point, _ in _cgroup_mounts()]


def make_cgroup_root(sub: str = "") -> None:
    """Make the cgroup root (and `sub` below it, a node's own root) in every hierarchy."""
    for point, fstype in _cgroup_mounts():
        parent = point
        for part in [CGROUP_ROOT.lstrip("/"), *filter(None, [sub])]:
            d = parent / part
            d.mkdir(exist_ok=True)
            if fstype == "cgroup" and (parent / "cpuset.cpus").exists():
                # A new v1 cpuset has no CPUs or memory nodes of its own: give it its parent's.
                for f in ("cpuset.cpus", "cpuset.mems"):
                    if not (d / f).read_text().strip():
                        (d / f).write_text((parent / f).read_text())
            parent = d


def load(state_dir: Path) -> dict[str, Any]:
    """What `record` wrote (empty when it is gone)."""
    try:
        return dict(json.loads((state_dir / "host.json").read_text()))
    except (OSError, ValueError):
        return {}


def run(argv: list[str], problems: list[str]) -> bool:
    result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    if result.returncode != 0:
        problems.append(f"{' '.join(argv)}: {result.stderr.strip()}")
    return result.returncode == 0


def mounts_under(directory: Path) -> list[str]:
    """Mount points at or below `directory`, deepest first."""
    prefix = str(directory.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(points, key=lambda p: p.count("/"), reverse=True)


def unmount_under(directory: Path, problems: list[str]) -> None:
    for _ in range(3):  # a bind mount may hide another one below it
        points = mounts_under(directory)
        if not points:
            return
        for point in points:
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    left = mounts_under(directory)
    if left:
        problems.append(f"mounts left under {directory}: {left}")


def remove_netns(before: set[str], problems: list[str]) -> None:
    if not NETNS_DIR.exists():
        return
    for ns in NETNS_DIR.iterdir():
        if ns.name in before or not ns.name.startswith("cni-"):
            continue
        subprocess.run(["umount", "-l", str(ns)], capture_output=True, check=False)
        try:
            ns.unlink()
        except OSError as err:
            problems.append(f"netns {ns}: {err}")


def kill_cgroup_processes(sub: str = "", timeout: float = 15.0) -> None:
    """SIGKILL every process in the nodes' cgroups (or only in `sub`, one node's): containers
    whose kubelet, containerd and shim died without cleaning up; wait until they are gone."""
    deadline = time.monotonic() + timeout
    while True:
        pids = set()
        for root in cgroup_dirs(sub):
            for procs in root.rglob("cgroup.procs") if root.exists() else ():
                with contextlib.suppress(OSError, ValueError):
                    pids |= {int(p) for p in procs.read_text().split()}
        alive = [p for p in pids if processes.is_alive(p)]
        if not alive or time.monotonic() > deadline:
            return
        for pid in alive:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        time.sleep(0.2)


def remove_cgroups(problems: list[str]) -> None:
    kill_cgroup_processes()
    left = []
    for root in cgroup_dirs():
        if not root.exists():
            continue
        dirs = sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts),
                      reverse=True)
        for d in [*dirs, root]:
            for attempt in range(100):  # a just-killed process may hold its cgroup a while
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if attempt == 99:
                        left.append(str(d))
                    time.sleep(0.1)
    if left:
        problems.append(f"{len(left)} cgroups left, e.g. {left[0]}")


def restore(host: dict[str, Any], problems: list[str]) -> None:
    """Put back the recorded sysctls and remove the fixed paths the start made."""
    for name, value in host.get("sysctls", {}).items():
        path = Path("/proc/sys") / name
        try:
            if path.read_text().strip() != value:
                path.write_text(value)
        except OSError as err:
            problems.append(f"sysctl {name}={value}: {err}")
    existing = set(host.get("existing", []))
    for path in FIXED_PATHS:
        if host and str(path) not in existing and path.exists():
            shutil.rmtree(path, ignore_errors=True)
