"""A node's power loss kills every process it started, including ones that left their group."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gemini_local.nodeagent import procs

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_kill_node_kills_recorded_groups_and_their_children(tmp_path):
    # A "container": its own session, with a child in the same group.
    container = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE,
                                 text=True, start_new_session=True)
    assert container.stdout is not None
    child = int(container.stdout.readline())
    procs.record_group(tmp_path, container.pid)
    agent = subprocess.Popen(["sleep", "60"], start_new_session=True)
    killed = procs.kill_node(tmp_path, None, agent.pid)
    container.wait(5)
    agent.wait(5)
    time.sleep(0.1)
    assert killed >= 2
    assert not _alive(child)
    assert procs.recorded_groups(tmp_path) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run processes with another gid")
def test_kill_node_finds_escaped_processes_by_group_id(tmp_path):
    gid = 299_999
    # setsid: the grandchild leaves every recorded group; only its group id gives it away.
    script = ("import subprocess; subprocess.Popen(['setsid', 'sleep', '60'], "
              "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)")
    subprocess.run([sys.executable, "-c", script], group=gid, check=True, capture_output=True)
    time.sleep(0.2)
    assert procs.pids_with_gid(gid)
    procs.kill_node(tmp_path, gid, None)
    assert procs.pids_with_gid(gid) == []
