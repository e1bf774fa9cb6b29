"""Starting training and executing recoveries: the steps that talk to launchers and sidecars.

Level-based: every step of a recovery is written to status.recovery (epoch, phase, plan)
before it is acted on, and every action is idempotent (a launcher ignores an epoch it already
runs; a fetch or restore of the same version again is harmless; a pod that exists is not
created twice), so an operator restarted in the middle repeats the current phase and goes on.

Phases: Planning (read every live sidecar's inventory, plan with gemini.domain.recovery)
-> Replacing (lost ranks only: force-delete their pods, create replacements, wait until they
run) -> Fetching (replacements pull their shard and replicas from peers; or, for an S3 plan,
every sidecar restores the committed step) -> Restarting (every launcher starts the new epoch
with the plan's version and the epoch's rendezvous: rank 0's pod IP, a fresh port) -> done.
A phase that must wait (a pod not yet running, a launcher restarting) asks to be called again.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gemini.domain.placement import Placement
from gemini.domain.recovery import (
    MODE_MEMORY,
    MODE_S3,
    FailureKind,
    RecoveryPlan,
    ShardCopy,
    plan_recovery,
)
from gemini_operator import naming, render
from gemini_operator.apitime import api_time
from gemini_operator.cache import Snapshot
from gemini_operator.conditions import Condition
from gemini_operator.failures import describe
from gemini_operator.kube import KubeClient
from gemini_operator.observed import PodView, pod_view
from gemini_operator.poller import complete_in_memory
from gemini_operator.reconcile import JobView, ReconcileConfig, Recover
from gemini_operator.sidecars import (
    INVENTORY_TIMEOUT_SECONDS,
    SidecarError,
    call_all,
    call_each,
    persist_and_commit,
)
from gemini_operator.spares import prefer_nodes, spare_nodes
from gemini_operator.spec import Persistence, parse_spec
from gemini_operator.status import JobStatus

log = logging.getLogger(__name__)
PORT_WINDOW = 1000  # the rendezvous port of epoch e is base + e % PORT_WINDOW
WAIT_SECONDS = 0.25
S3_RETRY_SECONDS = 10.0
RESUME = "resume"  # status.recovery.kind and lastRecovery.cause of a resume after suspend
SUSPEND_PERSIST_SECONDS = 120.0  # how long a suspend waits for the upload before deleting


class RecoveryWait(Exception):
    """A phase must wait for the cluster (a pod starting, a launcher restarting)."""


class S3Unreadable(Exception):
    """The job's S3 prefix cannot be listed now (endpoint down, credentials refused)."""


class Unrecoverable(Exception):
    """No consistent step is left anywhere (memory or S3); the message says what is missing."""


@dataclass
class Outcome:
    """What a step leaves for the reconciler: status fields to set (None removes one),
    when to call again, and the events to send."""

    status: dict[str, Any] = field(default_factory=dict)
    requeue_after: float | None = None
    events: list[tuple[str, str, bool]] = field(default_factory=list)
    finished: Mapping[str, Any] | None = None  # the lastRecovery document when one finished
    unrecoverable: tuple[str, str] | None = None  # (cause, why): the job fails
    conditions: list[Condition] = field(default_factory=list)  # set on top of the decided


def rendezvous(
    pods: Mapping[int, PodView], epoch: int, config: render.RenderConfig, job_uid: str = "",
) -> dict[str, str]:
    """This epoch's rendezvous: rank 0's pod IP and a port not used by the previous epochs."""
    port = str(rendezvous_port(epoch, config, job_uid))
    return {"MASTER_ADDR": pods[0].ip, "MASTER_PORT": port,
            "PET_MASTER_ADDR": pods[0].ip, "PET_MASTER_PORT": port}


