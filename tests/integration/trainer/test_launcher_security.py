"""The launcher's API is never open by accident: no start without a real token (unless a local
run opts in, on loopback only), and a request that does not arrive whole is cut off."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from gemini_trainer import launcher_server as launcher_module
from gemini_trainer.launch_config import LauncherConfig, LauncherConfigError
from gemini_trainer.launcher import Launcher

pytestmark = pytest.mark.integration

TOKEN = "launcher-security-token"
SLEEP = (sys.executable, "-c", "import time; time.sleep(120)")


def _launch_cli(token: str | None, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GEMINI_AUTH_TOKEN", "GEMINI_LAUNCHER_INSECURE_LOCAL")}
    if token is not None:
        env["GEMINI_AUTH_TOKEN"] = token
    cmd = [sys.executable, "-m", "gemini_cli", "launch", "--port", "0", *flags, "--", "true"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(("token", "says"), [
    (None, "GEMINI_AUTH_TOKEN is not set"),
    ("", "GEMINI_AUTH_TOKEN is not set"),
    ("x", "GEMINI_AUTH_TOKEN is too short (1 of at least 16 characters)"),
])
def test_gemini_launch_refuses_to_start_without_a_real_token(token: str | None, says: str
                                                              ) -> None:
    proc = _launch_cli(token)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and "GEMINI_LAUNCHER_INSECURE_LOCAL" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_local_run_may_opt_in_to_an_open_api_on_loopback() -> None:
    proc = _launch_cli(None, "--insecure-local", "--exit-on-failure")
    assert proc.returncode == 0, proc.stderr  # `true` ran and succeeded


def test_the_opt_in_is_refused_off_loopback() -> None:
    config = LauncherConfig(command=SLEEP, host="0.0.0.0", port=0, insecure_local=True)
    with pytest.raises(LauncherConfigError, match=r"only on a loopback address, not 0\.0\.0\.0"):
        Launcher(config)


def test_the_opt_in_is_read_from_the_environment() -> None:
    env = {"GEMINI_LAUNCHER_INSECURE_LOCAL": "1"}
    assert LauncherConfig.from_env(["x"], env).insecure_local
    assert not LauncherConfig.from_env(["x"], {}).insecure_local


@pytest.fixture()
def launcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[Launcher]:
    monkeypatch.setattr(launcher_module, "REQUEST_TIMEOUT_S", 1.0)
    running = Launcher(LauncherConfig(command=SLEEP, port=0, token=TOKEN, hold=True))
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    yield running
    running.stop()
    running.finish()
    thread.join(10)


def _closed_after(sock: socket.socket, trickle: bytes) -> float:
    """Send `trickle` a byte every 0.2 s (never finishing the headers) until the server
    closes the connection; the seconds that took."""
    began = time.monotonic()
    sock.settimeout(0.2)
    for byte in trickle * 100:
        try:
            if sock.recv(1024) == b"":
                return time.monotonic() - began
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - began
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - began
    raise AssertionError("the server kept the unfinished request open")


def test_an_unfinished_request_is_closed_at_the_header_timeout(launcher: Launcher) -> None:
    with socket.create_connection(("127.0.0.1", launcher.port)) as sock:
        sock.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n")
        took = _closed_after(sock, b"X-Slow: y")  # a byte at a time: each read is quick
    assert 0.8 <= took <= 4.0, took


def test_a_silent_connection_is_closed_at_the_header_timeout(launcher: Launcher) -> None:
    with socket.create_connection(("127.0.0.1", launcher.port)) as sock:
        sock.settimeout(5)
        began = time.monotonic()
        assert sock.recv(1024) == b""
    assert 0.8 <= time.monotonic() - began <= 4.0


def test_whole_requests_are_still_answered(launcher: Launcher) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{launcher.port}/status",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200
    assert launcher_module.REQUEST_TIMEOUT_S == 1.0  # the fixture's, restored afterwards
