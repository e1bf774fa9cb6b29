"""The node's training processes, for the launcher: started (from warm standbys where they are
usable), their output relayed, and ended.

One process per node, or a local group of one per local rank (gemini_trainer.local_group).
Each runs in a session of its own and dies with the launcher (parent-death signal).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from gemini_trainer import standby as warm
from gemini_trainer.local_group import LocalGroup, local_env, relay_output
from gemini_trainer.standby import Standby

log = logging.getLogger(__name__)

TAIL_LINES = 20  # of a child's output, for the message of its failure
PR_SET_PDEATHSIG = 1
Child = subprocess.Popen[bytes] | LocalGroup
Tail = deque[bytes]


def new_tail() -> Tail:
    return deque(maxlen=TAIL_LINES)


class TrainingProcesses:
    """Starts the command once per local rank and ends what it started. ``relay``: keep each
    process's output (relayed to the launcher's own) and its last lines, for the message of a
    failure the launcher outlives."""

    def __init__(self, command: Sequence[str], local_world: int, grace_s: float,
                 relay: bool) -> None:
        self.command = list(command)
        self.local_world = local_world
        self._grace_s = grace_s
        self._relay = relay
        self._spawner = _Spawner()
        self._output_lock = threading.Lock()
        # pid -> (relay threads, last output lines) of processes whose output is relayed
        self._relays: dict[int, tuple[list[threading.Thread], Tail]] = {}

    def start(self, env: Mapping[str, str], standbys: list[Standby], tail: Tail
              ) -> tuple[Child, bool]:
        """The node's training process, or its local group: each from its warm standby where
        one is usable, else spawned (its output in ``tail``). Also: whether all started warm."""
        procs: list[subprocess.Popen[bytes]] = []
        warm_ranks = 0
        try:
            for local_rank in range(self.local_world):
                rank_env = self.rank_env(env, local_rank)
                proc = _activate(standbys[local_rank], rank_env) if standbys else None
                warm_ranks += proc is not None
                procs.append(proc or self.spawn_rank(list(self.command), rank_env, tail))
        except BaseException:
            LocalGroup(procs, 0.0).signal_groups(signal.SIGKILL)
            for unused in standbys[len(procs):]:  # discarding twice is harmless
                unused.discard()
            raise
        started_warm = warm_ranks == self.local_world
        if self.local_world == 1:
            return procs[0], started_warm
        return LocalGroup(procs, self._grace_s), started_warm

    def rank_env(self, env: Mapping[str, str], local_rank: int) -> Mapping[str, str]:
        if self.local_world == 1:
            return env
        return local_env(env, local_rank, self.local_world)

    def spawn_rank(self, command: list[str], env: Mapping[str, str], tail: Tail,
                   **popen: Any) -> subprocess.Popen[bytes]:
        """One process of the node (or its standby): alone as ``_spawn_one``; in a local group
        its output merged, each line prefixed with its rank as torchrun does, the last lines
        in the group's ``tail``."""
        if self.local_world == 1:
            return self._spawn_one(command, env, **popen)
        proc = self._spawner.spawn(command, env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, **popen)
        relay = relay_output(proc, f"[rank{env['RANK']}]: ".encode(), self._output_lock,
                             tail=tail)
        self._relays[proc.pid] = ([relay], tail)
        return proc

    def _spawn_one(self, command: list[str], env: Mapping[str, str], **popen: Any
                   ) -> subprocess.Popen[bytes]:
        """One training process (or standby). A launcher that outlives a failed child has no
        container exit to show its last words, so it relays the child's output and keeps the
        last lines for the failure's message."""
        if not self._relay:
            return self._spawner.spawn(command, env, **popen)
        proc = self._spawner.spawn(command, env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, **popen)
        tail = new_tail()
        relays = [relay_output(proc, b"", self._output_lock, out, tail, source)
                  for out, source in ((sys.stdout.buffer, proc.stdout),
                                      (sys.stderr.buffer, proc.stderr))]
        self._relays[proc.pid] = (relays, tail)
        return proc

    def last_words(self, proc: Child) -> str:
        """The last lines an ended process (or local group) wrote, when they were kept."""
        procs = proc.procs if isinstance(proc, LocalGroup) else [proc]
        relays = [r for p in procs if (r := self._relays.pop(p.pid, None)) is not None]
        for threads, _ in relays:
            for thread in threads:
                thread.join(1.0)  # the pipes' last lines may still be on their way
        return b"".join(relays[0][1]).decode(errors="replace") if relays else ""

    def terminate(self, proc: Child) -> None:
        """SIGTERM to its process groups, SIGKILL after the grace period."""
        if proc.poll() is not None:
            return
        _signal_group(proc, signal.SIGTERM)
        # A stopped process (a hang injected with SIGSTOP, a debugger) acts on SIGTERM only
        # once continued; without this it would wait out the whole grace (systemd does same).
        _signal_group(proc, signal.SIGCONT)
        try:
            proc.wait(timeout=self._grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


class _Spawner:
    """Starts children from one long-lived thread: the parent-death signal fires when the
    *thread* that forked the child ends, and request threads end right after answering."""

    def __init__(self) -> None:
        self._requests: queue.Queue[tuple[list[str], dict[str, Any], queue.Queue[Any]]] = (
            queue.Queue()
        )
        threading.Thread(target=self._serve, name="launcher-spawner", daemon=True).start()

    def spawn(self, command: list[str], env: Mapping[str, str], **popen: Any
              ) -> subprocess.Popen[bytes]:
        """A child in a session of its own, or as ``popen`` overrides say."""
        answer: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._requests.put((command, {"env": dict(env), "start_new_session": True, **popen},
                            answer))
        result = answer.get()
        if isinstance(result, BaseException):
            raise result
        return result  # type: ignore[no-any-return]

    def _serve(self) -> None:
        while True:
            command, popen, answer = self._requests.get()
            try:
                answer.put(subprocess.Popen(command, preexec_fn=_die_with_parent, **popen))
            except BaseException as err:  # handed to the caller, who raises it
                answer.put(err)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launcher dies (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _activate(standby: Standby, env: Mapping[str, str]) -> subprocess.Popen[bytes] | None:
    """The standby's process running this run, or None (then discarded). Even one still
    importing is a head start: taking over sets its session's autogroup back to nice 0, so
    the rest runs at full priority (without autogroup, only the module in progress finishes
    at the importing thread's nice +10)."""
    if standby.proc.poll() is None:
        proc = standby.activate(env, os.getcwd())
        if proc is not None:
            return proc
        log.info("a warm standby was not usable (%s); spawning",
                 ", ".join(warm.startup_changes(standby.env, env)) or "it ended")
    standby.discard()
    return None


def _signal_group(proc: Child, sig: signal.Signals) -> None:
    if isinstance(proc, LocalGroup):
        proc.signal_groups(sig)
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
