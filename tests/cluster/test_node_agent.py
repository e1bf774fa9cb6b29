# Over 500 lines: every behaviour of the node agent against one control plane, in one module
# so that they share its session fixtures.
"""The node agent against the real control plane: pods really run as processes.

Each test runs in its own namespace on the shared 4-node `local_cluster`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gemini_local import faults
from gemini_local.nodeagent.volumes import mount_namespaces_available
from tests.fixtures.nodes import LocalCluster, node_ready, wait_until

pytestmark = pytest.mark.cluster

Obj = dict[str, Any]


def py(script: str) -> list[str]:
    return ["python", "-u", "-c", textwrap.dedent(script)]


def pod(name: str, containers: list[Obj], **spec: Any) -> Obj:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": containers, "terminationGracePeriodSeconds": 2, **spec}}


def get_pod(core: client.CoreV1Api, ns: str, name: str) -> Obj:
    resp: Any = core.read_namespaced_pod(name, ns, _preload_content=False)
    return dict(json.loads(resp.data))


def phase(core: client.CoreV1Api, ns: str, name: str) -> str:
    return str(get_pod(core, ns, name).get("status", {}).get("phase"))


def statuses(p: Obj, init: bool = False) -> dict[str, Obj]:
    key = "initContainerStatuses" if init else "containerStatuses"
    return {s["name"]: s for s in p.get("status", {}).get(key) or []}


def cond(p: Obj, kind: str) -> str | None:
    for c in p.get("status", {}).get("conditions") or []:
        if c["type"] == kind:
            return str(c["status"])
    return None


def wait_phase(core: client.CoreV1Api, ns: str, name: str, want: str, timeout: float = 15) -> Obj:
    wait_until(lambda: phase(core, ns, name) == want, timeout, f"pod {name} {want}")
    return get_pod(core, ns, name)


def kubectl(cluster: LocalCluster, *args: str) -> str:
    result = subprocess.run(["kubectl", f"--kubeconfig={cluster.kubeconfig}", *args],
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_nodes_have_shape_topology_address_and_a_fresh_lease(local_cluster):
    core = local_cluster.core
    node: Any = core.read_node("node-3", _preload_content=False)
    node = json.loads(node.data)
    labels, status = node["metadata"]["labels"], node["status"]
    assert (labels["kubernetes.io/hostname"], labels["topology.kubernetes.io/zone"],
            labels["topology.gemini.io/rack"]) == ("node-3", "zone-1", "rack-1")
    for key in ("capacity", "allocatable"):
        assert {k: status[key][k] for k in ("cpu", "memory", "pods", "nvidia.com/gpu")} == {
            "cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": "1"}
    [address] = [a["address"] for a in status["addresses"] if a["type"] == "InternalIP"]
    assert address.startswith("127.") and address.endswith(".4.1")
    assert status["daemonEndpoints"]["kubeletEndpoint"]["Port"] == 10250
    assert not node["spec"].get("taints")  # the controller manager lifted not-ready
    coordination = client.CoordinationV1Api(local_cluster.api)

    def renewed() -> Any:
        lease: Any = coordination.read_namespaced_lease("node-3", "kube-node-lease")
        return lease.spec.renew_time
    first = renewed()
    time.sleep(2.5)
    assert renewed() > first  # renewed every 2 s


def test_pod_runs_then_succeeds_or_fails_with_its_exit_code(local_cluster, namespace):
    core = local_cluster.core
    core.create_namespaced_pod(namespace, pod("ok", [
        {"name": "main", "image": "busybox", "command": py("import time; time.sleep(1.5)")}],
        restartPolicy="Never"))
    # No volume at all (no service-account token either): nothing else makes its directory.
    core.create_namespaced_pod(namespace, pod("bad", [
        {"name": "main", "image": "busybox", "command": ["sh", "-c", "exit 3"]}],
        restartPolicy="Never", automountServiceAccountToken=False))
    wait_phase(core, namespace, "ok", "Running")
    done = wait_phase(core, namespace, "ok", "Succeeded")
    terminated = statuses(done)["main"]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (0, "Completed")
    failed = wait_phase(core, namespace, "bad", "Failed")
    terminated = statuses(failed)["main"]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (3, "Error")
    assert cond(failed, "Ready") == "False"


def test_restart_policies(local_cluster, namespace):
    core = local_cluster.core
    # Fails on its first run only: a counter file in an emptyDir survives the restart.
    flaky = ["sh", "-c", "if [ -e /data/ran ]; then exit 0; fi; touch /data/ran; exit 1"]
    volume = {"volumes": [{"name": "data", "emptyDir": {}}]}
    mount = [{"name": "data", "mountPath": "/data"}]
    core.create_namespaced_pod(namespace, pod("onfailure", [
        {"name": "c", "image": "x", "command": flaky, "volumeMounts": mount}],
        restartPolicy="OnFailure", **volume))
    core.create_namespaced_pod(namespace, pod("never", [
        {"name": "c", "image": "x", "command": flaky, "volumeMounts": mount}],
        restartPolicy="Never", **volume))
    core.create_namespaced_pod(namespace, pod("always", [
        {"name": "c", "image": "x", "command": ["true"]}], restartPolicy="Always"))
    done = wait_phase(core, namespace, "onfailure", "Succeeded")
    status = statuses(done)["c"]
    assert status["restartCount"] == 1
    assert status["lastState"]["terminated"]["exitCode"] == 1
    failed = wait_phase(core, namespace, "never", "Failed")
    assert statuses(failed)["c"]["restartCount"] == 0
    wait_until(lambda: statuses(get_pod(core, namespace, "always"))["c"]["restartCount"] >= 2,
               10, "restartPolicy Always to restart a container that exits 0")
    assert phase(core, namespace, "always") == "Running"


def test_native_sidecar_starts_first_and_survives_main_restart(local_cluster, namespace):
    core = local_cluster.core
    sidecar = {"name": "sidecar", "image": "x", "restartPolicy": "Always",
               "command": py("""
                   import pathlib, time
                   pathlib.Path('/shared/sidecar-up').write_text('up')
                   while True: time.sleep(1)
               """), "volumeMounts": [{"name": "shared", "mountPath": "/shared"}]}
    mounts = [{"name": "shared", "mountPath": "/shared"}]
    init = {"name": "init", "image": "x", "volumeMounts": mounts,
            "command": ["sh", "-c", "test -e /shared/sidecar-up && echo init > /shared/init"]}
    main = {"name": "main", "image": "x", "volumeMounts": mounts,
            "command": ["sh", "-c", "test -e /shared/init || exit 7; "
                        "if [ -e /shared/main-ran ]; then exit 0; fi; "
                        "touch /shared/main-ran; exit 1"]}
    core.create_namespaced_pod(namespace, pod(
        "sc", [main], initContainers=[sidecar, init], restartPolicy="OnFailure",
        volumes=[{"name": "shared", "emptyDir": {}}]))
    done = wait_phase(core, namespace, "sc", "Succeeded")
    mains, inits = statuses(done), statuses(done, init=True)
    assert mains["main"]["restartCount"] == 1
    assert mains["main"]["lastState"]["terminated"]["exitCode"] == 1  # not 7: init ran first
    assert inits["init"]["state"]["terminated"]["exitCode"] == 0
    assert inits["sidecar"]["restartCount"] == 0  # kept running across the main restart
    assert "terminated" in inits["sidecar"]["state"]  # and stopped once the pod completed


def test_two_containers_share_a_memory_backed_empty_dir(local_cluster, namespace):
    core = local_cluster.core
    mount = [{"name": "shm", "mountPath": "/dev/shm"}]
    writer = {"name": "writer", "image": "x", "volumeMounts": mount,
              "command": ["sh", "-c", "echo hello > /dev/shm/msg; sleep 30"]}
    reader = {"name": "reader", "image": "x", "volumeMounts": mount, "command": py("""
        import os, time
        for _ in range(100):
            if os.path.exists('/dev/shm/msg'):
                break
            time.sleep(0.05)
        print(open('/dev/shm/msg').read().strip())
        print(os.environ['GEMINI_VOLUME_SHM'])
        print([line.split()[2] for line in open('/proc/self/mounts') if ' /dev/shm ' in line][-1])
        time.sleep(30)
    """)}
    core.create_namespaced_pod(namespace, pod(
        "shm", [writer, reader], volumes=[{"name": "shm", "emptyDir": {"medium": "Memory"}}]))
    wait_phase(core, namespace, "shm", "Running")
    log = wait_until(lambda: kubectl(local_cluster, "-n", namespace, "logs", "shm", "-c",
                                     "reader").split(), 10, "reader output")
    assert log[0] == "hello"
    assert log[1].startswith("/dev/shm/")  # the volume's directory lives on tmpfs
    assert log[2] == "tmpfs"


def test_downward_api_and_config_env(local_cluster, namespace):
    core = local_cluster.core
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "cfg"},
                                                  "data": {"mode": "fast", "LEVEL": "3"}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "sec"},
                                              "stringData": {"token": "s3cr3t"}})
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        {"name": "RANK", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.labels['rank']"}}},
        {"name": "CPU_MILLIS", "valueFrom": {"resourceFieldRef": {
            "resource": "limits.cpu", "divisor": "1m"}}},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "token"}}},
        {"name": "GREETING", "value": "pod $(POD_NAME) in $(POD_NS)"},
    ]
    body = pod("env", [{
        "name": "main", "image": "x", "env": env, "envFrom": [{"configMapRef": {"name": "cfg"},
                                                              "prefix": "CFG_"}],
        "resources": {"limits": {"cpu": "1500m"}},
        "command": py("""
            import json, os, socket
            me = socket.gethostname()
            print(json.dumps({**os.environ, "_hostname": me, "_me": socket.gethostbyname(me)}))
        """)}],
        restartPolicy="Never")
    body["metadata"]["labels"] = {"rank": "5"}
    core.create_namespaced_pod(namespace, body)
    done = wait_phase(core, namespace, "env", "Succeeded")
    got = json.loads(kubectl(local_cluster, "-n", namespace, "logs", "env"))
    assert got["POD_IP"] == done["status"]["podIP"]
    assert got["HOST_IP"] == done["status"]["hostIP"]
    assert got["POD_NAME"] == "env"
    assert got["POD_NS"] == namespace
    assert got["POD_UID"] == done["metadata"]["uid"]
    assert got["NODE"] == done["spec"]["nodeName"]
    assert got["RANK"] == "5"
    assert got["CPU_MILLIS"] == "1500"
    assert (got["MODE"], got["TOKEN"], got["CFG_LEVEL"]) == ("fast", "s3cr3t", "3")
    assert got["GREETING"] == f"pod env in {namespace}"
    assert got["HOSTNAME"] == "env"
    if mount_namespaces_available():  # as with a kubelet: the pod's name, at the pod's IP
        assert (got["_hostname"], got["_me"]) == ("env", done["status"]["podIP"])
    # The project's virtual environment comes first on PATH (images are not pulled).
    assert got["PATH"].split(":")[0] == str(Path(sys.executable).parent)


def test_kubectl_logs_current_and_previous(local_cluster, namespace):
    core = local_cluster.core
    script = ("n=$(cat /data/n 2>/dev/null || echo 0); echo run-$n; echo $((n+1)) > /data/n; "
              "if [ $n = 0 ]; then exit 1; fi; sleep 30")
    core.create_namespaced_pod(namespace, pod(
        "logs", [{"name": "c", "image": "x", "command": ["sh", "-c", script],
                  "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
        restartPolicy="OnFailure", volumes=[{"name": "data", "emptyDir": {}}]))
    wait_until(lambda: statuses(get_pod(core, namespace, "logs")).get("c", {}).get(
        "state", {}).get("running") and statuses(get_pod(core, namespace, "logs"))["c"][
        "restartCount"] == 1, 10, "the second run")
    wait_until(lambda: "run-1" in kubectl(local_cluster, "-n", namespace, "logs", "logs", "-c",
                                          "c"), 5, "current log")
    previous = kubectl(local_cluster, "-n", namespace, "logs", "logs", "-c", "c", "--previous")
    assert previous.strip() == "run-0"


def test_failing_readiness_probe_keeps_pod_not_ready(local_cluster, namespace):
    core = local_cluster.core
    server = py("""
        import http.server, os
        addr = (os.environ['GEMINI_POD_IP'], 8080)
        http.server.HTTPServer(addr, http.server.SimpleHTTPRequestHandler).serve_forever()
    """)
    core.create_namespaced_pod(namespace, pod("unready", [{
        "name": "c", "image": "x", "command": ["sleep", "60"],
        "readinessProbe": {"exec": {"command": ["false"]}, "periodSeconds": 1}}]))
    core.create_namespaced_pod(namespace, pod("ready", [{
        "name": "c", "image": "x", "command": server,
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}}]))
    wait_until(lambda: cond(get_pod(core, namespace, "ready"), "Ready") == "True", 10,
               "httpGet readiness to pass")
    p = wait_phase(core, namespace, "unready", "Running")
    time.sleep(3)  # three failing probes later it is still not ready
    p = get_pod(core, namespace, "unready")
    assert cond(p, "Ready") == "False"
    assert statuses(p)["c"]["ready"] is False


def test_liveness_probe_failure_restarts_container(local_cluster, namespace):
    core = local_cluster.core
    core.create_namespaced_pod(namespace, pod("live", [{
        "name": "c", "image": "x", "command": ["sleep", "60"],
        "livenessProbe": {"tcpSocket": {"port": 9}, "periodSeconds": 1, "failureThreshold": 2}}]))
    wait_until(lambda: statuses(get_pod(core, namespace, "live")).get("c", {}).get(
        "restartCount", 0) >= 1, 15, "liveness failure to restart the container")


def test_pod_ips_are_distinct_and_pods_talk_over_tcp(local_cluster, namespace):
    core = local_cluster.core
    server = py("""
        import os, socket
        s = socket.socket(); s.bind((os.environ['POD_IP'], 7000)); s.listen()
        while True:
            c, _ = s.accept(); c.sendall(os.environ['POD_NAME'].encode()); c.close()
    """)
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    for name, node in (("a", "node-0"), ("b", "node-1"), ("c", "node-1")):
        core.create_namespaced_pod(namespace, pod(name, [
            {"name": "srv", "image": "x", "command": server, "env": env}], nodeName=node))
    pods = {n: wait_phase(core, namespace, n, "Running") for n in "abc"}
    ips = {n: p["status"]["podIP"] for n, p in pods.items()}
    assert len(set(ips.values())) == 3  # same port 7000 on every pod: no collision
    client_script = py(f"""
        import socket, time
        for name, ip in {sorted(ips.items())!r}:
            for _ in range(50):
                try:
                    print(socket.create_connection((ip, 7000), timeout=2).recv(10).decode())
                    break
                except ConnectionRefusedError:
                    time.sleep(0.1)
    """)
    core.create_namespaced_pod(namespace, pod("client", [
        {"name": "c", "image": "x", "command": client_script}], nodeName="node-2",
        restartPolicy="Never"))
    wait_phase(core, namespace, "client", "Succeeded", timeout=30)  # up to 5 s of retries
    assert kubectl(local_cluster, "-n", namespace, "logs", "client").split() == ["a", "b", "c"]


def test_deleting_a_pod_ends_its_processes_within_grace(local_cluster, namespace, tmp_path):
    core = local_cluster.core
    shared = [{"name": "shared", "mountPath": "/shared"}, {"name": "out", "mountPath": "/out"}]
    # `$$$$` is a literal `$$` after the kubelet's $(VAR) expansion.
    stubborn = ["sh", "-c", "trap '' TERM; echo $$$$ > /shared/stubborn.pid; "
                "while true; do sleep 0.1; done"]
    polite = py("""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
        open('/shared/polite.pid', 'w').write(str(os.getpid()))
        time.sleep(60)
    """)
    # On SIGTERM the sidecar records whether the main containers were already gone.
    sidecar = py("""
        import os, signal, sys, time
        def term(*_):
            alive = []
            for name in ('stubborn', 'polite'):
                pid = int(open(f'/shared/{name}.pid').read())
                try:
                    state = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0]
                    alive += [name] if state != 'Z' else []
                except OSError:
                    pass
            open('/out/alive-at-sidecar-term', 'w').write(','.join(alive) or 'none')
            sys.exit(0)
        signal.signal(signal.SIGTERM, term)
        while True: time.sleep(1)
    """)
    core.create_namespaced_pod(namespace, pod("del", [
        {"name": "stubborn", "image": "x", "command": stubborn, "volumeMounts": shared},
        {"name": "polite", "image": "x", "command": polite, "volumeMounts": shared}],
        initContainers=[{"name": "sidecar", "image": "x", "restartPolicy": "Always",
                         "command": sidecar, "volumeMounts": shared}],
        volumes=[{"name": "shared", "emptyDir": {}},
                 {"name": "out", "hostPath": {"path": str(tmp_path)}}],
        terminationGracePeriodSeconds=2))
    wait_phase(core, namespace, "del", "Running")
    pod_dir = f"nodes/*/pods/{namespace}_del_*"
    wait_until(lambda: len(list(local_cluster.state_dir.glob(f"{pod_dir}/volumes/shared/*.pid")))
               == 2, 5, "both main containers to write their pids")
    pids = [int(p.read_text()) for p in local_cluster.state_dir.glob(
        f"{pod_dir}/containers/*.pid")]
    assert len(pids) == 3
    start = time.monotonic()
    core.delete_namespaced_pod("del", namespace)

    def gone() -> bool:
        try:
            core.read_namespaced_pod("del", namespace)
            return False
        except client.ApiException as err:
            return bool(err.status == 404)
    wait_until(gone, 10, "the pod object to be deleted")
    elapsed = time.monotonic() - start
    # Main containers get the 2 s grace period, the sidecar at least 1 s more at most.
    assert elapsed < 2 + 1 + 1.5, f"deletion took {elapsed:.1f}s with a 2 s grace period"
    for pid in pids:
        assert not _alive(pid), f"process {pid} survived its pod"
    assert (tmp_path / "alive-at-sidecar-term").read_text() == "none"  # sidecar stopped last


def test_each_container_has_its_own_tmpdir_removed_with_the_pod(local_cluster, namespace):
    core = local_cluster.core
    # Each container writes a file into its temporary folder and names the folder.
    writer = py("""
        import os, tempfile, time
        folder = tempfile.gettempdir()
        open(os.path.join(folder, 'left-behind'), 'w').write('x')
        print('TMP=' + folder, flush=True)
        time.sleep(60)
    """)
    core.create_namespaced_pod(namespace, pod("tmp", [
        {"name": "a", "image": "x", "command": writer},
        {"name": "b", "image": "x", "command": writer}]))
    wait_phase(core, namespace, "tmp", "Running")
    folders: dict[str, Path] = {}

    def named() -> bool:
        for name in ("a", "b"):
            logs = core.read_namespaced_pod_log("tmp", namespace, container=name)
            found = [line[4:] for line in logs.splitlines() if line.startswith("TMP=")]
            if found:
                folders[name] = Path(found[0])
        return len(folders) == 2
    wait_until(named, 15, "both containers to name their temporary folder")
    assert folders["a"] != folders["b"]
    for folder in folders.values():
        assert folder.parent.name.startswith("gemini-pod-"), folder  # the pod's, not /tmp
        assert (folder / "left-behind").exists()
    core.delete_namespaced_pod("tmp", namespace)
    wait_until(lambda: not any(f.exists() for f in folders.values()), 15,
               "the temporary folders to go with the pod")


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_killed_container_restarts_with_exit_code_137(local_cluster, namespace):
    core = local_cluster.core
    core.create_namespaced_pod(namespace, pod("victim", [
        {"name": "c", "image": "x", "command": ["sleep", "60"]}]))
    wait_phase(core, namespace, "victim", "Running")
    faults.kill_container(local_cluster.state_dir, namespace, "victim", "c")
    wait_until(lambda: statuses(get_pod(core, namespace, "victim"))["c"]["restartCount"] == 1,
               10, "the container to restart")
    last = statuses(get_pod(core, namespace, "victim"))["c"]["lastState"]["terminated"]
    assert last["exitCode"] == 137


def test_deployment_and_job_run(local_cluster, namespace):
    apps, batch = client.AppsV1Api(local_cluster.api), client.BatchV1Api(local_cluster.api)
    labels = {"app": "web"}
    deployment: Any = {
        "metadata": {"name": "web"}, "spec": {
            "replicas": 2, "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "c", "image": "x", "command": ["sleep", "300"]}]}}}}
    job: Any = {
        "metadata": {"name": "job"}, "spec": {
            "completions": 2, "parallelism": 2, "backoffLimit": 0,
            "template": {"spec": {"restartPolicy": "Never", "containers": [
                {"name": "c", "image": "x", "command": ["sh", "-c", "echo done"]}]}}}}
    apps.create_namespaced_deployment(namespace, deployment)
    batch.create_namespaced_job(namespace, job)

    def available() -> int:
        status = apps.read_namespaced_deployment("web", namespace).status
        return (status.available_replicas if status else None) or 0

    def succeeded() -> int:
        status = batch.read_namespaced_job("job", namespace).status
        return (status.succeeded if status else None) or 0
    wait_until(lambda: available() == 2, 30, "2 available replicas")
    wait_until(lambda: succeeded() == 2, 30, "the job to succeed twice")


def test_owner_reference_garbage_collection(local_cluster, namespace):
    core = local_cluster.core
    owner = core.create_namespaced_pod(namespace, pod("owner", [
        {"name": "c", "image": "x", "command": ["sleep", "60"]}], terminationGracePeriodSeconds=1))
    core.create_namespaced_config_map(namespace, {"metadata": {
        "name": "owned", "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "owner",
                                              "uid": owner.metadata.uid}]}})
    wait_phase(core, namespace, "owner", "Running")
    core.delete_namespaced_pod("owner", namespace)

    def collected() -> bool:
        try:
            core.read_namespaced_config_map("owned", namespace)
            return False
        except client.ApiException as err:
            return bool(err.status == 404)
    wait_until(collected, 20, "the owned ConfigMap to be garbage-collected")


def test_lost_node_turns_unknown_and_its_pods_not_ready(local_cluster, namespace):
    core = local_cluster.core
    spare = local_cluster.add_spare()
    core.create_namespaced_pod(namespace, pod("doomed", [
        {"name": "c", "image": "x", "command": ["sleep", "300"]}], nodeName=spare.name))
    wait_until(lambda: cond(get_pod(core, namespace, "doomed"), "Ready") == "True", 10,
               "pod Ready")
    faults.lose_node(local_cluster.state_dir, spare.name)
    wait_until(lambda: node_ready(core, spare.name) == "Unknown", 15, "node Ready=Unknown")
    assert "NotReady" in kubectl(local_cluster, "get", "node", spare.name)
    wait_until(lambda: cond(get_pod(core, namespace, "doomed"), "Ready") == "False", 10,
               "the lost node's pod to be marked not ready")


def test_partitioned_node_is_cut_off_and_heals(local_cluster, namespace):
    if os.geteuid() != 0 or not shutil.which("nft"):
        pytest.skip("partitions need root and nftables")
    core = local_cluster.core
    spare = local_cluster.add_spare()
    # The pod serves on its IP, and echoes on a connection it opened to us before the cut.
    outside = socket.create_server(("127.0.0.1", 0))
    server = py(f"""
        import os, socket, threading
        def echo():
            c = socket.create_connection(("127.0.0.1", {outside.getsockname()[1]}))
            while True:
                c.sendall(c.recv(4))
        threading.Thread(target=echo, daemon=True).start()
        s = socket.socket(); s.bind((os.environ['GEMINI_POD_IP'], 7001)); s.listen()
        while True:
            c, _ = s.accept(); c.sendall(b'pong'); c.close()
    """)
    # Tolerate the unreachable taint forever, so the pod is not evicted while cut off.
    forever = [{"key": f"node.kubernetes.io/{t}", "operator": "Exists", "effect": "NoExecute"}
               for t in ("unreachable", "not-ready")]
    core.create_namespaced_pod(namespace, pod("island", [
        {"name": "c", "image": "x", "command": server}], nodeName=spare.name,
        tolerations=forever))
    ip = wait_phase(core, namespace, "island", "Running")["status"]["podIP"]

    def reachable() -> bool:
        import socket
        try:
            return socket.create_connection((ip, 7001), timeout=0.5).recv(4) == b"pong"
        except OSError:
            return False
    wait_until(reachable, 5, "the pod's server")
    outside.settimeout(10)
    opened, _ = outside.accept()
    opened.settimeout(2)
    opened.sendall(b"ping")
    assert opened.recv(4) == b"ping"
    faults.partition_node(local_cluster.state_dir, spare.name)
    try:
        assert not reachable()
        # We speak first after the cut; the pod's answer must still be dropped (it opened the
        # connection: the rules need the node's connection tracking to know that).
        opened.sendall(b"ping")
        with pytest.raises(TimeoutError):
            opened.recv(4)
        wait_until(lambda: node_ready(core, spare.name) == "Unknown", 15, "node Ready=Unknown")
        wait_until(lambda: cond(get_pod(core, namespace, "island"), "Ready") == "False", 10,
                   "the node controller to mark the cut-off pod not ready")
    finally:
        faults.heal_node(local_cluster.state_dir, spare.name)
    wait_until(reachable, 5, "the pod's server after healing")
    wait_until(lambda: node_ready(core, spare.name) == "True", 15, "node Ready again")
    wait_until(lambda: cond(get_pod(core, namespace, "island"), "Ready") == "True", 10,
               "the agent to report its pod ready again")
    core.create_namespaced_pod(namespace, pod("after", [
        {"name": "c", "image": "x", "command": ["sleep", "60"]}], nodeName=spare.name))
    wait_phase(core, namespace, "after", "Running", timeout=10)


def test_fault_cli_kills_a_container_and_names_unknown_nodes(local_cluster, namespace):
    core = local_cluster.core
    core.create_namespaced_pod(namespace, pod("cli", [
        {"name": "c", "image": "x", "command": ["sleep", "60"]}]))
    wait_phase(core, namespace, "cli", "Running")
    gemini = [str(Path(sys.executable).parent / "gemini"), "fault",
              f"--state-dir={local_cluster.state_dir}"]
    out = subprocess.run([*gemini, "kill-container", f"{namespace}/cli", "c", "-o", "json"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    assert json.loads(out)["signal"] == "SIGKILL"
    wait_until(lambda: statuses(get_pod(core, namespace, "cli"))["c"]["restartCount"] == 1,
               10, "the container to restart")
    missing = subprocess.run([*gemini, "lose-node", "no-such-node"], capture_output=True,
                             text=True, timeout=30, check=False)
    assert missing.returncode == 1
    assert "no node 'no-such-node'" in missing.stderr
