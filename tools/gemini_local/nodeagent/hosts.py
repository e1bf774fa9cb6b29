"""A pod's own hostname and /etc/hosts, as the kubelet gives them.

Inside the pod, the hostname (spec.hostname or the pod name) resolves to the pod IP. Programs
that bind to "this host's address" (gloo does) then listen on the pod IP rather than on
127.0.0.1, so traffic between pods is addressed to their node's /24, which is what lets a
network partition of one node cut it (gemini_local.faults).
"""

from __future__ import annotations

from gemini_local.nodeagent.podspec import Obj

_HEADER = """# Kubernetes-managed hosts file (gemini local node agent).
127.0.0.1\tlocalhost
::1\tlocalhost ip6-localhost ip6-loopback
fe00::0\tip6-localnet
fe00::0\tip6-mcastprefix
fe00::1\tip6-allnodes
fe00::2\tip6-allrouters
"""


def pod_hostname(pod: Obj) -> str:
    """spec.hostname, else the pod name cut to a DNS label (63 characters), as Kubernetes does."""
    spec, name = pod.get("spec") or {}, pod["metadata"]["name"]
    return str(spec.get("hostname") or name[:63].rstrip("-."))


def hosts_file(pod: Obj, pod_ip: str) -> str:
    """The pod's /etc/hosts: localhost, its own names at its IP, then spec.hostAliases."""
    spec, namespace = pod.get("spec") or {}, pod["metadata"]["namespace"]
    hostname = pod_hostname(pod)
    names = [hostname]
    if spec.get("subdomain"):
        names.insert(0, f"{hostname}.{spec['subdomain']}.{namespace}.svc.cluster.local")
    lines = [_HEADER + f"{pod_ip}\t{' '.join(names)}\n"]
    aliases = spec.get("hostAliases") or []
    if aliases:
        lines.append("\n# Entries added by HostAliases.\n")
        lines.extend(f"{alias['ip']}\t{' '.join(alias.get('hostnames') or [])}\n"
                     for alias in aliases if alias.get("ip"))
    return "".join(lines)


def mounts_etc_hosts(container: Obj) -> bool:
    """A container that mounts something at /etc/hosts itself keeps that."""
    return any(m.get("mountPath") == "/etc/hosts" for m in container.get("volumeMounts") or [])
