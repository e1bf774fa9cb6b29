"""The trainer container's entrypoint: supervise the training process, restart it in place.

``gemini launch -- <command>`` runs the command as a child in its own process group and stays
up when it exits, so a restart costs a process start, not a pod (and the sidecar's memory
survives). The operator drives it over a small HTTP API:

The paths and bodies are gemini.control's (LauncherStatus, RestartRequest, RestartAnswer,
ErrorAnswer), where the ordering rules of restarts are stated too:

    GET  /status    -> {"state": "held"|"running"|"exited"|"stopped", "pid", "epoch", "restarts",
                        "exit_code", "exited_at", "started_at", "restore": {"version",
                        "source"}, "progress": {"step", "unix", "age_s"} | null}
    POST /restart   {"epoch": int, "version": int | "latest" | null, "source": "local"|"peer"|"s3",
                     "env": {"NAME": "value", ...} (optional: merged into the child's environment,
                     e.g. MASTER_ADDR/MASTER_PORT of this epoch's rendezvous)}
                    stops the current process (SIGTERM to its group, SIGKILL after the grace
                    period) and starts the command again with GEMINI_RESTART_EPOCH=epoch,
                    GEMINI_RESTORE_VERSION=version ("none" for null), GEMINI_RESTORE_SOURCE.
                    The epoch must grow: the same epoch again is a no-op (200, "already"), an
                    older one is refused (409), so a retried request cannot restart twice.
    POST /stop      stops the process; the launcher then exits with 0.
    GET  /metrics   Prometheus text (gemini_launcher_*: restarts, epoch, running, last exit
                    code, warm start, start-up seconds, heartbeat step and time; the
                    process's process_*); no token.
    GET  /healthz   {"status": "ok"} while the API answers; no token.

Every other request must be signed (gemini.control.signing: with the job token
GEMINI_AUTH_TOKEN, or by the operator; a bearer job token only from loopback); others get 401.
With GEMINI_CONTROL_PUBLIC_KEY (the operator renders it) the job's signature, which every pod of
the job can make, may only read (GET); restart and stop need the operator's. The launcher
refuses to start without a token of at least 16 characters, unless
GEMINI_LAUNCHER_INSECURE_LOCAL=1 (``--insecure-local``) asks for an open API on a loopback
address, for local runs without an operator. A request must arrive whole (headers and body)
within 10 s, or its connection is closed. It listens on GEMINI_LAUNCHER_HOST (default 127.0.0.1;
the pod IP so the operator can reach it) and GEMINI_LAUNCHER_PORT (default 7071; 0 picks a free
port, written to the status file).

The same status is written atomically to GEMINI_LAUNCHER_STATUS_FILE (if set) on every change.
Progress: the child gets GEMINI_HEARTBEAT_FILE; the trainer library writes "<step> <unix time>"
there after each committed snapshot, and ``progress.age_s`` tells hang detection how long ago
that was. When the child exits 0 the launcher exits 0 (training finished); a failure is
reported and the launcher waits for /restart (or exits with the child's code when
``exit_on_failure`` is set, so the container ends and the node restarts it).

In-process restarts (gemini_trainer.inprocess, gemini_trainer.resume_link; on unless
GEMINI_LAUNCHER_IN_PROCESS=0, one process per node): the child gets GEMINI_INPROCESS_SOCKET, a
Unix socket of the launcher's. A child run through ``gemini_trainer.run`` whose training fails
parks there, alive: ``state`` "parked", ``error`` its traceback's text. The next /restart sends
it the new epoch's environment instead of starting a process (``in_process`` counts these);
a child still running gets SIGUSR1 and GEMINI_LAUNCHER_PARK_GRACE_S (1 s) to park or to say it
is on its way (then GEMINI_LAUNCHER_PARK_UNWIND_S, 8 s, to get there), else it is replaced (a
hung child cannot answer, so a hang still costs only the grace); one parked longer than
GEMINI_LAUNCHER_PARK_TIMEOUT_S (60 s) is ended. Without
``exit_on_failure`` the launcher also outlives a child (or local group) that dies, relaying its
output and keeping the last lines. Either failure is written beside the heartbeat
(``<heartbeat>.parked``: epoch, error or last lines, exit code), where the sidecar's
/inventory reads it for the operator: no container restart (and no kubelet back-off) is needed
to show it. With GEMINI_OPERATOR_HINT_URL (the operator renders it when it serves hints) the
launcher also tells the operator at once (gemini_trainer.failure_hint), which then polls the
job without waiting for its next round.

Hold mode (GEMINI_LAUNCHER_HOLD=1): the command is not started until the first POST /restart,
so the operator can hand every rank the rendezvous address of this epoch (rank 0's pod IP
changes when rank 0 is replaced; there is no cluster DNS to hide that). The child dies with
the launcher (parent-death signal): a killed trainer container leaves no orphaned training.

Several processes per node (GEMINI_NUM_PROC_PER_NODE > 1, as the operator renders
numProcPerNode): the launcher starts that many copies of the command, each with the torchrun
environment of its rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK; MASTER_ADDR
and MASTER_PORT as for one), and supervises them as one (gemini_trainer.local_group): the first
to fail stops the others, a restart restarts all. The command is the training script itself,
not torchrun. A warm standby (below) then means one per local rank.

Warm standby (gemini_trainer.standby; opt-in, GEMINI_LAUNCHER_STANDBY=1): for a ``python ...``
command the launcher keeps one pre-started interpreter per local rank that has imported
torch/DeepSpeed (GEMINI_LAUNCHER_PREIMPORT) and starts the next run in it, skipping the
imports; one extra interpreter per rank in memory. A rank whose standby is not usable is
spawned normally (the others still start warm). ``status.warm`` tells whether the current
process (every one of a local group) started from one, ``status.standby`` ({"pid" of the
first, "ready": all ready} or null) about the next. Without the option a held launcher still
warms the interpreters its first run starts in, and a launcher whose processes died warms
the next ones at once (GEMINI_LAUNCHER_HOLD_STANDBY, default on): the imports of a new or
replacement pod, or of a crashed rank, overlap the operator's detection, planning and
fetching, at no extra memory (no training process runs meanwhile).

The parts: gemini_trainer.supervisor (the process, its restarts and parks),
gemini_trainer.launch_state (its states), gemini_trainer.launch_processes (starting, relaying,
ending), gemini_trainer.standby_pool (the warm standbys), gemini_trainer.launcher_server (the
HTTP API), gemini_trainer.launch_config (the settings and the token check).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gemini.control import launcher
from gemini.serving.fds import raise_fd_limit
from gemini_trainer.launch_config import LauncherConfig, check_token
from gemini_trainer.launcher_server import LauncherServer
from gemini_trainer.supervisor import Supervisor


class Launcher:
    """``gemini launch``: the supervisor behind its HTTP API. Construction checks the token
    (LauncherConfigError) and binds the API's address (OSError when it is taken)."""

    def __init__(self, config: LauncherConfig, env: Mapping[str, str] | None = None) -> None:
        if config.command:  # else the supervisor says how to name one
            check_token(config)
        self.supervisor = Supervisor(config, env)
        self._server = LauncherServer(self.supervisor, config)
        self.supervisor.port = self._server.port

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def heartbeat_file(self) -> Path:
        return self.supervisor.heartbeat_file

    @property
    def parked_file(self) -> Path:
        """Beside the heartbeat: the last failure the launcher outlived (gemini.control)."""
        return self.supervisor.parked_file

    def run(self) -> int:
        """Serve the API and supervise until /stop, a success, or a signal; the exit code."""
        raise_fd_limit()  # the training processes inherit it (data loaders like many)
        self._server.start()
        self.supervisor.supervise()
        self._server.close()
        return self.supervisor.close()

    def status(self) -> dict[str, Any]:
        return self.supervisor.status()

    def status_answer(self) -> launcher.LauncherStatus:
        return self.supervisor.status_answer()

    def stop(self) -> launcher.LauncherStatus:
        return self.supervisor.stop()

    def finish(self) -> None:
        self.supervisor.finish()
