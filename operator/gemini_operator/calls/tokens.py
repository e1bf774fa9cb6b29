"""Each job's tokens: the job token (peer auth; every pod holds it) and the operator's
control token (the only one that may drive a pod's sidecar and launcher beyond reads and
the trainer's own calls: the operator signs with a key derived from it, and the pods hold only
its public key, gemini.control.signing; neither token crosses the network).

With a token key (GEMINI_OPERATOR_TOKEN_KEY; the Helm chart makes one and hands it to the
operator from a Secret of its own namespace), a job's token is HMAC-SHA256(key, namespace/name/
uid) in URL-safe base64: the operator writes it into the job's Secret once, for the pods, and
computes it whenever it calls them, so it never reads a Secret and its ClusterRole needs only
`create` on Secrets. A job re-created under the same name has another uid, so another token.

The control token is derived the same way under another label. Without a key (an operator
started by hand, the tests' in-process operator) both are random: the job token is read back
from the job's Secret, the control token from a Secret of its own that no pod mounts; that
needs `get` on Secrets. Jobs created under
one scheme keep working only under it: switching a running operator to a key strands the older
jobs' tokens (docs/install.md).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from gemini.control.auth import Credentials
from gemini_operator.cluster.kube import KubeClient
from gemini_operator.core import children, naming
from gemini_operator.core.render import JobRef

KEY_ENV = "GEMINI_OPERATOR_TOKEN_KEY"
CONTROL_LABEL = "control\n"  # before namespace/name/uid: no job token is ever a control token
MIN_KEY_BYTES = 32


class TokenKeyError(ValueError):
    """The configured token key is unusable; the message says how to fix it."""


def load_key(env: Mapping[str, str] | None = None, path: str | None = None) -> bytes | None:
    """The key from a file (``path``) or GEMINI_OPERATOR_TOKEN_KEY; None when neither is set."""
    env = os.environ if env is None else env
    raw = Path(path).read_bytes().strip() if path else env.get(KEY_ENV, "").strip().encode()
    if not raw:
        return None
    if len(raw) < MIN_KEY_BYTES:
        raise TokenKeyError(f"the token key has {len(raw)} bytes; use at least {MIN_KEY_BYTES} "
                            "random ones (e.g. `openssl rand -base64 48`)")
    return raw


class JobTokens:
    """The token of a job: derived from the key, or random and read back (see above)."""

    def __init__(self, kube: KubeClient, key: bytes | None) -> None:
        self.kube, self._key = kube, key

    @property
    def derived(self) -> bool:
        return self._key is not None

    def new(self, job: JobRef) -> tuple[str, str]:
        """The (job token, control token) to write into a new job's Secrets."""
        if self._key is not None:
            return self._derive(job), self._derive(job, CONTROL_LABEL)
        return secrets.token_urlsafe(32), secrets.token_urlsafe(32)

    def keep_control(self, job: JobRef, control: str) -> str:
        """Random tokens: keep `control` in the job's control Secret, or return the one kept
        there already (an operator that stopped between the two Secrets)."""
        if self.kube.create(children.control_secret(job, control)):
            return control
        kept = self.kube.secret_value(job.namespace, naming.control_secret_name(job.name),
                                      naming.SECRET_TOKEN_KEY)
        return kept or control

    def of(self, job: JobRef) -> Credentials | None:
        """What the operator calls the job's pods with: the control token (the job token for
        a job made before control tokens, whose pods have no digest to check one against).
        None when a Secret it must read is missing."""
        token = self.job_token(job)
        if token is None:
            return None
        if self._key is not None:
            return Credentials(self._derive(job, CONTROL_LABEL))
        control = self.kube.secret_value(job.namespace, naming.control_secret_name(job.name),
                                         naming.SECRET_TOKEN_KEY)
        return Credentials(control or token)

    def job_token(self, job: JobRef) -> str | None:
        """The token every pod of the job holds (None: its Secret is missing)."""
        if self._key is not None:
            return self._derive(job)
        return self.kube.secret_value(job.namespace, naming.secret_name(job.name),
                                      naming.SECRET_TOKEN_KEY)

    def _derive(self, job: JobRef, label: str = "") -> str:
        assert self._key is not None
        digest = hmac.new(self._key, f"{label}{job.namespace}/{job.name}/{job.uid}".encode(),
                          hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")
