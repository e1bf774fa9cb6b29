"""The control plane is real: RBAC on, components healthy, clear errors on misuse."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kubernetes import client, config

from gemini_local import controlplane
from gemini_local.controlplane import ControlPlane, ControlPlaneError

pytestmark = pytest.mark.cluster


def _api(kubeconfig: Path) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(str(kubeconfig)))


def test_the_api_server_serves_the_built_version(control_plane: ControlPlane) -> None:
    version = client.VersionApi(config.new_client_from_config(str(control_plane.kubeconfig)))
    assert version.get_code().git_version == "v1.35.4"


def test_rbac_refuses_an_identity_without_roles(control_plane: ControlPlane) -> None:
    cert, key = control_plane.pki.issue("nobody-client", "nobody", client=True)
    cfg = client.Configuration()
    cfg.host = control_plane.api_url
    cfg.ssl_ca_cert = str(control_plane.pki.ca_cert)
    cfg.cert_file, cfg.key_file = str(cert), str(key)
    with pytest.raises(client.ApiException) as err:
        client.CoreV1Api(client.ApiClient(cfg)).list_namespaced_pod("default")
    assert err.value.status == 403


def test_every_component_is_running(control_plane: ControlPlane) -> None:
    pids = controlplane.running_components(control_plane.state_dir)
    assert all(pids.values()), pids


def test_a_second_start_in_the_same_directory_says_it_is_already_running(
    control_plane: ControlPlane,
) -> None:
    with pytest.raises(ControlPlaneError, match="already running"):
        controlplane.start_control_plane(control_plane.state_dir)


def test_controllers_run_a_namespace_through_deletion(control_plane: ControlPlane) -> None:
    api = _api(control_plane.kubeconfig)
    api.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="doomed")))
    api.delete_namespace("doomed")
    for _ in range(200):
        names = [n.metadata.name for n in api.list_namespace().items]
        if "doomed" not in names:
            return
        import time

        time.sleep(0.1)
    pytest.fail("namespace deletion was not finished by the controller manager within 20 s")


def test_stop_leaves_nothing_running_and_a_second_stop_reports_nothing(tmp_path: Path) -> None:
    plane = controlplane.start_control_plane(tmp_path)
    pids = [p for p in controlplane.running_components(tmp_path).values() if p]
    assert sorted(controlplane.stop_control_plane(tmp_path)) == sorted(controlplane.COMPONENTS)
    assert not any(Path(f"/proc/{pid}/cmdline").exists() and
                   Path(f"/proc/{pid}/cmdline").read_bytes() for pid in pids)
    assert controlplane.stop_control_plane(tmp_path) == []
    assert plane.kubeconfig.exists()


def test_down_on_a_stopped_cluster_says_so(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gemini_cli", "local", "--state-dir", str(tmp_path), "down"],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0
    assert "no local cluster is running" in result.stderr


def test_a_missing_go_toolchain_is_named_when_binaries_are_not_built(tmp_path: Path) -> None:
    env = {**os.environ, "GEMINI_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c",
         "from gemini_local.controlplane import binaries_dir; binaries_dir()"],
        capture_output=True, text=True, env=env, check=False,
    )
    assert result.returncode != 0
    assert "Go is not installed" in result.stderr
