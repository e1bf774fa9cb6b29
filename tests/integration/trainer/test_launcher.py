"""The launcher supervises a real child process and obeys its HTTP control API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gemini_trainer.launcher import Launcher, LauncherConfig

pytestmark = pytest.mark.integration

TOKEN = "job-secret"

# The child appends "<epoch> <version> <source> <pid>" to a file, then sleeps or exits.
CHILD = (
    "import os, sys, time\n"
    "e = os.environ\n"
    "with open(sys.argv[1], 'a') as f:\n"
    "    f.write(f\"{e['GEMINI_RESTART_EPOCH']} {e.get('GEMINI_RESTORE_VERSION', '-')} "
    "{e.get('GEMINI_RESTORE_SOURCE', '-')} {os.getpid()}\\n\")\n"
    "if len(sys.argv) > 3:\n"
    "    open(e['GEMINI_HEARTBEAT_FILE'], 'w').write(f'{sys.argv[3]} {time.time()}')\n"
    "code = int(sys.argv[2])\n"
    "if code < 0:\n"
    "    time.sleep(120)\n"
    "sys.exit(code)\n"
)


class Running:
    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.code = self.launcher.run()

    def call(
        self, method: str, path: str, body: Any = None, token: str | None = TOKEN
    ) -> tuple[int, dict[str, Any]]:
        data = None if body is None else json.dumps(body).encode()
        url = f"http://127.0.0.1:{self.launcher.port}{path}"
        req = urllib.request.Request(url, data=data, method=method)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def status(self) -> dict[str, Any]:
        return self.call("GET", "/status")[1]

    def until(self, predicate: Any, timeout: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status()
            if predicate(status):
                return status
            time.sleep(0.05)
        raise AssertionError(f"launcher never reached the state; last {self.status()}")


@pytest.fixture()
def start(tmp_path: Path) -> Iterator[Any]:
    started: list[Running] = []

    def _start(*child_args: str, status_file: Path | None = None, **env: str) -> Running:
        config = LauncherConfig(
            command=(sys.executable, "-c", CHILD, str(tmp_path / "starts"), *child_args),
            port=0,
            token=TOKEN,
            status_file=status_file,
            grace_s=2.0,
        )
        running = Running(Launcher(config, env={**os.environ, **env}))
        started.append(running)
        return running

    yield _start
    for running in started:
        if running.thread.is_alive():
            running.launcher.stop()
            running.launcher.finish()
            running.thread.join(10)


def starts(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "starts"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_failed_process_is_reported_with_its_exit_code_and_the_launcher_stays_up(
    start: Any, tmp_path: Path
) -> None:
    status_file = tmp_path / "status.json"
    running = start("3", status_file=status_file)
    status = running.until(lambda s: s["state"] == "exited")
    assert status["exit_code"] == 3 and status["exited_at"] is not None
    assert running.thread.is_alive(), "the launcher must wait for a restart after a failure"
    on_disk = json.loads(status_file.read_text())
    assert on_disk["state"] == "exited" and on_disk["exit_code"] == 3


def test_restart_starts_the_command_again_in_place_with_the_new_epoch_and_restore_orders(
    start: Any, tmp_path: Path
) -> None:
    running = start("-1", GEMINI_RESTART_EPOCH="0")
    first = running.until(lambda s: s["state"] == "running" and len(starts(tmp_path)) == 1)
    code, body = running.call("POST", "/restart", {"epoch": 1, "version": 7, "source": "peer"})
    assert code == 200 and body["result"] == "restarted"
    running.until(lambda s: len(starts(tmp_path)) == 2)
    epoch, version, source, pid = starts(tmp_path)[1]
    assert (epoch, version, source) == ("1", "7", "peer")
    assert int(pid) != first["pid"] and not alive(first["pid"])
    status = running.status()
    assert status["epoch"] == 1 and status["restarts"] == 1 and status["pid"] == int(pid)
    assert status["restore"] == {"version": 7, "source": "peer"}

    code, body = running.call("POST", "/restart", {"epoch": 1, "version": 7, "source": "peer"})
    assert code == 200 and body["result"] == "already", "a retried request must not restart"
    code, body = running.call("POST", "/restart", {"epoch": 0, "version": 3})
    assert code == 409 and "not newer" in body["error"]
    assert len(starts(tmp_path)) == 2


def test_a_failed_process_is_restarted_on_request(start: Any, tmp_path: Path) -> None:
    running = start("4")
    running.until(lambda s: s["state"] == "exited")
    code, _ = running.call("POST", "/restart", {"epoch": 5, "version": "latest"})
    assert code == 200
    running.until(lambda s: len(starts(tmp_path)) == 2 and s["state"] == "exited")
    assert starts(tmp_path)[1][:3] == ["5", "latest", "local"]


def test_requests_without_the_job_token_or_with_bad_bodies_are_refused(start: Any) -> None:
    running = start("-1")
    running.until(lambda s: s["state"] == "running")
    assert running.call("GET", "/status", token=None)[0] == 401
    assert running.call("POST", "/restart", {"epoch": 9}, token="other-job")[0] == 401
    assert running.call("POST", "/restart", {"epoch": -1})[0] == 400
    assert running.call("POST", "/restart", {"epoch": 2, "version": "x"})[0] == 400
    assert running.call("POST", "/restart", {"epoch": 2, "source": "tape"})[0] == 400
    assert running.status()["restarts"] == 0


def test_stop_ends_the_process_and_the_launcher(start: Any) -> None:
    running = start("-1")
    pid = running.until(lambda s: s["state"] == "running")["pid"]
    code, body = running.call("POST", "/stop")
    assert code == 200 and body["state"] == "stopped"
    running.thread.join(10)
    assert running.code == 0 and not alive(pid)


def test_a_successful_process_ends_the_launcher_with_zero(start: Any) -> None:
    running = start("0")
    running.thread.join(20)
    assert not running.thread.is_alive() and running.code == 0


def test_progress_comes_from_the_heartbeat_file(start: Any) -> None:
    running = start("-1", "42")
    status = running.until(lambda s: s["progress"] is not None)
    assert status["progress"]["step"] == 42 and status["progress"]["age_s"] < 60


def test_the_cli_runs_the_command_and_exits_with_its_code_when_asked(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "gemini.cli",
        "launch",
        "--port",
        "0",
        "--exit-on-failure",
        "--status-file",
        str(tmp_path / "s.json"),
        "--",
        sys.executable,
        "-c",
        CHILD,
        str(tmp_path / "starts"),
        "6",
    ]
    proc = subprocess.run(cmd, capture_output=True, timeout=60, check=False)
    assert proc.returncode == 6, proc.stderr.decode()
    assert json.loads((tmp_path / "s.json").read_text())["exit_code"] == 6
