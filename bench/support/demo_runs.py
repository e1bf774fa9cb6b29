"""One `gemini demo --output json` run as a child of a bench, torn down whatever happens.

Shared by the benches that measure recoveries end to end (recovery_downtime, headline): each
run gets a fresh state directory; a timeout or the bench's own SIGTERM/SIGINT is passed on to
the demo, whose teardown is waited for, then `gemini local down` and a sweep of processes
naming the state directory make sure nothing of the run is left.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gemini_local.processes import venv_tools_env
from support.cleanup import Cleanup, kill_processes_naming

REPO = Path(__file__).resolve().parents[2]
DEMO_TIMEOUT_S = 1200


def demo_report(demo_args: Sequence[str], cleanup: Cleanup, tmp_dir: str,
                extra_env: Mapping[str, str] | None = None,
                timeout: float = DEMO_TIMEOUT_S) -> dict[str, Any]:
    """The demo's JSON report for `gemini demo <demo_args>`; SystemExit when it gave none."""
    state = cleanup.cluster(Path(tempfile.mkdtemp(prefix="gbench-", dir=tmp_dir)))
    # the reference run and the pods use the same ninja and JIT folder (see venv_tools_env)
    env = venv_tools_env(sys.executable, os.environ)
    env.update(extra_env or {})
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        demo: subprocess.Popen[bytes] | None = None
        try:
            demo = cleanup.spawn(
                [sys.executable, "-m", "gemini_cli", "demo", *demo_args, "--state-dir",
                 str(state), "--output", "json"], cwd=REPO, stdout=out, stderr=err, env=env)
            try:
                demo.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                print(f"the demo did not finish within {timeout:.0f} s; stopping it",
                      file=sys.stderr, flush=True)
        finally:
            # Passes on this bench's SIGTERM/SIGINT (SIGTERM after the timeout) and waits for
            # the demo's own teardown; then makes sure nothing of its state dir runs.
            code = cleanup.stop_child(demo) if demo is not None else None
            if cleanup.received is not None:  # the demo's own word on its teardown
                err.seek(0)
                print(f"demo (exit {code}): " + (err.read().decode(errors="replace").strip()
                      .splitlines() or ["(no output)"])[-1], file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "-m", "gemini_cli", "local", "--state-dir",
                            str(state), "down"], cwd=REPO, capture_output=True, check=False)
            kill_processes_naming(state)  # the demo's operator, should it have outlived it
            shutil.rmtree(state, ignore_errors=True)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if not stdout.strip():
        raise SystemExit(f"the demo failed (exit {code}):\n{stderr[-4000:]}")
    report: dict[str, Any] = json.loads(stdout)
    return report
