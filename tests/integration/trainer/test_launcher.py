# Over 500 lines: the launcher's behaviours against a real child process, one test each.
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
from prometheus_client.parser import text_string_to_metric_families

from gemini.control import auth, files
from gemini.control.client import signed_header
from gemini.control.signing import (
    CONTROL_PUBLIC_KEY_ENV,
    PublicKey,
    control_public_key,
    public_key_setting,
)
from gemini_trainer import standby as warm
from gemini_trainer.launch_config import LauncherConfig
from gemini_trainer.launcher import Launcher

pytestmark = pytest.mark.integration

TOKEN = "job-secret-0123456789"
CONTROL = "control-secret-0123456789"

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

    def close(self, timeout: float = 10) -> None:
        """Stop the launcher (and its process) if it still runs."""
        if self.thread.is_alive():
            self.launcher.stop()
            self.launcher.finish()
            self.thread.join(timeout)

    def call(
        self, method: str, path: str, body: Any = None,
        token: str | auth.Credentials | None = TOKEN,
    ) -> tuple[int, dict[str, Any]]:
        """A bearer job token (taken from loopback), or signed as the operator (Credentials)."""
        data = None if body is None else json.dumps(body).encode()
        url = f"http://127.0.0.1:{self.launcher.port}{path}"
        req = urllib.request.Request(url, data=data, method=method)
        if isinstance(token, auth.Credentials):
            req.add_header("Authorization", signed_header(
                token.signer, method, path, f"127.0.0.1:{self.launcher.port}", data or b""))
        elif token:
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

    def _start(*child_args: str, status_file: Path | None = None,
               control_public_key: PublicKey | None = None, **env: str) -> Running:
        config = LauncherConfig(
            command=(sys.executable, "-c", CHILD, str(tmp_path / "starts"), *child_args),
            port=0,
            token=TOKEN,
            status_file=status_file,
            grace_s=2.0,
            control_public_key=control_public_key,
        )
        running = Running(Launcher(config, env={**os.environ, **env}))
        started.append(running)
        return running

    yield _start
    for running in started:
        running.close()


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


def test_with_the_operators_key_the_job_token_only_reads(start: Any) -> None:
    """Another pod of the job holds the job token: it must not restart or stop this one."""
    key = public_key_setting({CONTROL_PUBLIC_KEY_ENV: control_public_key(CONTROL)})
    running = start("-1", control_public_key=key)
    running.until(lambda s: s["state"] == "running")
    assert running.call("GET", "/status")[0] == 200  # the job token reads
    assert running.call("POST", "/restart", {"epoch": 2})[0] == 401
    assert running.call("POST", "/stop")[0] == 401
    assert running.status()["restarts"] == 0 and running.status()["state"] == "running"
    assert running.call("POST", "/restart", {"epoch": 2}, token=CONTROL)[0] == 401  # bearer
    assert running.call("POST", "/restart", {"epoch": 2},
                        token=auth.Credentials(CONTROL))[0] == 200  # signed
    running.until(lambda s: s["restarts"] == 1)


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


def test_metrics_are_served_without_a_token_and_follow_restarts(start: Any) -> None:
    running = start("-1", "42", GEMINI_NAMESPACE="team", GEMINI_JOB="train", GEMINI_RANK="1")
    running.until(lambda s: s["progress"] is not None)
    assert running.call("POST", "/restart", {"epoch": 2})[0] == 200
    running.until(lambda s: s["epoch"] == 2 and s["progress"] is not None)
    url = f"http://127.0.0.1:{running.launcher.port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:  # no Authorization header
        text = resp.read().decode()
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["gemini_launcher_restarts_total"].value == 1
    assert samples["gemini_launcher_epoch"].value == 2
    assert samples["gemini_launcher_training_running"].value == 1
    assert samples["gemini_launcher_progress_step"].value == 42
    assert samples["gemini_launcher_start_seconds"].value >= 0
    assert samples["gemini_launcher_epoch"].labels == {
        "geminijob_namespace": "team", "geminijob": "train", "rank": "1"}
    assert samples["process_resident_memory_bytes"].value > 0
    health = f"http://127.0.0.1:{running.launcher.port}/healthz"
    with urllib.request.urlopen(health, timeout=10) as resp:  # open too, for a probe
        assert json.loads(resp.read()) == {"status": "ok"}


