"""The node agent reports a failed container's termination message as a kubelet does under
terminationMessagePolicy: FallbackToLogsOnError: the end of that run's log."""

from __future__ import annotations

from pathlib import Path

from gemini_local.nodeagent.container import ContainerRun, fallback_message, terminated_state


def _run(tmp_path: Path, policy: str | None, log: str) -> ContainerRun:
    spec = {"name": "trainer", **({"terminationMessagePolicy": policy} if policy else {})}
    run = ContainerRun(spec=spec, kind="main", pod_dir=tmp_path, runs=1)
    run.log_path(0).parent.mkdir(parents=True)
    run.log_path(0).write_text(log)
    return run


def test_a_failed_run_reports_the_end_of_its_log(tmp_path: Path) -> None:
    log = "".join(f"line {i}\n" for i in range(200)) + "ImportError: no module named torch\n"
    run = _run(tmp_path, "FallbackToLogsOnError", log)
    message = fallback_message(run, 1)
    assert message.endswith("line 199\nImportError: no module named torch")
    assert len(message.splitlines()) == 80 and len(message.encode()) <= 2048
    state = terminated_state(1, "2026-01-01T00:00:00Z", "id", message)
    assert state["terminated"]["message"] == message


def test_no_message_for_a_success_or_without_the_policy(tmp_path: Path) -> None:
    assert fallback_message(_run(tmp_path / "a", "FallbackToLogsOnError", "done\n"), 0) == ""
    assert fallback_message(_run(tmp_path / "b", None, "boom\n"), 1) == ""
    assert "message" not in terminated_state(1, "2026-01-01T00:00:00Z", "id")["terminated"]
