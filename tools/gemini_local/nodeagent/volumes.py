"""Pod volumes as directories on the node, and how a container sees them at its mountPath.

Each volume is materialized once per pod under the pod's directory (memory-backed emptyDirs
under /dev/shm, which is tmpfs). A container then runs in a private mount namespace where each
volumeMount is a bind mount of that directory at its mountPath, as in a real container; as
non-root (no mount namespaces) the directories are only announced through GEMINI_VOLUME_<NAME>
environment variables, which are set in both cases.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gemini_local.nodeagent.podspec import (
    ConfigError,
    Lookup,
    Obj,
    PodFacts,
    decode_data,
    field_value,
    resource_value,
)

TokenSource = Callable[[Obj], Awaitable[str]]  # serviceAccountToken projection -> token


@dataclass(frozen=True)
class Mount:
    source: Path
    target: str
    read_only: bool


def env_name(volume: str) -> str:
    """GEMINI_VOLUME_<NAME>: the volume name upper-cased, other characters as '_'."""
    return "GEMINI_VOLUME_" + re.sub(r"[^A-Z0-9]", "_", volume.upper())


async def materialize(
    pod: Obj, pod_dir: Path, shm_dir: Path, facts: PodFacts, objects: Lookup, token: TokenSource
) -> dict[str, Path]:
    """Create every volume of the pod; return its directory by volume name."""
    dirs: dict[str, Path] = {}
    for volume in pod.get("spec", {}).get("volumes") or []:
        name = volume["name"]
        if "hostPath" in volume:
            path = Path(volume["hostPath"]["path"])
            if volume["hostPath"].get("type") in ("DirectoryOrCreate", None, ""):
                path.mkdir(parents=True, exist_ok=True)
            dirs[name] = path
            continue
        if "emptyDir" in volume:
            memory = (volume["emptyDir"] or {}).get("medium") == "Memory"
            target = (shm_dir if memory else pod_dir / "volumes") / name
            target.mkdir(parents=True, exist_ok=True)
            dirs[name] = target
            continue
        target = pod_dir / "volumes" / name
        target.mkdir(parents=True, exist_ok=True)
        files = await _volume_files(volume, pod, facts, objects, token)
        mode = _default_mode(volume)
        for rel, (content, file_mode) in files.items():
            _write(target, rel, content, file_mode if file_mode is not None else mode)
        dirs[name] = target
    return dirs


def _default_mode(volume: Obj) -> int:
    for key in ("configMap", "secret", "downwardAPI", "projected"):
        if key in volume and (volume[key] or {}).get("defaultMode") is not None:
            return int(volume[key]["defaultMode"])
    return 0o644


def _write(root: Path, rel: str, content: bytes, mode: int) -> None:
    if rel.startswith("/") or ".." in Path(rel).parts:
        raise ConfigError(f"volume item path {rel!r} must be relative and stay inside the volume")
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    path.chmod(mode)


Files = dict[str, tuple[bytes, int | None]]


async def _volume_files(
    volume: Obj, pod: Obj, facts: PodFacts, objects: Lookup, token: TokenSource
) -> Files:
    if "configMap" in volume or "secret" in volume:
        return _keyed_files(volume)(objects)
    if "downwardAPI" in volume:
        return _downward_files(volume["downwardAPI"].get("items") or [], pod, facts)
    if "projected" in volume:
        files: Files = {}
        for source in volume["projected"].get("sources") or []:
            if "serviceAccountToken" in source:
                spec = source["serviceAccountToken"]
                files[spec["path"]] = ((await token(spec)).encode(), 0o600)
            elif "downwardAPI" in source:
                files.update(_downward_files(source["downwardAPI"].get("items") or [], pod, facts))
            else:
                files.update(_keyed_files(source)(objects))
        return files
    kinds = sorted(k for k in volume if k != "name")
    raise ConfigError(f"volume {volume['name']!r}: type {kinds} is not supported by the local "
                      "node agent (use emptyDir, hostPath, configMap, secret, downwardAPI, "
                      "projected)")


def _keyed_files(source: Obj) -> Callable[[Lookup], Files]:
    kind = "configmap" if "configMap" in source else "secret"
    ref = source["configMap"] if kind == "configmap" else source["secret"]
    name = ref.get("secretName") or ref["name"]

    def files(objects: Lookup) -> Files:
        obj = objects.get((kind, name))
        if obj is None:
            if ref.get("optional"):
                return {}
            raise ConfigError(f"{kind} {name!r} not found")
        data = decode_data(obj, secret=kind == "secret")
        items = ref.get("items")
        if not items:
            return {key: (value, None) for key, value in data.items()}
        out: Files = {}
        for item in items:
            if item["key"] not in data:
                if ref.get("optional"):
                    continue
                raise ConfigError(f"key {item['key']!r} not found in {kind} {name!r}")
            out[item["path"]] = (data[item["key"]], item.get("mode"))
        return out

    return files


def _downward_files(items: list[Obj], pod: Obj, facts: PodFacts) -> Files:
    out: Files = {}
    containers = {c["name"]: c for c in pod.get("spec", {}).get("containers") or []}
    for item in items:
        if "fieldRef" in item:
            value = field_value(item["fieldRef"]["fieldPath"], facts)
        else:
            ref = item["resourceFieldRef"]
            container = containers.get(ref.get("containerName", ""), {})
            value = resource_value(ref, container, facts)
        out[item["path"]] = (value.encode(), item.get("mode"))
    return out


def container_mounts(container: Obj, dirs: Mapping[str, Path]) -> list[Mount]:
    """The container's volumeMounts resolved to directories (subPath included)."""
    mounts = []
    for vm in container.get("volumeMounts") or []:
        if vm["name"] not in dirs:
            raise ConfigError(f"volumeMount {vm['name']!r} names no volume of the pod")
        source = dirs[vm["name"]]
        if vm.get("subPath"):
            source = source / vm["subPath"]
            if not source.exists():
                source.mkdir(parents=True)
        mounts.append(Mount(source, vm["mountPath"], bool(vm.get("readOnly"))))
    return mounts


