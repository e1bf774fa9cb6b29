"""SIGTERM and SIGINT end the demo through its teardown (gemini_demo.interrupt)."""

from __future__ import annotations

import io
import os
import signal
import time
from pathlib import Path

import pytest

from gemini_demo import session
from gemini_demo.interrupt import DemoInterrupted, SignalGuard
from gemini_demo.plan import DemoConfig


def test_the_first_signal_raises_and_later_ones_are_only_remembered() -> None:
    before = signal.getsignal(signal.SIGTERM)
    guard = SignalGuard().install()
    try:
        with pytest.raises(DemoInterrupted) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at once
        assert stop.value.exit_code == 143
        os.kill(os.getpid(), signal.SIGINT)  # a second one: the teardown goes on
        assert guard.received == signal.SIGTERM
    finally:
        guard.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_signal_in_a_shielded_block_is_raised_at_its_end() -> None:
    guard = SignalGuard().install()
    done = []
    try:
        with pytest.raises(DemoInterrupted) as stop, guard.shielded():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("the block finished")
        assert done == ["the block finished"] and stop.value.exit_code == 130
        with guard.shielded(raise_after=False):  # the teardown: nothing raised again
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        guard.uninstall()


def demo(tmp_path: Path, keep: bool = False) -> session.Demo:
    options = session.DemoOptions(DemoConfig(), tmp_path, keep=keep, progress=io.StringIO())
    return session.Demo(options)


def test_a_signal_mid_run_tears_down_and_says_so(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    run = demo(tmp_path)
    downs: list[Path] = []
    before = signal.getsignal(signal.SIGTERM)

    def interrupted_mid_run() -> None:
        run.cluster_started = True
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    monkeypatch.setattr(run, "_run", interrupted_mid_run)
    monkeypatch.setattr("gemini_demo.session.cluster.down",
                        lambda state: downs.append(state) or [])
    with pytest.raises(DemoInterrupted) as stop:
        run.run()
    assert downs == [tmp_path]
    assert str(stop.value) == f"stopped by SIGTERM; tore down the operator, cluster and S3 in " \
                              f"{tmp_path}"
    assert signal.getsignal(signal.SIGTERM) == before  # the previous handler is back


def test_a_signal_during_the_teardown_waits_for_its_end(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    run = demo(tmp_path)
    steps: list[str] = []

    def down(_state: Path) -> list[str]:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while tearing down
        steps.append("down finished")
        return []

    def finished_run() -> dict[str, object]:
        run.cluster_started = True
        return {}

    monkeypatch.setattr(run, "_run", finished_run)
    monkeypatch.setattr("gemini_demo.session.cluster.down", down)
    with pytest.raises(DemoInterrupted) as stop:
        run.run()
    assert steps == ["down finished"] and stop.value.exit_code == 130


def test_with_keep_a_signal_leaves_the_cluster_running(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    run = demo(tmp_path, keep=True)

    def interrupted_mid_run() -> None:
        run.cluster_started = True
        raise DemoInterrupted(signal.SIGINT)

    monkeypatch.setattr(run, "_run", interrupted_mid_run)
    monkeypatch.setattr("gemini_demo.session.cluster.down", pytest.fail)
    run.guard.received = signal.SIGINT
    with pytest.raises(DemoInterrupted, match="left running \\(--keep\\)"):
        run.run()