def rendezvous_port(epoch: int, config: render.RenderConfig, job_uid: str = "") -> int:
    """base + (job offset + epoch) % 1000: a fresh port per epoch (a restarted rank 0 never
    meets its own TIME_WAIT), and jobs that share a network namespace (pods run as host
    processes, as on the local cluster) start at different offsets."""
    offset = zlib.crc32(job_uid.encode()) if job_uid else 0
    return config.rendezvous_port + (offset + epoch) % PORT_WINDOW


def launch_document(
    epoch: int, attempt: int, pods: Mapping[int, PodView], config: render.RenderConfig,
    job_uid: str = "",
) -> dict[str, Any]:
    """status.launch: the epoch and each rank's trainer restarts now (later ones are failures)."""
    return {
        "epoch": epoch,
        "restartAttempt": attempt,
        "masterAddr": pods[0].ip,
        "masterPort": rendezvous_port(epoch, config, job_uid),
        "trainerRestarts": {str(r): p.trainer_restarts for r, p in sorted(pods.items())},
        "podUIDs": {str(r): p.uid for r, p in sorted(pods.items())},
    }


def inventory_copies(inventories: Mapping[int, Mapping[str, Any]]) -> list[ShardCopy]:
    """Every shard copy the sidecars report (own shard in shm and replicas held for peers)."""
    copies = []
    for holder, doc in sorted(inventories.items()):
        for entry in [*(doc.get("local") or ()), *(doc.get("replicas") or ())]:
            copies.append(ShardCopy(
                rank=int(entry["rank"]), version=int(entry["version"]), holder=holder,
                complete=bool(entry.get("complete")), checksum=str(entry.get("checksum", "")),
            ))
    return copies


def plan_document(plan: RecoveryPlan, newest_seen: int | None) -> dict[str, Any]:
    """status.recovery.plan: what every rank restores from where (JSON-ready)."""
    return {
        "version": plan.version,
        "mode": plan.mode,
        "reason": plan.reason,
        "replaceRanks": list(plan.replace_ranks),
        "sources": {str(r): {"kind": s.kind, "holder": s.holder}
                    for r, s in sorted(plan.sources.items())},
        "refetch": {str(r): list(h) for r, h in sorted(plan.refetch.items())},
        "newestSeen": newest_seen,
    }


def resuming(status: JobStatus) -> bool:
    """Whether training ran in an earlier attempt (before a suspend) and not yet in this one,
    or a resume is under way."""
    launch = status.launch or {}
    return (status.recovery or {}).get("kind") == RESUME or (
        bool(launch) and int(launch.get("restartAttempt", -1)) != status.restart_attempt)


def source_word(plan: Mapping[str, Any]) -> str:
    """lastRecovery.source: S3, Peers (some rank loaded from a peer) or Local."""
    if plan.get("mode") == MODE_S3:
        return "S3"
    kinds = {s.get("kind") for s in (plan.get("sources") or {}).values()}
    return "Peers" if "peer" in kinds else "Local"


