"""The pod's hostname and /etc/hosts, as a kubelet writes them."""

import socket
import subprocess

import pytest

from gemini_local.nodeagent.hosts import hosts_file, mounts_etc_hosts, pod_hostname
from gemini_local.nodeagent.volumes import Mount, mount_namespaces_available, namespaced_argv


def _pod(**spec):
    return {"metadata": {"name": "job-worker-0", "namespace": "ml"}, "spec": spec}


def test_the_pod_name_is_the_hostname_unless_spec_hostname_is_set():
    assert pod_hostname(_pod()) == "job-worker-0"
    assert pod_hostname(_pod(hostname="w0")) == "w0"
    long = {"metadata": {"name": "a" * 62 + "-b", "namespace": "ml"}, "spec": {}}
    assert pod_hostname(long) == "a" * 62  # a DNS label: 63 characters, no trailing dash


def test_the_hosts_file_maps_the_hostname_to_the_pod_ip():
    lines = hosts_file(_pod(), "127.0.3.7").splitlines()
    assert "127.0.0.1\tlocalhost" in lines
    assert lines[-1] == "127.0.3.7\tjob-worker-0"


def test_a_subdomain_adds_the_fully_qualified_name_first():
    text = hosts_file(_pod(subdomain="job"), "127.0.3.7")
    assert "127.0.3.7\tjob-worker-0.job.ml.svc.cluster.local job-worker-0\n" in text


def test_host_aliases_are_appended():
    pod = _pod(hostAliases=[{"ip": "10.0.0.9", "hostnames": ["s3", "s3.local"]}])
    assert hosts_file(pod, "127.0.3.7").endswith("10.0.0.9\ts3 s3.local\n")


def test_a_container_mounting_etc_hosts_itself_keeps_it():
    assert mounts_etc_hosts({"volumeMounts": [{"name": "h", "mountPath": "/etc/hosts"}]})
    assert not mounts_etc_hosts({"volumeMounts": [{"name": "h", "mountPath": "/data"}]})
    assert not mounts_etc_hosts({})


@pytest.mark.skipif(not mount_namespaces_available(), reason="needs root and unshare")
def test_inside_the_namespaces_the_hostname_resolves_to_the_pod_ip(tmp_path):
    hosts = tmp_path / "etc-hosts"
    hosts.write_text(hosts_file(_pod(), "127.0.3.7"))
    script = "import socket; n = socket.gethostname(); print(n, socket.gethostbyname(n))"
    argv = namespaced_argv(["python3", "-c", script], [Mount(hosts, "/etc/hosts", False)],
                           str(tmp_path), hostname="job-worker-0")
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["job-worker-0", "127.0.3.7"]
    assert socket.gethostname() != "job-worker-0"  # the UTS namespace kept the name apart
