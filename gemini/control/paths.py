"""The control API between the operator, the checkpoint sidecar and the launcher: its paths,
and the ordering rules its servers require of their callers.

Both APIs are JSON over HTTP, every call signed by the operator or with the job token (only the
health and metrics paths are open; gemini.control.auth, gemini.control.signing). This module
names their paths; the body of every request and answer is a frozen dataclass with ``to_json``
and ``from_json`` (gemini.control.messages, .inventory, .transfers, .launcher), a refusal is the
error answer ``{"error": "<what to fix>"}`` with a 4xx/5xx status (messages.ErrorAnswer), and
the one client is gemini.control.client.ControlClient. The field names are the wire names;
``to_json`` writes the same JSON the hand-built dicts did before, so older and newer peers
understand each other. Reading is strict (gemini.control.strict).

Ordering rules (what the servers require of their callers, and why):

1. Placement first. A sidecar starts with the placement of its pod's environment (none for a
   replacement that has not been placed yet); ``POST /peers`` replaces it as a whole. It must
   have its placement before
   - ``POST /fetch`` names holders by rank (their addresses come from the placement; a
     ``"host:port"`` holder needs none) or fetches into its replica store (``into: "store"``:
     only a rank it holds), and before ``POST /fetch-replicas`` (it re-pulls exactly the ranks
     it holds): otherwise 400 "... POST /peers first";
   - the trainers start: the operator sends the first ``POST /restart`` only once every
     sidecar took its placement (condition PlacementDelivered), or the first snapshots are
     sent to nobody and peers refuse replicas of ranks they do not hold.
   A new placement drops the replicas of ranks no longer held. A sidecar whose container
   restarted comes back with its environment's placement: the operator compares
   ``GET /inventory``'s ``placement`` with the delivered one and posts it again.
2. Inventory before the plan. A recovery reads every live sidecar's ``GET /inventory`` and
   plans from it (and from S3's committed steps, which a sidecar lists: ``GET
   /committed-steps``; the operator holds no S3 credentials); the version named in ``/fetch``,
   ``/fetch-replicas``, ``/restore`` and ``/restart`` is the plan's, never "the newest":
   survivors may hold newer versions of the abandoned run.
3. Memory before the restart. Every shard to be restored must be complete in its rank's
   shared memory before its launcher gets ``POST /restart`` with that version: a
   replacement's own shard by ``POST /fetch`` (``into: "shm"``) from a peer, or every rank's
   by ``POST /restore`` from S3. A replacement's replicas of its peers come back with
   ``POST /fetch-replicas`` at the same version, after its placement (rule 1).
4. Persist, then commit. ``POST /persist`` of one version on every rank, and only when all
   succeeded ``POST /commit`` of that version on one of them (the lowest rank): the commit
   verifies every rank's object and writes the marker that makes the step visible.
   ``POST /restore`` restores committed steps of its own job only (the marker names the
   namespace, job, uid and world size; another's is refused).
5. Notify after the commit in shared memory. The trainer posts ``/v1/local/committed`` (or
   ``/notify``) for a version only after its slot is complete; the sidecar replicates it.
6. Launcher epochs only grow. ``POST /restart`` with a newer epoch restarts the training
   process; the same epoch again is a no-op answered ``"already"`` (a retry is safe); an
   older one is refused with 409. A held launcher (hold mode) runs nothing before its first
   ``/restart``. A launcher whose container restarted comes back held at its environment's
   epoch: after ``/restart``, ``GET /status`` tells which launchers run the new epoch, and
   the others are sent it again. ``POST /stop`` ends the launcher; nothing follows it.
7. Transfers run in the background. ``/fetch``, ``/fetch-replicas``, ``/persist`` and
   ``/restore`` start a transfer, or join the one already running for the same request (the
   same rank, version and target): a retry never starts a second copy. A request with
   ``wait_seconds`` is answered when the transfer ends or after that many seconds, whichever
   comes first; in the second case with 202 and a ``TransferRunning`` (bytes done of the
   total), and the caller asks again to join it. Without ``wait_seconds`` the answer waits
   for the end. A failed transfer is answered with its error once; the next request starts
   a new one.
"""

from __future__ import annotations

# -- paths of the sidecar's API --------------------------------------------------------------
HEALTHZ_PATH = "/healthz"  # GET, open: liveness
METRICS_PATH = "/metrics"  # GET, open: Prometheus text (the launcher's too)
INVENTORY_PATH = "/inventory"  # GET -> Inventory
NOTIFY_PATH = "/notify"  # POST NotifyRequest -> NotifyAnswer (202)
COMMITTED_PATH = "/v1/local/committed"  # the same call, the path the trainer library uses
PEERS_PATH = "/peers"  # POST Peers -> Peers (the placement now in force)
PROFILE_PATH = "/profile"  # POST ProfileRequest -> ProfileAnswer
FETCH_PATH = "/fetch"  # POST FetchRequest -> FetchAnswer
FETCH_REPLICAS_PATH = "/fetch-replicas"  # POST FetchReplicasRequest -> FetchReplicasAnswer
PERSIST_PATH = "/persist"  # POST PersistRequest -> PersistAnswer
COMMIT_PATH = "/commit"  # POST CommitRequest -> CommitAnswer
RESTORE_PATH = "/restore"  # POST RestoreRequest -> RestoreAnswer
COMMITTED_STEPS_PATH = "/committed-steps"  # GET -> CommittedStepsAnswer
INVENTORIES_PATH = "/inventories"  # POST InventoriesRequest -> InventoriesAnswer (a relay)
SIDECAR_OPEN_PATHS = frozenset({HEALTHZ_PATH, METRICS_PATH})
# What the trainer of the pod calls with the job token (reads go with it too; see
# gemini.control.verifier.admitted).
SIDECAR_TRAINER_PATHS = frozenset({NOTIFY_PATH, COMMITTED_PATH, PROFILE_PATH})

# -- paths of the launcher's API -------------------------------------------------------------
STATUS_PATH = "/status"  # GET -> LauncherStatus
RESTART_PATH = "/restart"  # POST RestartRequest -> RestartAnswer
STOP_PATH = "/stop"  # POST (any object) -> LauncherStatus; the launcher then exits
LAUNCHER_OPEN_PATHS = frozenset({HEALTHZ_PATH, METRICS_PATH})
# The operator's hint server (gemini_operator.calls.hints), called by launchers.
FAILURE_HINT_PATH = "/v1/hints/failure"  # POST FailureHint -> HintAnswer (202)
MAX_HINT_BYTES = 4096
