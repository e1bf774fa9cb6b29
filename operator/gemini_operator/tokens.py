"""Each job's peer-auth token (the bearer token of its sidecars and launchers).

With a token key (GEMINI_OPERATOR_TOKEN_KEY; the Helm chart makes one and hands it to the
operator from a Secret of its own namespace), a job's token is HMAC-SHA256(key, namespace/name/
uid) in URL-safe base64: the operator writes it into the job's Secret once, for the pods, and
computes it whenever it calls them, so it never reads a Secret and its ClusterRole needs only
`create` on Secrets. A job re-created under the same name has another uid, so another token.

Without a key (an operator started by hand, the tests' in-process operator) the token is
random and read back from the job's Secret, which needs `get` on Secrets. Jobs created under
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

from gemini_operator import naming
from gemini_operator.kube import KubeClient
from gemini_operator.render import JobRef

KEY_ENV = "GEMINI_OPERATOR_TOKEN_KEY"
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

    def new(self, job: JobRef) -> str:
        """The token to write into a new job's Secret."""
        return self._derive(job) if self._key is not None else secrets.token_urlsafe(32)

    def of(self, job: JobRef) -> str | None:
        """The job's token; None when it is read back and the Secret is missing."""
        if self._key is not None:
            return self._derive(job)
        return self.kube.secret_value(job.namespace, naming.secret_name(job.name),
                                      naming.SECRET_TOKEN_KEY)

    def _derive(self, job: JobRef) -> str:
        assert self._key is not None
        digest = hmac.new(self._key, f"{job.namespace}/{job.name}/{job.uid}".encode(),
                          hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")