def volume_env(container: Obj, dirs: Mapping[str, Path]) -> dict[str, str]:
    """GEMINI_VOLUME_<NAME>=<directory> for every volume the container mounts."""
    return {env_name(m["name"]): str(dirs[m["name"]]) for m in container.get("volumeMounts") or []
            if m["name"] in dirs}


def namespaced_argv(
    argv: list[str], mounts: list[Mount], workdir: str, hostname: str | None = None
) -> list[str]:
    """`argv` run in a private mount namespace with each mount bound at its target; with a
    `hostname`, in its own UTS namespace too, where that is the host's name (the pod's)."""
    lines = ["set -e"]
    if hostname is not None:
        lines.append(f"printf %s {shlex.quote(hostname)} > /proc/sys/kernel/hostname")
    for mount in sorted(mounts, key=lambda m: len(Path(m.target).parts)):
        target = shlex.quote(mount.target)
        if mount.source.is_dir():
            lines.append(f"mkdir -p {target}")
        else:
            lines.append(f"[ -e {target} ] || {{ mkdir -p $(dirname {target}); : > {target}; }}")
        lines.append(f"mount --bind {shlex.quote(str(mount.source))} {target}")
        if mount.read_only:
            lines.append(f"mount -o remount,bind,ro {target}")
    lines.append(f"mkdir -p {shlex.quote(workdir)} && cd {shlex.quote(workdir)}")
    lines.append('exec "$@"')
    script = "\n".join(lines)
    uts = ["--uts"] if hostname is not None else []
    return ["unshare", "--mount", *uts, "--propagation", "private", "/bin/sh", "-c", script,
            "sh", *argv]


def mount_namespaces_available() -> bool:
    """Private mount namespaces need root (CAP_SYS_ADMIN) and util-linux's unshare."""
    return os.geteuid() == 0 and shutil.which("unshare") is not None