def test_the_cli_runs_the_command_and_exits_with_its_code_when_asked(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "gemini_cli",
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
    proc = subprocess.run(cmd, capture_output=True, timeout=60, check=False,
                          env={**os.environ, "GEMINI_AUTH_TOKEN": TOKEN})
    assert proc.returncode == 6, proc.stderr.decode()
    assert json.loads((tmp_path / "s.json").read_text())["exit_code"] == 6


# -- warm standby -------------------------------------------------------------------------------

# A script (not -c): records how it was started, prints, then sleeps, fails or raises.
SCRIPT = (
    "import json, os, sys, time\n"
    "record = {'name': __name__, 'argv': sys.argv, 'cwd': os.getcwd(), 'path0': sys.path[0],\n"
    "          'epoch': os.environ['GEMINI_RESTART_EPOCH'],\n"
    "          'port': os.environ.get('MASTER_PORT'), 'rank': os.environ.get('RANK'),\n"
    "          'pid': os.getpid(), 'leader': os.getpgid(0) == os.getpid(),\n"
    "          'preimported': 'fractions' in sys.modules, 'torch': 'torch' in sys.modules}\n"
    "with open(os.environ['RECORD'], 'a') as f:\n"
    "    f.write(json.dumps(record) + '\\n')\n"
    "print(f\"hello from epoch {record['epoch']}\", flush=True)\n"
    "mode = os.environ.get('CHILD_MODE', 'sleep')\n"
    "if mode == 'sleep':\n"
    "    time.sleep(120)\n"
    "if mode == 'raise':\n"
    "    raise RuntimeError('boom')\n"
    "sys.exit(int(mode))\n"
)


def records(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "records"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture()
def warm_start(tmp_path: Path) -> Iterator[Any]:
    started: list[Running] = []
    script = tmp_path / "scripts" / "child.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)

    def _start(command: tuple[str, ...] | None = None, standby: bool = True,
               hold_standby: bool = True, procs: int = 1,
               preimport: tuple[str, ...] = ("fractions",), heartbeat: Path | None = None,
               **env: str) -> Running:
        config = LauncherConfig(
            command=command or (sys.executable, str(script), "first-arg"),
            port=0, token=TOKEN, grace_s=2.0, hold=True, standby=standby,
            hold_standby=hold_standby, heartbeat_file=heartbeat,
            preimport=preimport,  # fractions: not imported by a bare interpreter
        )
        running = Running(Launcher(config, env={
            **os.environ, "RECORD": str(tmp_path / "records"),
            "GEMINI_NUM_PROC_PER_NODE": str(procs), **env}))
        started.append(running)
        return running

    yield _start
    for running in started:
        running.close()


def restart(running: Running, epoch: int, **env: str) -> dict[str, Any]:
    code, body = running.call("POST", "/restart", {"epoch": epoch, "version": 3, "env": env})
    assert code == 200, body
    return body


def test_a_restart_runs_in_the_warm_standby_like_a_fresh_python_process(
    warm_start: Any, tmp_path: Path
) -> None:
    running = warm_start()
    standby = running.until(lambda s: (s["standby"] or {}).get("ready"))["standby"]
    restart(running, 1, MASTER_PORT="1111")
    running.until(lambda s: len(records(tmp_path)) == 1)
    first = records(tmp_path)[0]
    script = tmp_path / "scripts" / "child.py"
    assert first == {
        "name": "__main__", "argv": [str(script), "first-arg"], "cwd": os.getcwd(),
        "path0": str(script.parent), "epoch": "1", "port": "1111", "pid": standby["pid"],
        "leader": True, "preimported": True, "rank": os.environ.get("RANK"), "torch": False,
    }
    status = running.status()
    assert status["warm"] and status["pid"] == standby["pid"] and status["state"] == "running"
    # named as a spawned interpreter once it runs the script (a fault tool kills it then)
    assert Path(f"/proc/{status['pid']}/comm").read_text().strip() == Path(sys.executable).name
    # re-armed: the next restart also starts warm, with that epoch's environment
    next_standby = running.until(lambda s: (s["standby"] or {}).get("ready"))["standby"]
    assert next_standby["pid"] != standby["pid"]
    restart(running, 2, MASTER_PORT="2222")
    running.until(lambda s: len(records(tmp_path)) == 2)
    second = records(tmp_path)[1]
    assert (second["epoch"], second["port"], second["pid"]) == ("2", "2222", next_standby["pid"])
    assert second["preimported"] and running.status()["warm"]
    assert not alive(first["pid"]), "the restart must end the previous run"


def test_stop_ends_a_warm_started_process_and_the_standby(warm_start: Any, tmp_path: Path) -> None:
    running = warm_start()
    running.until(lambda s: (s["standby"] or {}).get("ready"))
    restart(running, 1)
    standby = running.until(lambda s: (s["standby"] or {}).get("ready"))["standby"]
    pid = running.status()["pid"]
    assert running.call("POST", "/stop")[0] == 200
    running.thread.join(10)
    assert running.code == 0 and not alive(pid)
    deadline = time.monotonic() + 10
    while running.launcher.status()["exit_code"] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # SIGTERM ended it as it ends a fresh interpreter (no handler left from the standby)
    assert running.launcher.status()["exit_code"] == -15
    deadline = time.monotonic() + 10  # let go, not killed: it ends after its current import
    while alive(standby["pid"]):
        assert time.monotonic() < deadline, "the standby outlived the launcher's stop"
        time.sleep(0.05)


def test_sigterm_ends_an_idle_standby_quietly(warm_start: Any) -> None:
    running = warm_start()
    pid = running.until(lambda s: (s["standby"] or {}).get("ready"))["standby"]["pid"]
    [standby] = running.launcher.supervisor.standbys.armed
    assert standby.proc.pid == pid
    os.kill(pid, 15)
    assert standby.proc.wait(10) == 0, "SIGTERM must let it exit on its own"


def test_without_a_usable_standby_the_restart_spawns_a_fresh_process(
    warm_start: Any, tmp_path: Path
) -> None:
    running = warm_start()
    dead = running.until(lambda s: (s["standby"] or {}).get("ready"))["standby"]["pid"]
    os.kill(dead, 9)  # the standby died
    restart(running, 1)
    running.until(lambda s: len(records(tmp_path)) == 1)
    status = running.status()
    assert not status["warm"] and status["pid"] != dead
    assert not records(tmp_path)[0]["preimported"] and records(tmp_path)[0]["leader"]
    # re-armed after the fallback; a start-up setting in the new environment needs a fresh
    # interpreter, so that restart spawns too and the child sees the setting
    running.until(lambda s: (s["standby"] or {}).get("ready"))
    restart(running, 2, OMP_NUM_THREADS="3", MASTER_PORT="3333")
    running.until(lambda s: len(records(tmp_path)) == 2)
    assert not running.status()["warm"] and records(tmp_path)[1]["port"] == "3333"


def test_a_held_launcher_warms_its_first_process_even_without_the_standby_option(
    warm_start: Any, tmp_path: Path
) -> None:
    """A new or replacement pod imports torch while the operator plans and fetches; once
    training runs no second interpreter is kept (that is what warmStandby adds)."""
    running = warm_start(standby=False)
    standby = running.until(lambda s: (s["standby"] or {}).get("ready"))["standby"]
    restart(running, 1, MASTER_PORT="1111")
    running.until(lambda s: len(records(tmp_path)) == 1)
    first = records(tmp_path)[0]
    assert (first["pid"], first["port"], first["preimported"]) == (standby["pid"], "1111", True)
    time.sleep(1.0)  # a standby would be armed at once
    status = running.status()
    assert status["warm"] and status["standby"] is None
    restart(running, 2)
    running.until(lambda s: len(records(tmp_path)) == 2)
    assert not records(tmp_path)[1]["preimported"] and not running.status()["warm"]


def test_a_launcher_whose_process_died_warms_the_next_one_at_once(
    warm_start: Any, tmp_path: Path
) -> None:
    """A crashed rank's next process imports while the operator detects the crash and plans:
    no training process runs meanwhile, so it costs no memory."""
    running = warm_start(standby=False)
    running.until(lambda s: (s["standby"] or {}).get("ready"))
    restart(running, 1, CHILD_MODE="7")
    running.until(lambda s: s["state"] == "exited")
    standby = running.until(lambda s: (s["standby"] or {}).get("ready"))["standby"]
    restart(running, 2)
    running.until(lambda s: len(records(tmp_path)) == 2)
    second = records(tmp_path)[1]
    assert (second["pid"], second["epoch"], second["preimported"]) == (standby["pid"], "2", True)
    assert running.status()["warm"]


@pytest.mark.parametrize("standby", [False, True])
def test_no_standby_when_disabled_or_the_command_is_not_python(
    warm_start: Any, tmp_path: Path, standby: bool
) -> None:
    script = tmp_path / "scripts" / "child.py"
    command = None if not standby else ("/bin/sh", "-c", f"exec {sys.executable} {script} x")
    running = warm_start(command=command, standby=standby, hold_standby=standby)
    assert running.until(lambda s: s["state"] == "held")["standby"] is None
    restart(running, 1)
    running.until(lambda s: len(records(tmp_path)) == 1)
    assert running.status()["standby"] is None and not running.status()["warm"]


@pytest.mark.parametrize(("mode", "code", "stderr"), [("7", 7, ""), ("raise", 1, "boom")])
def test_a_warm_run_exits_with_the_scripts_code_and_prints_to_the_launchers_output(
    tmp_path: Path, mode: str, code: int, stderr: str
) -> None:
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    status_file = tmp_path / "s.json"
    env = {**os.environ, "GEMINI_LAUNCHER_HOLD": "1", "GEMINI_LAUNCHER_PREIMPORT": "fractions",
           "GEMINI_LAUNCHER_STANDBY": "1",
           "RECORD": str(tmp_path / "records"), "GEMINI_AUTH_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "gemini_cli", "launch", "--port", "0", "--exit-on-failure",
           "--status-file", str(status_file), "--", sys.executable, str(script)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not status_file.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the launcher is not up"
            time.sleep(0.05)

        def call(path: str, body: Any = None) -> dict[str, Any]:
            data = None if body is None else json.dumps(body).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{json.loads(status_file.read_text())['port']}{path}",
                data=data, method="GET" if body is None else "POST",
                headers={"Authorization": f"Bearer {TOKEN}"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                answer: dict[str, Any] = json.loads(resp.read())
                return answer

        while not (call("/status")["standby"] or {}).get("ready"):
            assert time.monotonic() < deadline, "no ready standby"
            time.sleep(0.05)
        assert call("/restart", {"epoch": 1, "env": {"CHILD_MODE": mode}})["warm"]
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err.decode()
    assert b"hello from epoch 1" in out and stderr.encode() in err
    assert records(tmp_path)[0]["preimported"]


def test_each_local_process_starts_in_its_own_standby_and_one_without_is_spawned(
    warm_start: Any, tmp_path: Path
) -> None:
    """numProcPerNode 2: a standby per local rank; a rank whose standby died is spawned
    while the other still starts warm."""
    running = warm_start(procs=2)
    running.until(lambda s: (s["standby"] or {}).get("ready"))
    first = [standby.proc.pid for standby in running.launcher.supervisor.standbys.armed]
    restart(running, 1)
    running.until(lambda s: len(records(tmp_path)) == 2)
    got = sorted((r["rank"], r["pid"], r["preimported"]) for r in records(tmp_path))
    assert got == [("0", first[0], True), ("1", first[1], True)]
    assert running.status()["warm"]
    running.until(lambda s: (s["standby"] or {}).get("ready"))  # re-armed beside training
    second = [standby.proc.pid for standby in running.launcher.supervisor.standbys.armed]
    os.kill(second[1], 9)
    restart(running, 2)
    running.until(lambda s: len(records(tmp_path)) == 4)
    latest = {r["rank"]: r for r in records(tmp_path)[2:]}
    assert (latest["0"]["pid"], latest["0"]["preimported"]) == (second[0], True)
    assert latest["1"]["pid"] != second[1] and not latest["1"]["preimported"]
    assert not running.status()["warm"]



def test_a_failed_group_reports_its_own_last_lines_not_what_its_standbys_printed(
    warm_start: Any, tmp_path: Path
) -> None:
    """The standbys armed beside a running group print as they import (here a module that
    prints its pid); the group's failure message has the group's own lines only."""
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "noisy.py").write_text("import os\nprint(f'standby noise {os.getpid()}')\n")
    running = warm_start(procs=2, preimport=("noisy",), PYTHONPATH=str(modules),
                         PYTHONUNBUFFERED="1")
    running.until(lambda s: (s["standby"] or {}).get("ready"))
    restart(running, 1)
    running.until(lambda s: len(records(tmp_path)) == 2)
    running.until(lambda s: (s["standby"] or {}).get("ready"))  # the next ones printed too
    beside = [standby.proc.pid for standby in running.launcher.supervisor.standbys.armed]
    os.kill(records(tmp_path)[0]["pid"], 9)
    running.until(lambda s: s["state"] == "exited")
    parked = files.read_parked(running.launcher.parked_file)
    assert parked is not None and "hello from epoch 1" in parked.error, parked
    for pid in beside:
        assert f"standby noise {pid}" not in parked.error, parked.error


@pytest.mark.parametrize("learned", [None, ["json", "fractions"]])
def test_a_standby_drops_default_imports_the_previous_run_never_made(
    warm_start: Any, tmp_path: Path, learned: list[str] | None
) -> None:
    """With no record of a previous run the default list (torch, DeepSpeed) is imported; once
    a run recorded its modules (here no torch), the defaults it never used are dropped."""
    heartbeat = tmp_path / "memory" / "heartbeat"
    heartbeat.parent.mkdir()
    if learned is not None:
        (heartbeat.parent / warm.MODULES_FILE).write_text(json.dumps(learned))
    running = warm_start(preimport=warm.DEFAULT_PREIMPORT, heartbeat=heartbeat)
    standby = running.until(lambda s: (s["standby"] or {}).get("ready"), 120)["standby"]
    restart(running, 1)
    running.until(lambda s: len(records(tmp_path)) == 1)
    first = records(tmp_path)[0]
    assert first["pid"] == standby["pid"]
    assert first["torch"] is (learned is None)
