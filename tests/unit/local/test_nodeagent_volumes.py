"""Volumes materialized as directories, and the mount-namespace command that binds them."""

from __future__ import annotations

import asyncio
import base64
import subprocess
from typing import Any

import pytest

from gemini_local.nodeagent.logserver import tail
from gemini_local.nodeagent.podspec import ConfigError, PodFacts
from gemini_local.nodeagent.volumes import (
    container_mounts,
    env_name,
    materialize,
    mount_namespaces_available,
    namespaced_argv,
    volume_env,
)

POD: dict[str, Any] = {
    "metadata": {"name": "p", "namespace": "n", "uid": "u", "labels": {"k": "v"}},
       "spec": {"nodeName": "node-0", "containers": [{"name": "c"}], "volumes": [
           {"name": "scratch", "emptyDir": {}},
           {"name": "shm", "emptyDir": {"medium": "Memory"}},
           {"name": "cfg", "configMap": {"name": "cm",
                                         "items": [{"key": "a", "path": "sub/a.txt"}]}},
           {"name": "sec", "secret": {"secretName": "s", "defaultMode": 0o400}},
           {"name": "info", "downwardAPI": {"items": [
               {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}},
               {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}},
           {"name": "token", "projected": {"sources": [
               {"serviceAccountToken": {"path": "token"}},
               {"downwardAPI": {"items": [{"path": "ns", "fieldRef": {
                   "fieldPath": "metadata.namespace"}}]}}]}},
       ]}}
OBJECTS = {("configmap", "cm"): {"data": {"a": "A", "b": "B"}},
           ("secret", "s"): {"data": {"pw": base64.b64encode(b"hunter2").decode()}}}


async def _token(_projection):
    return "tok"


def _materialize(tmp_path, pod=POD, objects=OBJECTS):
    facts = PodFacts(pod, "127.100.1.2", "127.100.1.1", {})
    return asyncio.run(materialize(pod, tmp_path / "pod", tmp_path / "shm", facts, objects,
                                   _token))


def test_every_volume_kind_becomes_a_directory(tmp_path):
    dirs = _materialize(tmp_path)
    assert dirs["shm"] == tmp_path / "shm" / "shm"
    assert dirs["scratch"] == tmp_path / "pod" / "volumes" / "scratch"
    assert (dirs["cfg"] / "sub" / "a.txt").read_text() == "A"
    assert not (dirs["cfg"] / "b").exists()  # items select keys
    assert (dirs["sec"] / "pw").read_bytes() == b"hunter2"
    assert (dirs["sec"] / "pw").stat().st_mode & 0o777 == 0o400
    assert (dirs["info"] / "name").read_text() == "p"
    assert (dirs["info"] / "labels").read_text() == 'k="v"'
    assert (dirs["token"] / "token").read_text() == "tok"
    assert (dirs["token"] / "ns").read_text() == "n"


def test_missing_config_map_and_unsupported_volume_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="configmap 'cm' not found"):
        _materialize(tmp_path, objects={**OBJECTS, ("configmap", "cm"): None})
    pvc = {**POD, "spec": {**POD["spec"], "volumes": [
        {"name": "data", "persistentVolumeClaim": {"claimName": "x"}}]}}
    with pytest.raises(ConfigError, match="not supported"):
        _materialize(tmp_path, pod=pvc)


def test_volume_env_names_and_mounts(tmp_path):
    dirs = {"ckpt-shm": tmp_path / "a"}
    container = {"volumeMounts": [{"name": "ckpt-shm", "mountPath": "/dev/shm",
                                   "readOnly": True, "subPath": "x"}]}
    assert env_name("ckpt-shm") == "GEMINI_VOLUME_CKPT_SHM"
    assert volume_env(container, dirs) == {"GEMINI_VOLUME_CKPT_SHM": str(tmp_path / "a")}
    [mount] = container_mounts(container, dirs)
    assert (mount.source, mount.target, mount.read_only) == (tmp_path / "a" / "x", "/dev/shm",
                                                             True)
    with pytest.raises(ConfigError, match="names no volume"):
        container_mounts({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, dirs)


@pytest.mark.skipif(not mount_namespaces_available(), reason="needs root and unshare")
def test_namespaced_command_sees_the_volume_at_its_mount_path(tmp_path):
    source = tmp_path / "vol"
    source.mkdir()
    (source / "f").write_text("inside\n")
    target = tmp_path / "mnt" / "here"
    from gemini_local.nodeagent.volumes import Mount

    argv = namespaced_argv(["sh", "-c", "cat f; pwd"], [Mount(source, str(target), True)],
                           str(target))
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["inside", str(target)]
    assert not (target / "f").exists()  # the bind mount exists only in the namespace


def test_log_tail():
    assert tail(b"a\nb\nc\n", 2) == b"b\nc\n"
    assert tail(b"a\nb", -1) == b"a\nb"
    assert tail(b"a\nb", 0) == b""
