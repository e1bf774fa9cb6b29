"""The launcher's start protocol with the operator: hold until /restart, per-epoch env,
and no training process outlives a killed launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gemini_trainer.launch_config import LauncherConfig
from gemini_trainer.launch_state import LauncherError, RestartRequest
from gemini_trainer.launcher import Launcher

CHILD = (
    "import os, sys, time\n"
    "open(sys.argv[1], 'a').write(os.environ.get('MASTER_ADDR', '-') + ' '"
    " + os.environ.get('MASTER_PORT', '-') + ' ' + os.environ['GEMINI_RESTART_EPOCH'] + '\\n')\n"
    "time.sleep(60)\n"
)


def _post(port: int, path: str, body: Any) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def test_restart_env_is_validated() -> None:
    req = RestartRequest.parse({"epoch": 2, "version": 5, "env": {"MASTER_ADDR": "127.1.1.2"}})
    assert req.env()["MASTER_ADDR"] == "127.1.1.2"
    assert req.env()["GEMINI_RESTART_EPOCH"] == "2"
    for bad in ({"A=B": "x"}, {"A": 1}, ["A"], {"": "x"}):
        with pytest.raises(LauncherError):
            RestartRequest.parse({"epoch": 1, "version": None, "env": bad})


def test_hold_mode_from_env() -> None:
    assert LauncherConfig.from_env(["x"], {"GEMINI_LAUNCHER_HOLD": "1"}).hold
    assert not LauncherConfig.from_env(["x"], {}).hold


@pytest.mark.integration
def test_held_launcher_starts_on_restart_with_the_given_rendezvous(tmp_path: Path) -> None:
    log = tmp_path / "starts"
    config = LauncherConfig(command=(sys.executable, "-c", CHILD, str(log)), port=0, hold=True,
                            grace_s=2.0, insecure_local=True)
    launcher = Launcher(config, env=dict(os.environ))
    thread = threading.Thread(target=launcher.run, daemon=True)
    thread.start()
    try:
        time.sleep(0.5)
        assert launcher.status()["state"] == "held" and not log.exists()
        body = {"epoch": 1, "version": None, "env": {"MASTER_ADDR": "127.0.0.9",
                                                     "MASTER_PORT": "29501"}}
        assert _post(launcher.port, "/restart", body)["result"] == "restarted"
        assert _post(launcher.port, "/restart", body)["result"] == "already"
        _until(lambda: log.exists() and log.read_text().count("\n") == 1)
        assert log.read_text().split() == ["127.0.0.9", "29501", "1"]
    finally:
        launcher.stop()
        launcher.finish()
        thread.join(10)


@pytest.mark.integration
def test_killing_the_launcher_kills_its_training_process(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = textwrap.dedent(f"""
        import os, sys
        from gemini_trainer.launch_config import LauncherConfig
        from gemini_trainer.launcher import Launcher
        child = ("import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                 "time.sleep(60)")
        cfg = LauncherConfig(command=(sys.executable, "-c", child), port=0, insecure_local=True)
        sys.exit(Launcher(cfg).run())
    """)
    # Killed, the launcher cannot remove its temporary folder: keep it in tmp_path.
    proc = subprocess.Popen([sys.executable, "-c", script],
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        _until(lambda: pid_file.exists() and pid_file.read_text() != "")
        child = int(pid_file.read_text())
        proc.kill()
        proc.wait(10)
        _until(lambda: not _alive(child))
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _until(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("the condition never held")


@pytest.mark.integration
def test_a_restart_ends_a_stopped_training_process_without_waiting_out_the_grace() -> None:
    """The operator restarts a hung rank; a process stopped (SIGSTOP: the fault matrix's
    hang) acts on the launcher's SIGTERM once continued, not at the grace period's end."""
    config = LauncherConfig(command=(sys.executable, "-c", "import time; time.sleep(60)"),
                            port=0, hold=True, grace_s=30.0, insecure_local=True)
    launcher = Launcher(config, env=dict(os.environ))
    thread = threading.Thread(target=launcher.run, daemon=True)
    thread.start()
    try:
        _until(lambda: launcher.port)
        _post(launcher.port, "/restart", {"epoch": 1, "version": None})
        # (a loaded machine starts the warm standby's interpreter slowly)
        _until(lambda: launcher.status()["state"] == "running" and launcher.status()["pid"],
               timeout=90)
        os.killpg(int(launcher.status()["pid"]), signal.SIGSTOP)
        start = time.monotonic()
        assert _post(launcher.port, "/restart", {"epoch": 2, "version": None})["result"] == \
            "restarted"
        assert time.monotonic() - start < 10
    finally:
        launcher.stop()
        launcher.finish()
        thread.join(10)
