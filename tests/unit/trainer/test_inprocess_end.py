"""gemini_trainer.run after a finished training: what keeps process groups alive is let go
before the interpreter's finalization (a gloo group destroyed there aborts the process)."""

from __future__ import annotations

import sys
import types
import weakref

import pytest

from gemini_trainer import inprocess


class Group:
    """Stands for a process group; a cycle keeps it alive until a collection."""

    def __init__(self) -> None:
        self.me = self


def _deepspeed_globals(monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, Group]:
    groups = types.ModuleType("deepspeed.utils.groups")
    comm = types.ModuleType("deepspeed.comm.comm")
    group = Group()
    groups._WORLD_GROUP = group  # type: ignore[attr-defined]
    groups._EXPERT_DATA_PARALLEL_GROUP = {"ep": group}  # type: ignore[attr-defined]
    comm.cdb = object()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed.utils.groups", groups)
    monkeypatch.setitem(sys.modules, "deepspeed.comm.comm", comm)
    monkeypatch.delenv("GEMINI_INPROCESS_SOCKET", raising=False)
    return groups, group


def test_a_finished_main_leaves_no_process_group_for_the_interpreters_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    groups, group = _deepspeed_globals(monkeypatch)
    alive = weakref.ref(group)
    del group

    assert inprocess.run(lambda: None) == 0

    assert groups._WORLD_GROUP is None  # type: ignore[attr-defined]
    assert groups._EXPERT_DATA_PARALLEL_GROUP == {}  # type: ignore[attr-defined]
    assert sys.modules["deepspeed.comm.comm"].cdb is None  # type: ignore[attr-defined]
    assert alive() is None, "the group's cycle outlived run()"


def test_a_main_that_fails_without_a_launcher_still_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _deepspeed_globals(monkeypatch)
    assert inprocess.run(lambda: 3) == 3
