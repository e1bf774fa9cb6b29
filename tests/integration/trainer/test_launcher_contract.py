"""A real launcher driven with gemini.control's client: typed status, restarts whose epochs
only grow (rule 6), refusals with the reason, and stop."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from gemini.control.client import ControlClient, ControlError
from gemini.control.launcher import RestartRequest, RestoreOrder
from gemini_trainer.launch_config import LauncherConfig
from gemini_trainer.launcher import Launcher

pytestmark = pytest.mark.integration
TOKEN = "job-secret-0123456789"


def test_the_launcher_answers_the_contracts_types() -> None:
    config = LauncherConfig(command=(sys.executable, "-c", "import time; time.sleep(120)"),
                            port=0, token=TOKEN, grace_s=2.0, hold=True)
    launcher = Launcher(config, env=dict(os.environ))
    thread = threading.Thread(target=launcher.run, daemon=True)
    thread.start()
    client = ControlClient("127.0.0.1", launcher.port, TOKEN, timeout=30)
    try:
        deadline = time.monotonic() + 10
        while launcher.status()["state"] != "held" and time.monotonic() < deadline:
            time.sleep(0.05)
        held = client.status()
        assert (held.state, held.epoch, held.pid, held.progress) == ("held", 0, None, None)

        answer = client.restart(RestartRequest(1, 7, "peer", {"MASTER_PORT": "29501"}))
        assert answer.result == "restarted"
        assert (answer.status.state, answer.status.epoch) == ("running", 1)
        assert answer.status.restore == RestoreOrder(7, "peer")
        assert client.restart(RestartRequest(1, 7, "peer")).result == "already"
        with pytest.raises(ControlError) as err:
            client.restart(RestartRequest(0))
        assert err.value.status == 409
        assert err.value.detail is not None and "not newer" in err.value.detail
        with pytest.raises(ControlError) as err:
            client.call_json("/restart", {"epoch": 2, "source": "tape"})
        assert err.value.status == 400
        assert err.value.detail == ("/restart body: 'source' must be one of local, peer, s3, "
                                    "got 'tape' (str)")
        assert client.status() == launcher.status_answer()

        stopped = client.stop()
        assert stopped.state == "stopped"
        thread.join(10)
        assert not thread.is_alive()
    finally:
        launcher.stop()
        launcher.finish()
        thread.join(10)
