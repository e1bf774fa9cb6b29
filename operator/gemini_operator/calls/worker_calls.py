"""The calls the training steps make to a job's workers and to what they need for them: the
job's token, its pods (from the watch cache or listed afresh), its launchers (the epoch's
rendezvous), its sidecars' inventories, and the steps committed to S3 (which its sidecars
list: the operator holds no S3 credentials)."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Mapping, Sequence

from gemini.control.auth import Bearer
from gemini.control.client import ControlError
from gemini.control.inventory import Inventory
from gemini.control.launcher import RestartRequest
from gemini.domain.recovery import ShardCopy
from gemini_operator.calls import sidecars
from gemini_operator.calls.sidecars import INVENTORY_TIMEOUT_SECONDS
from gemini_operator.calls.tokens import JobTokens
from gemini_operator.cluster.cache import Snapshot
from gemini_operator.cluster.kube import KubeClient
from gemini_operator.core import render
from gemini_operator.core.observed import PodView, pod_view
from gemini_operator.core.outcome import RecoveryWait, S3Unreadable
from gemini_operator.core.records import LaunchRecord
from gemini_operator.core.spec import Persistence
from gemini_operator.core.status import JobStatus
from gemini_operator.core.types import JobView

log = logging.getLogger(__name__)
PORT_WINDOW = 1000  # the rendezvous port of epoch e is base + e % PORT_WINDOW
# The steps committed to a job's S3 prefix (raises S3Unreadable); tests give their own.
CommittedSteps = Callable[[JobView, Persistence | None], Sequence[int]]
Targets = dict[int, tuple[str, int]]
LISTING_TRIES = 3  # sidecars asked side by side for the committed steps (one answer suffices)


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


def launch_record(
    epoch: int, attempt: int, pods: Mapping[int, PodView], config: render.RenderConfig,
    job_uid: str = "",
) -> LaunchRecord:
    """status.launch: the epoch and each rank's trainer restarts now (later ones are failures)."""
    return LaunchRecord(
        epoch=epoch, restart_attempt=attempt, master_addr=pods[0].ip,
        master_port=rendezvous_port(epoch, config, job_uid),
        trainer_restarts={r: p.trainer_restarts for r, p in pods.items()},
        pod_uids={r: p.uid for r, p in pods.items()},
    )


def inventory_copies(inventories: Mapping[int, Inventory]) -> list[ShardCopy]:
    """Every shard copy the sidecars report (own shard in shm and replicas held for peers)."""
    return [ShardCopy(rank=c.rank, version=c.version, holder=holder, complete=c.complete,
                      checksum=str(c.checksum))
            for holder, inventory in sorted(inventories.items()) for c in inventory.copies()]


