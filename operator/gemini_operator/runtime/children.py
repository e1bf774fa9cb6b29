"""The children a job owns besides its pods: its peer-auth Secret, its Service and its
NetworkPolicy. Each is looked for once per job and afterwards remembered (children are owned
and never edited), and created once when missing. One of the name that another owns (or no
one) is never adopted: the job fails naming it (`conflict`)."""

from __future__ import annotations

from gemini_operator.calls.tokens import JobTokens
from gemini_operator.cluster.cache import Snapshot
from gemini_operator.cluster.kube import KubeClient
from gemini_operator.core import children, naming
from gemini_operator.core.actions import CreateNetworkPolicy, CreateSecret, CreateService
from gemini_operator.core.types import JobView
from gemini_operator.runtime.status_writer import JobStatusWriter


class JobChildren:
    def __init__(self, kube: KubeClient, tokens: JobTokens) -> None:
        self.kube, self.tokens = kube, tokens
        self._known: set[tuple[str, str]] = set()  # (job uid, kind) known to exist
        self._conflicts: dict[str, str] = {}  # job uid -> the child of its name not its own

    def conflict(self, job: JobView) -> str | None:
        """A child's name taken by an object this job does not own, in words."""
        return self._conflicts.get(job.uid)

    def record_conflict(self, job: JobView, message: str) -> None:
        self._conflicts[job.uid] = message

    def has_service(self, job: JobView) -> bool:
        return self._exists(job, "Service", naming.service_name(job.name))

    def has_network_policy(self, job: JobView) -> bool:
        return self._exists(job, "NetworkPolicy", naming.network_policy_name(job.name))

    def has_secret(self, job: JobView) -> bool:
        """With derived tokens the operator may not read Secrets: it creates the job's once
        per run (an existing one is kept) instead of looking for it."""
        if self.tokens.derived:
            return (job.uid, "Secret") in self._known
        return self._exists(job, "Secret", naming.secret_name(job.name))

    # The action handlers (the reconciler's table): (status writer, job, snapshot, action).

    def create_secret(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                      action: CreateSecret) -> None:
        # Created once; a Secret that exists (another operator's, a restart) is kept as is.
        token, control = self.tokens.new(job.ref)
        if not self.tokens.derived:  # first, so the pods never hold a digest of nothing
            control = self.tokens.keep_control(job.ref, control)
        self.kube.create(children.peer_secret(job.ref, token, control))
        self._known.add((job.uid, "Secret"))

    def create_service(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                       action: CreateService) -> None:
        self.kube.create(action.manifest)
        self._known.add((job.uid, "Service"))

    def create_network_policy(self, writer: JobStatusWriter, job: JobView, snap: Snapshot,
                              action: CreateNetworkPolicy) -> None:
        self.kube.create(action.manifest)
        self._known.add((job.uid, "NetworkPolicy"))

    def _exists(self, job: JobView, kind: str, name: str) -> bool:
        if (job.uid, kind) in self._known:
            return True
        owners = self.kube.owners(kind, job.namespace, name)
        if owners is None:
            return False
        if job.uid not in owners:  # not created: the job fails naming it (decide)
            self.record_conflict(job, f"the {kind} {job.namespace}/{name} exists and is not "
                                 "this job's")
            return True
        self._known.add((job.uid, kind))
        return True
