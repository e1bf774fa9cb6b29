"""The launcher's settings (``gemini launch``'s flags and GEMINI_LAUNCHER_* variables; see
gemini_trainer.launcher) and the check that its API is not left open by accident."""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemini.control.signing import PublicKey, public_key_setting
from gemini_trainer import resume_link
from gemini_trainer import standby as warm
from gemini_trainer.failure_hint import FailureHints

log = logging.getLogger(__name__)

MIN_TOKEN_LENGTH = 16  # as the sidecar demands of the same per-job token


class LauncherConfigError(ValueError):
    """The launcher cannot start as configured; the message says what to set."""


@dataclass(frozen=True)
class LauncherConfig:
    command: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 7071
    token: str = field(default="", repr=False)
    # the key the operator signs with (GEMINI_CONTROL_PUBLIC_KEY): with it, the job token may
    # only read (/status)
    control_public_key: PublicKey | None = field(default=None, repr=False)
    status_file: Path | None = None
    heartbeat_file: Path | None = None  # default: a file in a private temp dir
    grace_s: float = 10.0
    exit_on_failure: bool = False
    hold: bool = False  # wait for the first POST /restart before starting the command
    standby: bool = False  # keep a warm standby interpreter for python commands
    # warm the next process while none runs (held, or after one died): it becomes the
    # training process, so no memory is added
    hold_standby: bool = True
    preimport: tuple[str, ...] = warm.DEFAULT_PREIMPORT  # what the standby imports
    insecure_local: bool = False  # allow no or a short token, on a loopback address only
    in_process: bool = True  # offer in-process restarts (gemini_trainer.run) to the child
    park_grace_s: float = 1.0  # a running child asked to park (SIGUSR1) gets this long
    # one that said it is parking gets this long to get there (within the operator's 15 s
    # deadline for /restart, gemini_operator.calls.sidecars.RESTART_TIMEOUT_SECONDS)
    park_unwind_s: float = 8.0
    park_timeout_s: float = 60.0  # a parked child no restart reached by then is ended
    hints: FailureHints | None = None  # tell the operator of a failure at once

    @classmethod
    def from_env(
        cls, command: Sequence[str], env: Mapping[str, str] | None = None, **overrides: Any
    ) -> LauncherConfig:
        env = os.environ if env is None else env
        status = env.get("GEMINI_LAUNCHER_STATUS_FILE")
        heartbeat = env.get("GEMINI_HEARTBEAT_FILE")
        values: dict[str, Any] = {
            "command": tuple(command),
            "host": env.get("GEMINI_LAUNCHER_HOST") or env.get("GEMINI_POD_IP") or "127.0.0.1",
            "port": int(env.get("GEMINI_LAUNCHER_PORT", "7071")),
            "token": env.get("GEMINI_AUTH_TOKEN", ""),
            "control_public_key": _control_public_key(env),
            "status_file": Path(status) if status else None,
            "heartbeat_file": Path(heartbeat) if heartbeat else None,
            "grace_s": float(env.get("GEMINI_LAUNCHER_GRACE_S", "10")),
            "hold": env.get("GEMINI_LAUNCHER_HOLD", "") in ("1", "true", "yes"),
            "standby": warm.enabled(env),
            "hold_standby": warm.hold_enabled(env),
            "preimport": warm.preimport_list(env),
            "insecure_local": env.get("GEMINI_LAUNCHER_INSECURE_LOCAL", "") in (
                "1", "true", "yes"),
            "in_process": resume_link.enabled(env),
            "park_grace_s": float(env.get("GEMINI_LAUNCHER_PARK_GRACE_S", "1")),
            "park_unwind_s": float(env.get("GEMINI_LAUNCHER_PARK_UNWIND_S", "8")),
            "park_timeout_s": float(env.get("GEMINI_LAUNCHER_PARK_TIMEOUT_S", "60")),
            "hints": FailureHints.from_env(env),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _control_public_key(env: Mapping[str, str]) -> PublicKey | None:
    try:
        return public_key_setting(env)
    except ValueError as err:
        raise LauncherConfigError(str(err)) from err


def check_token(config: LauncherConfig) -> None:
    """Refuse an API anyone could drive: no token, or one short enough to guess, unless the
    local opt-in is set and the API listens on loopback only."""
    if len(config.token) >= MIN_TOKEN_LENGTH:
        return
    problem = ("GEMINI_AUTH_TOKEN is not set" if not config.token else
               f"GEMINI_AUTH_TOKEN is too short ({len(config.token)} of at least "
               f"{MIN_TOKEN_LENGTH} characters)")
    if not config.insecure_local:
        raise LauncherConfigError(
            f"{problem}: the launcher API (restart, stop) would be open to whoever reaches it; set "
            f"a per-job secret of at least {MIN_TOKEN_LENGTH} characters (the operator does), "
            "or for a local run GEMINI_LAUNCHER_INSECURE_LOCAL=1 (--insecure-local)")
    if not _loopback(config.host):
        raise LauncherConfigError(
            f"{problem}, and GEMINI_LAUNCHER_INSECURE_LOCAL allows that only on a loopback "
            f"address, not {config.host}; set a token of at least {MIN_TOKEN_LENGTH} characters")
    log.warning("%s: the launcher API on %s is open to local processes "
                "(GEMINI_LAUNCHER_INSECURE_LOCAL)", problem, config.host)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
