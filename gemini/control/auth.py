"""Who may call the control APIs of a pod (its sidecar's and its launcher's), and what the
operator calls them with. Requests are signed (gemini.control.signing): no token crosses
the network.

- The operator signs with its per-job key (``Gemini-Operator``): any call. A pod holds only
  the public key (GEMINI_CONTROL_PUBLIC_KEY).
- The job token signs (``Gemini-Job``, HMAC): only the calls for which `job_token_allowed`
  (reads, and the trainer's own calls to its sidecar), so one pod cannot drive another's
  sidecar or launcher. A pod without the operator's public key (started by hand, or by an
  operator from before signatures) lets the job token make every call.
- ``Authorization: Bearer <job token>`` is still taken, as the job token, from loopback only:
  a trainer library older than signatures calling its own sidecar inside the pod, where no
  network carries it."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gemini.control.signing import Signer

CALL_REFUSED = ("sign the request with the job token (reads, the trainer's calls) or as the "
                "operator (the rest); gemini.control.signing")


@dataclass(frozen=True)
class Credentials:
    """What the operator calls one job's pods with: its control token, from which its signing
    key is derived. Never another token after a refusal: a pod that refuses the operator's
    signature is not sent the job token to try (it could be anyone's)."""

    token: str

    @functools.cached_property
    def signer(self) -> Signer:
        """Derived once per Credentials: one call's clients (a rank each) share it."""
        return Signer.operator(self.token)


Bearer = str | Credentials  # what a ControlClient is given: a job token, or Credentials


def signer_of(token: Bearer) -> Signer | None:
    """How a client signs: as the operator (Credentials), as the job (a job token), or not at
    all (no token: the open paths only)."""
    if isinstance(token, Credentials):
        return token.signer
    return Signer.job(token) if token else None