class WorkerCalls:
    def __init__(self, kube: KubeClient, ports: render.RenderConfig, tokens: JobTokens,
                 committed_steps: CommittedSteps | None = None) -> None:
        self.kube, self.ports, self.tokens = kube, ports, tokens
        self.committed_steps: CommittedSteps = committed_steps or self._committed_steps

    def token(self, job: JobView) -> Bearer:
        token = self.tokens.of(job.ref)
        if token is None:
            raise RuntimeError(f"the peer-auth Secret of {job.namespace}/{job.name} is missing")
        return token

    # --- pods -------------------------------------------------------------------------------

    @staticmethod
    def cached(snap: Snapshot, attempt: int) -> dict[int, PodView]:
        """The pods of `attempt` as the watch cache has them."""
        return {r: p for r, p in snap.pods.items() if p.attempt == attempt}

    def listed(self, job: JobView, attempt: int) -> dict[int, PodView]:
        """The job's own pods of `attempt` as the API lists them now, none being deleted."""
        views = (pod_view(o) for o in self.kube.list_worker_pods(job.namespace, job.name))
        return {v.rank: v for v in views if v is not None and v.owner_uid == job.uid
                and v.attempt == attempt and not v.deleting}

    def running(self, job: JobView, attempt: int, num_nodes: int) -> dict[int, PodView]:
        """Every rank's pod as the API lists it now, running with an IP. The watch cache can
        lag behind a replacement (more so in an operator that just started and listed a lost
        pod): a fetch or restart sent to a lost pod's address would wait for it forever."""
        pods = self.listed(job, attempt)
        waiting = [r for r in range(num_nodes) if r not in pods or pods[r].phase != "Running"
                   or not pods[r].ip]
        if waiting:
            raise RecoveryWait(f"ranks {waiting} have no running pod yet")
        return pods

    # --- launchers and sidecars -------------------------------------------------------------

    def launchers(self, pods: Mapping[int, PodView]) -> Targets:
        return {r: (p.ip, self.ports.launcher_port) for r, p in pods.items()}

    def sidecars(self, pods: Mapping[int, PodView]) -> Targets:
        return {r: (p.ip, self.ports.sidecar_api_port) for r, p in pods.items()}

    def restart_launchers(self, job: JobView, pods: Mapping[int, PodView], token: Bearer,
                          epoch: int, version: int | None, source: str) -> None:
        """Every launcher starts `epoch` from `version` with the epoch's rendezvous (raises
        SidecarError when one does not take it)."""
        env = rendezvous(pods, epoch, self.ports, job.uid)
        sidecars.restart(self.launchers(pods), token,
                         RestartRequest(epoch, version, source, env))

    def launcher_epochs(self, pods: Mapping[int, PodView], token: Bearer) -> dict[int, int]:
        """The epoch each launcher runs (raises SidecarError when one does not answer)."""
        states = sidecars.launcher_statuses(self.launchers(pods), token)
        return {r: s.epoch for r, s in states.items()}

    def inventories(self, pods: Mapping[int, PodView], token: Bearer
                    ) -> tuple[dict[int, Inventory], list[str]]:
        """The inventories that answer within INVENTORY_TIMEOUT_SECONDS (checked; batched for
        a large job, as the poller asks), and who did not."""
        return sidecars.inventories_each(self.sidecars(pods), token, INVENTORY_TIMEOUT_SECONDS)

    def all_inventories(self, pods: Mapping[int, PodView], token: Bearer
                        ) -> dict[int, Inventory]:
        """Every sidecar's inventory (raises SidecarError when one does not answer)."""
        return sidecars.inventories(self.sidecars(pods), token, INVENTORY_TIMEOUT_SECONDS)

    # --- S3 ---------------------------------------------------------------------------------

    def _committed_steps(self, job: JobView, persistence: Persistence | None) -> list[int]:
        """The steps the job committed to S3 (none without persistence), as one of its own
        sidecars lists them: the sidecars hold the job's S3 credentials, the operator never
        reads them. With no sidecar to ask (every pod lost, or sidecars older than the call),
        the step the job's status records as its newest committed one. Raises S3Unreadable
        when neither is known."""
        if persistence is None:
            return []
        targets = self._listing_sidecars(job)
        why = "no running pod"
        if targets:
            try:
                return sorted(sidecars.committed_steps(targets, self.token(job)))
            except ControlError as err:
                if not sidecars.lists_no_steps(err):  # a sidecar answered: S3 refused it
                    raise S3Unreadable(f"{persistence.uri}: {err.detail or err.reason}"
                                       ) from err
                why = str(err)
        recorded = _recorded_persisted_step(job)
        if recorded is not None:
            log.info("no sidecar of %s/%s lists its S3 steps (%s); planning with step %d, "
                     "the newest its status records as committed", job.namespace, job.name,
                     why, recorded)
            return [recorded]
        raise S3Unreadable(f"{persistence.uri}: no sidecar of the job answers to list its "
                           f"committed steps ({why})")

    def _listing_sidecars(self, job: JobView) -> list[tuple[str, int]]:
        """The sidecars of the job's running pods to ask, the newest attempt's lowest ranks
        first (a few: any one of them can list the job's steps)."""
        views = (pod_view(o) for o in self.kube.list_worker_pods(job.namespace, job.name))
        running = sorted((v for v in views if v is not None and v.owner_uid == job.uid
                          and v.phase == "Running" and v.ip and not v.deleting),
                         key=lambda v: (-v.attempt, v.rank))
        return [(v.ip, self.ports.sidecar_api_port) for v in running[:LISTING_TRIES]]


def _recorded_persisted_step(job: JobView) -> int | None:
    """status.checkpoint.persistedStep: the newest step the operator saw this job commit."""
    step = JobStatus.from_dict(job.status).checkpoint.persisted_step
    return step if isinstance(step, int) and not isinstance(step, bool) else None