class RecoveryExecutor:
    def __init__(
        self, kube: KubeClient, config: ReconcileConfig,
        write_status: Callable[[JobView, Mapping[str, Any]], None],
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        s3_steps: Callable[[JobView], Sequence[int]] | None = None,
    ) -> None:
        self.kube, self.config = kube, config
        self._write = write_status
        self._clock = clock
        self._s3_steps = s3_steps or self._committed_steps

    # --- the first start ------------------------------------------------------------------

    def start_training(self, job: JobView, snap: Snapshot, status: JobStatus) -> Outcome:
        if resuming(status):
            return self._resume(job, snap, status)
        return self._start(job, snap, status)

    def _start(self, job: JobView, snap: Snapshot, status: JobStatus,
               note: tuple[str, str, bool] | None = None) -> Outcome:
        pods = self._current(snap, status)
        token = self._token(job)
        epoch = int((status.launch or {}).get("epoch", 0)) + 1
        body = {"epoch": epoch, "version": None, "source": "local",
                "env": rendezvous(pods, epoch, self.config.render, job.uid)}
        try:
            call_all(self._launchers(pods), "/restart", token, dict.fromkeys(pods, body))
        except SidecarError as err:
            log.info("launchers of %s/%s not ready yet: %s", job.namespace, job.name, err)
            return Outcome(requeue_after=WAIT_SECONDS)
        fresh = self._fresh_pods(job, status)
        return Outcome(
            status={"launch": launch_document(epoch, status.restart_attempt, fresh,
                                              self.config.render, job.uid)},
            events=[("TrainingStarted", f"started training epoch {epoch} on {len(pods)} "
                     f"workers (rendezvous {pods[0].ip}:"
                     f"{rendezvous_port(epoch, self.config.render, job.uid)})", False),
                    *([note] if note else [])],
        )

    # --- resume after suspend and the checkpoint taken before suspending -------------------

    def _resume(self, job: JobView, snap: Snapshot, status: JobStatus) -> Outcome:
        """Training ran before the job was suspended, and the pods took their memory with
        them: every sidecar restores the newest step committed to S3, then the launchers
        start from it. Recorded in status.recovery (kind resume) like a recovery, so a
        restarted operator goes on; with nothing committed, training starts over (and an
        event says why)."""
        rec = dict(status.recovery or {})
        launch = status.launch or {}
        if rec.get("kind") != RESUME or int(rec.get("epoch", 0)) <= int(launch.get("epoch", 0)):
            try:
                steps = list(self._s3_steps(job))
            except S3Unreadable as err:  # starting over would throw the saved steps away
                return Outcome(requeue_after=S3_RETRY_SECONDS, events=[(
                    "ResumeWaitingForS3", f"cannot list the committed steps to resume from; "
                    f"retrying in {S3_RETRY_SECONDS:.0f}s: {err}", True)])
            if not steps:
                why = ("persistence is not configured" if self._persistence(job) is None
                       else "S3 lists no committed step")
                return self._start(job, snap, status, (
                    "ResumedWithoutCheckpoint", f"resumed after the suspend from step 0: {why}",
                    True))
            rec = self._begin_resume(job, status, max(steps))
        try:
            if rec["phase"] == "Fetching":
                self._fetch(job, snap, status, rec)
                rec = self._step(job, rec, "Restarting")
            return self._restart(job, snap, status, rec)
        except SidecarError as err:
            log.info("resume of %s/%s waits for a sidecar: %s", job.namespace, job.name, err)
        except RecoveryWait as wait:
            log.info("resume of %s/%s waits: %s", job.namespace, job.name, wait)
        return Outcome(requeue_after=WAIT_SECONDS)

    def _begin_resume(self, job: JobView, status: JobStatus, version: int) -> dict[str, Any]:
        now = self._clock()
        pods = range(parse_spec(job.spec, self.config.default_sidecar_image).num_nodes)
        plan = {
            "version": version, "mode": MODE_S3,
            "reason": f"the job was resumed: step {version} is the newest committed to S3",
            "replaceRanks": [], "sources": {str(r): {"kind": "s3", "holder": None} for r in pods},
            "refetch": {}, "newestSeen": status.checkpoint.in_memory_step, "lostRanks": [],
        }
        rec = {
            "epoch": int((status.launch or {}).get("epoch", 0)) + 1,
            "phase": "Fetching", "kind": RESUME,
            "cause": "the job was suspended (its pods and their memory were deleted)",
            "failedRanks": [], "detectedAt": api_time(now), "startedAt": api_time(now),
            "startedUnix": time.time(), "marks": {"planning": 0.0, "replacing": 0.0},
            "plan": plan,
        }
        self._write(job, {"recovery": rec})  # recorded before anything is restored
        return rec

    def save_before_suspend(self, job: JobView, snap: Snapshot, status: JobStatus) -> Outcome:
        """Before the pods of a suspended job are deleted: persist and commit the newest step
        every rank holds complete in memory, so that resume loses nothing. Bounded (the pods
        are deleted afterwards whatever happened); events say what was kept and what lost."""
        pods = {r: p for r, p in self._current(snap, status).items()
                if p.ip and not p.deleting and not p.terminal}
        in_memory = status.checkpoint.in_memory_step
        persisted = status.checkpoint.persisted_step
        if self._persistence(job) is None:
            return Outcome(events=[("SuspendedWithoutCheckpoint", (
                f"persistence is not configured: the checkpoint in memory (step {in_memory}) "
                "goes with the pods and resume starts from step 0 (set spec.persistence to "
                "keep it)"), True)])
        kept = f"resume restores step {persisted}" if persisted is not None else (
            "resume starts from step 0")
        try:
            token = self._token(job)
            inventories = call_all(self._sidecars(pods), "/inventory", token, {},
                                   INVENTORY_TIMEOUT_SECONDS)
            # Every rank's shard, or the commit would name a step S3 does not fully hold.
            ranks = range(parse_spec(job.spec, self.config.default_sidecar_image).num_nodes)
            version = complete_in_memory(inventories, list(ranks))
            if version is None:
                return Outcome(events=[("SuspendCheckpointFailed", (
                    f"no step is complete in every rank's memory: {kept}"), True)])
            if persisted is not None and version <= persisted:
                return Outcome(events=[("SuspendCheckpointSaved", (
                    f"nothing newer than the committed step in memory: {kept}"), False)])
            persist_and_commit(self._sidecars(pods), token, version, SUSPEND_PERSIST_SECONDS)
        except (SidecarError, RuntimeError) as err:
            return Outcome(events=[("SuspendCheckpointFailed", (
                f"could not persist the checkpoint in memory (step {in_memory}) before "
                f"deleting the pods: {err}; {kept}")[:1024], True)])
        checkpoint = {**status.checkpoint.to_dict(), "persistedStep": version,
                      "persistedTime": api_time(self._clock())}
        checkpoint.pop("persistError", None)
        return Outcome(status={"checkpoint": checkpoint}, events=[(
            "SuspendCheckpointSaved", f"persisted and committed step {version} before deleting "
            "the pods: resume restores it", False)])

    # --- recovery ---------------------------------------------------------------------------

    def recover(self, job: JobView, snap: Snapshot, action: Recover, status: JobStatus) -> Outcome:
        rec = dict(status.recovery or {})
        launch = status.launch or {}
        if not rec or int(rec.get("epoch", 0)) <= int(launch.get("epoch", 0)):
            rec = self._begin(job, action, launch)
        elif newly_lost(action, rec):
            # A node went NotReady after the recovery was planned (a peer's crash is often
            # seen first): plan again with the lost ranks, keeping the epoch and start time.
            rec = self._begin(job, action, launch, rec)
        try:
            if rec["phase"] == "Planning":
                rec = self._step(job, rec, "Replacing", plan=self._plan(job, snap, status, rec))
            if rec["phase"] == "Replacing":
                self._replace(job, snap, status, rec)
                if not status.launch:  # never started: the start protocol takes it from here
                    return self._finish(job, status, rec, self._fresh_pods(job, status))
                rec = self._step(job, rec, "Fetching")
            if rec["phase"] == "Fetching":
                self._fetch(job, snap, status, rec)
                rec = self._step(job, rec, "Restarting")
            if rec["phase"] == "Restarting":
                return self._restart(job, snap, status, rec)
        except SidecarError as err:  # a sidecar restarting or cut off: try again shortly
            log.info("recovery of %s/%s waits for a sidecar: %s", job.namespace, job.name, err)
            return Outcome(requeue_after=WAIT_SECONDS)
        except RecoveryWait as wait:
            log.info("recovery of %s/%s waits: %s", job.namespace, job.name, wait)
            return Outcome(requeue_after=WAIT_SECONDS)
        except Unrecoverable as err:
            return Outcome(status={"recovery": None},
                           unrecoverable=(str(rec.get("cause", "a failure")), str(err)))
        raise RuntimeError(f"unknown recovery phase {rec.get('phase')!r} in status.recovery")

    def _begin(self, job: JobView, action: Recover, launch: Mapping[str, Any],
               previous: Mapping[str, Any] | None = None) -> dict[str, Any]:
        now = self._clock()
        before = previous or {}
        failed = sorted({f.rank for f in action.failures} | set(before.get("failedRanks", ())))
        lost = sorted({f.rank for f in action.failures if f.kind is FailureKind.HARDWARE}
                      | set((before.get("plan") or {}).get("lostRanks", ())))
        kind = action.kind.value if not previous or lost else str(before.get("kind"))
        rec = {
            "epoch": int(before.get("epoch", int(launch.get("epoch", 0)) + 1)),
            "phase": "Planning",
            "kind": FailureKind.HARDWARE.value if lost else kind,
            "cause": describe(action.failures) or str(before.get("cause", "a failure")),
            "failedRanks": failed,
            "detectedAt": before.get("detectedAt", api_time(now)),
            "startedAt": before.get("startedAt", api_time(now)),
            "startedUnix": float(before.get("startedUnix", time.time())),
            "marks": {},  # cumulative seconds at the end of each phase (a re-plan restarts them)
            "plan": {"lostRanks": lost},
        }
        self._write(job, {"recovery": rec})  # recorded before anything is done about it
        return rec

    def _step(self, job: JobView, rec: Mapping[str, Any], phase: str,
              plan: Mapping[str, Any] | None = None) -> dict[str, Any]:
        marks = {**(rec.get("marks") or {}),
                 str(rec["phase"]).lower(): round(time.time() - float(rec["startedUnix"]), 3)}
        new = {**rec, "phase": phase, "marks": marks}
        if plan is not None:
            new["plan"] = plan
        self._write(job, {"recovery": new})
        return new

    def _plan(self, job: JobView, snap: Snapshot, status: JobStatus,
              rec: Mapping[str, Any]) -> dict[str, Any]:
        lost = set(int(r) for r in (rec.get("plan") or {}).get("lostRanks", ()))
        if status.placement is None or not status.launch:
            # Training never started: nothing to restore, only pods to replace.
            return {"version": None, "mode": "fresh", "reason": "training had not started",
                    "replaceRanks": sorted(lost), "sources": {}, "refetch": {},
                    "newestSeen": None, "lostRanks": sorted(lost)}
        placement = Placement.from_dict(status.placement)
        pods = self._fresh_pods(job, status)
        live = {r: p for r, p in pods.items() if r not in lost and p.ip and not p.deleting}
        # A sidecar that does not answer holds nothing we can count on (its node may be cut
        # off): plan without its copies rather than wait for it.
        inventories, silent = call_each(self._sidecars(live), "/inventory", self._token(job), {},
                                        INVENTORY_TIMEOUT_SECONDS)
        if silent:
            log.warning("planning without %d silent sidecars: %s", len(silent), silent[:3])
        copies = inventory_copies(inventories)
        try:
            s3_steps = list(self._s3_steps(job))
        except S3Unreadable as err:  # memory may still suffice: plan with it alone
            log.warning("planning %s/%s without S3: %s", job.namespace, job.name, err)
            s3_steps = []
        newest = max((c.version for c in copies), default=None)
        if not copies and not s3_steps and status.checkpoint.in_memory_step is None:
            # Nothing was ever checkpointed: training starts over (deterministic, same steps).
            return {"version": None, "mode": "fresh", "reason": "no checkpoint was taken yet",
                    "replaceRanks": sorted(lost), "sources": {}, "refetch": {},
                    "newestSeen": None, "lostRanks": sorted(lost)}
        plan = plan_recovery(placement.replicas, placement, rec.get("failedRanks", ()), lost,
                             copies, s3_steps)
        if not plan.recoverable:
            raise Unrecoverable(plan.reason)
        return {**plan_document(plan, newest), "lostRanks": sorted(lost)}

    def _replace(self, job: JobView, snap: Snapshot, status: JobStatus,
                 rec: Mapping[str, Any]) -> None:
        replace = [int(r) for r in (rec.get("plan") or {}).get("replaceRanks", ())]
        if not replace:
            return
        # Read from the API, not the watch cache: a missed DELETED event must not leave the
        # recovery waiting for a pod that is long gone.
        views = (pod_view(o) for o in self.kube.list_worker_pods(job.namespace, job.name,
                                                                 replace))
        pods = {v.rank: v for v in views if v is not None and v.owner_uid == job.uid}
        old_uids = set((status.launch or {}).get("podUIDs", {}).get(str(r)) for r in replace)
        waiting = []
        spec = parse_spec(job.spec, self.config.default_sidecar_image)
        down = sorted(n for n, node in snap.nodes.items() if not node.ready)
        for rank in replace:
            pod = pods.get(rank)
            if pod is not None and pod.uid not in old_uids and pod.node_name in down:
                # The scheduler placed the replacement before the node was marked lost.
                self.kube.delete_pod(job.namespace, pod.name, grace_seconds=0)
                waiting.append(f"rank {rank}: replacement landed on lost node {pod.node_name}")
            elif pod is not None and pod.uid in old_uids:
                # The lost pod: gone for good (its node may never answer), free the name now.
                self.kube.delete_pod(job.namespace, pod.name, grace_seconds=0)
                waiting.append(f"rank {rank}: the lost pod is being removed")
            elif pod is None:
                manifest = render.worker_pod(job.ref, spec, rank, status.restart_attempt,
                                             self.config.render)
                # Spares first: off lost nodes, towards a node a placeholder holds (when none
                # is free, the scheduler preempts a placeholder: it has the lowest priority).
                self.kube.create(prefer_nodes(_avoid_nodes(manifest, down),
                                              spare_nodes(snap.spares, snap.nodes)))
                waiting.append(f"rank {rank}: replacement created")
            elif pod.phase != "Running" or not pod.ip:
                waiting.append(f"rank {rank}: replacement is {pod.phase}")
        if waiting:
            raise RecoveryWait("; ".join(waiting))

    def _fetch(self, job: JobView, snap: Snapshot, status: JobStatus,
               rec: Mapping[str, Any]) -> None:
        plan = rec.get("plan") or {}
        pods = self._running_pods(job, status)
        token = self._token(job)
        if plan.get("mode") == MODE_S3:
            body = {"version": plan["version"]}
            call_all(self._sidecars(pods), "/restore", token, dict.fromkeys(pods, body),
                     timeout=120)
            return
        if plan.get("mode") != MODE_MEMORY:
            return
        replace = {int(r) for r in plan.get("replaceRanks", ())}
        if replace and status.placement is not None:
            self._deliver_placement(job, pods, status, token)
        peers = {int(r): s for r, s in (plan.get("sources") or {}).items()
                 if s.get("kind") == "peer"}
        if peers:
            bodies = {r: {"rank": r, "version": plan["version"], "holders": [s["holder"]],
                          "into": "shm"} for r, s in peers.items()}
            call_all(self._sidecars({r: pods[r] for r in peers}), "/fetch", token, bodies,
                     timeout=120)
        refetch = {int(r): h for r, h in (plan.get("refetch") or {}).items()}
        if refetch:
            # The version restored, not the newest: survivors may hold newer ones of the
            # abandoned run, and the replacement's replicas must match what everyone restores.
            bodies = {r: {"holders": {}, "version": plan["version"]} for r in refetch}
            call_all(self._sidecars({r: pods[r] for r in refetch}), "/fetch-replicas", token,
                     bodies, timeout=120)

    def _deliver_placement(self, job: JobView, pods: Mapping[int, PodView], status: JobStatus,
                           token: str) -> None:
        from gemini_operator.sidecars import SidecarAddress, deliver_placement

        ports = self.config.render
        addresses = {r: SidecarAddress(r, p.ip, ports.sidecar_api_port, ports.sidecar_port)
                     for r, p in pods.items()}
        deliver_placement(status.placement or {}, addresses, token)

    def _restart(self, job: JobView, snap: Snapshot, status: JobStatus,
                 rec: Mapping[str, Any]) -> Outcome:
        plan = rec.get("plan") or {}
        pods = self._running_pods(job, status)
        epoch = int(rec["epoch"])
        token = self._token(job)
        body = {"epoch": epoch, "version": plan.get("version"),
                "source": "s3" if plan.get("mode") == MODE_S3 else "local",
                "env": rendezvous(pods, epoch, self.config.render, job.uid)}
        try:
            call_all(self._launchers(pods), "/restart", token, dict.fromkeys(pods, body))
        except SidecarError as err:
            raise RecoveryWait(f"a launcher is not reachable yet ({err})") from err
        # A launcher that died after taking the epoch restarts held (epoch 0): send it again.
        states = call_all(self._launchers(pods), "/status", token, {})
        behind = sorted(r for r, s in states.items() if s.get("epoch") != epoch)
        if behind:
            raise RecoveryWait(f"ranks {behind} are not running epoch {epoch} yet")
        return self._finish(job, status, rec, pods)

    def _finish(self, job: JobView, status: JobStatus, rec: Mapping[str, Any],
                pods: Mapping[int, PodView]) -> Outcome:
        plan = rec.get("plan") or {}
        duration = time.time() - float(rec["startedUnix"])
        marks = {**(rec.get("marks") or {}), "restarting": round(duration, 3)}
        version, newest = plan.get("version"), plan.get("newestSeen")
        lost_steps = max(0, int(newest) - int(version)) if (
            newest is not None and version is not None) else 0
        source = source_word(plan)
        last: dict[str, Any] = {
            "cause": str(rec.get("kind", "software")),
            "message": str(rec.get("cause", ""))[:4096],
            "source": source,
            "failedRanks": list(rec.get("failedRanks", ())),
            "stepsLost": lost_steps,
            "startTime": rec.get("startedAt"),
            "detectedAt": rec.get("detectedAt"),
            "completionTime": api_time(self._clock()),
            "durationSeconds": round(duration, 3),
            "durationMilliseconds": int(duration * 1000),
            "epoch": int(rec["epoch"]),
            "breakdown": _breakdown(marks),
        }
        if version is not None:
            last["restoredStep"] = int(version)
        new_status: dict[str, Any] = {"lastRecovery": last, "recovery": None}
        if status.launch:
            new_status["launch"] = launch_document(int(rec["epoch"]), status.restart_attempt,
                                                   pods, self.config.render, job.uid)
        if status.placement is not None and plan.get("replaceRanks"):
            new_status["placement"] = {**status.placement, "nodes": {
                str(r): p.node_name for r, p in sorted(pods.items())}}
        message = (f"recovered from {rec.get('cause')}: restored step {version} from "
                   f"{source.lower()} in {duration:.1f} s (epoch {rec['epoch']})")
        reason = "RecoveryFinished"
        if rec.get("kind") == RESUME:
            reason, message = "ResumedFromCheckpoint", (
                f"resumed after the suspend from step {version} committed to S3 "
                f"({lost_steps} newer steps were in memory only) in {duration:.1f} s "
                f"(epoch {rec['epoch']})")
        return Outcome(status=new_status, finished=last, events=[(reason, message, False)])

    # --- helpers ----------------------------------------------------------------------------

    def _committed_steps(self, job: JobView) -> list[int]:
        """The steps committed to the job's S3 prefix (none without persistence); raises
        S3Unreadable when the prefix cannot be listed."""
        from gemini_sidecar.config import S3Settings
        from gemini_sidecar.s3 import committed_steps, open_store

        persistence = self._persistence(job)
        if persistence is None:
            return []
        secret = persistence.credentials_secret

        def key(name: str) -> str | None:
            return self.kube.secret_value(job.namespace, secret, name) if secret else None

        settings = S3Settings(
            bucket=persistence.bucket, prefix=persistence.prefix or "gemini",
            endpoint_url=persistence.endpoint, region=key(naming.S3_REGION_KEY) or "us-east-1",
            access_key=key(naming.S3_ACCESS_KEY_KEY), secret_key=key(naming.S3_SECRET_KEY_KEY),
        )
        try:
            return committed_steps(open_store(settings), job.name)
        except Exception as err:  # boto3 raises many kinds
            raise S3Unreadable(f"s3://{persistence.bucket}/{persistence.prefix}: {err}") from err

    def _persistence(self, job: JobView) -> Persistence | None:
        return parse_spec(job.spec, self.config.default_sidecar_image).persistence

    def _current(self, snap: Snapshot, status: JobStatus) -> dict[int, PodView]:
        return {r: p for r, p in snap.pods.items() if p.attempt == status.restart_attempt}

    def _fresh_pods(self, job: JobView, status: JobStatus) -> dict[int, PodView]:
        views = (pod_view(o) for o in self.kube.list_worker_pods(job.namespace, job.name))
        return {v.rank: v for v in views if v is not None and v.owner_uid == job.uid
                and v.attempt == status.restart_attempt and not v.deleting}

    def _running_pods(self, job: JobView, status: JobStatus) -> dict[int, PodView]:
        """Every rank's pod as the API lists it now, running with an IP. The watch cache can
        lag behind a replacement (more so in an operator that just started and listed a lost
        pod): a fetch or restart sent to a lost pod's address would wait for it forever."""
        pods = self._fresh_pods(job, status)
        ranks = range(parse_spec(job.spec, self.config.default_sidecar_image).num_nodes)
        waiting = [r for r in ranks if r not in pods or pods[r].phase != "Running"
                   or not pods[r].ip]
        if waiting:
            raise RecoveryWait(f"ranks {waiting} have no running pod yet")
        return pods

    def _token(self, job: JobView) -> str:
        token = self.kube.secret_value(job.namespace, naming.secret_name(job.name),
                                       naming.SECRET_TOKEN_KEY)
        if token is None:
            raise RuntimeError(f"the peer-auth Secret of {job.namespace}/{job.name} is missing")
        return token

    def _launchers(self, pods: Mapping[int, PodView]) -> dict[int, tuple[str, int]]:
        return {r: (p.ip, self.config.render.launcher_port) for r, p in pods.items()}

    def _sidecars(self, pods: Mapping[int, PodView]) -> dict[int, tuple[str, int]]:
        return {r: (p.ip, self.config.render.sidecar_api_port) for r, p in pods.items()}


def _avoid_nodes(manifest: dict[str, Any], nodes: Sequence[str]) -> dict[str, Any]:
    """The pod kept off `nodes` (lost ones the scheduler may not know about yet)."""
    if not nodes:
        return manifest
    # One value per field requirement (the API's rule); requirements of a term are ANDed.
    term = {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": [node]}
                            for node in nodes]}
    affinity = manifest["spec"].setdefault("affinity", {})
    affinity["nodeAffinity"] = {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
    return manifest


def newly_lost(action: Recover, rec: Mapping[str, Any]) -> bool:
    """Whether ranks are lost now that the recorded plan did not replace."""
    lost = {f.rank for f in action.failures if f.kind is FailureKind.HARDWARE}
    planned = set((rec.get("plan") or {}).get("lostRanks", ()))
    return bool(lost - planned)


def _breakdown(marks: Mapping[str, float]) -> dict[str, float]:
    """Seconds spent in each phase, from the cumulative marks."""
    order = ["planning", "replacing", "fetching", "restarting"]
    out, before = {}, 0.0
    for phase in order:
        if phase in marks:
            out[phase] = round(max(0.0, float(marks[phase]) - before), 3)
            before = float(marks[phase])
    return out
