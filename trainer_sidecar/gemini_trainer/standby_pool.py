"""The launcher's warm standbys: one pre-started interpreter per local rank for the next run
(gemini_trainer.standby), taken by the next start or discarded."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from gemini.control import launcher
from gemini_trainer import standby as warm
from gemini_trainer.launch_processes import Tail, TrainingProcesses, new_tail
from gemini_trainer.standby import PythonCommand, Standby

log = logging.getLogger(__name__)


class StandbyPool:
    """The standbys armed for the next run, one per local rank, or none. ``python``: the
    command as a python one (None: it is not, and no standby is ever armed)."""

    def __init__(self, python: PythonCommand | None, processes: TrainingProcesses,
                 preimport: Sequence[str], modules_file: Path) -> None:
        self._python = python
        self._processes = processes
        self._preimport = tuple(preimport)
        self._modules_file = modules_file
        self.armed: list[Standby] = []
        # the last output lines of the standbys' processes, shared by their local group
        self._tail: Tail = new_tail()

    def arm(self, env: Mapping[str, str], busy: bool) -> None:
        """Pre-start the interpreters for the next run, one per local rank (``busy``: training
        runs alongside, so they import at a low priority)."""
        if self._python is None or self.armed:
            return
        nice = warm.BUSY_NICE if busy else 0
        # their own tail: what a standby prints while it waits is not the running group's
        self._tail = new_tail()
        spawn = functools.partial(self._processes.spawn_rank, tail=self._tail)
        try:
            for local_rank in range(self._processes.local_world):
                self.armed.append(Standby(
                    self._python, self._processes.rank_env(env, local_rank), spawn,
                    self._preimport, self._modules_file, nice))
        except OSError as err:
            log.warning("no warm standby (%s): restarts spawn fresh processes", err)
            self.discard()

    def take(self) -> tuple[list[Standby], Tail]:
        """The armed standbys for a start (none left armed), and the tail their output goes
        to (a fresh one when none was armed)."""
        standbys, self.armed = self.armed, []
        return standbys, self._tail if standbys else new_tail()

    def discard(self) -> None:
        standbys, self.armed = self.armed, []
        for standby in standbys:
            standby.discard()

    def state(self) -> launcher.StandbyState | None:
        """The first standby's pid and whether all are ready (None: none armed)."""
        if not self.armed:
            return None
        return launcher.StandbyState(self.armed[0].proc.pid,
                                     all(standby.ready() for standby in self.armed))
