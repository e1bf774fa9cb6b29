"""Which commands a warm standby can run, and which environment changes need a fresh process."""

from __future__ import annotations

import pytest

from gemini_trainer import standby
from gemini_trainer.standby import PythonCommand


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["python", "train.py", "--steps", "3"],
         ("python", (), "script", "train.py", ("--steps", "3"))),
        (["/venv/bin/python3.11", "-u", "-X", "dev", "t.py"],
         ("/venv/bin/python3.11", ("-u", "-X", "dev"), "script", "t.py", ())),
        (["python3", "-m", "pkg.train", "-m", "x"],
         ("python3", (), "module", "pkg.train", ("-m", "x"))),
        (["python", "-B", "-c", "print(1)", "a"],
         ("python", ("-B",), "code", "print(1)", ("a",))),
    ],
)
def test_python_commands_are_parsed_into_interpreter_flags_and_target(
    command: list[str], expected: tuple[object, ...]
) -> None:
    parsed = PythonCommand.parse(command)
    assert parsed is not None
    assert (parsed.interpreter, parsed.flags, parsed.kind, parsed.target, parsed.args) == expected


@pytest.mark.parametrize(
    "command",
    [
        ["torchrun", "--nproc-per-node", "2", "train.py"],  # not an interpreter
        ["bash", "-c", "python train.py"],
        ["python"],  # interactive
        ["python", "-"],  # stdin
        ["python", "-I", "train.py"],  # isolated mode: a flag the standby does not mirror
        ["python", "-m"],
        ["pythonista", "train.py"],
        [],
    ],
)
def test_other_commands_get_no_standby(command: list[str]) -> None:
    assert PythonCommand.parse(command) is None


def test_the_boot_command_runs_the_same_interpreter_with_the_same_flags() -> None:
    parsed = PythonCommand.parse(["python3", "-u", "-W", "error", "t.py"])
    assert parsed is not None
    boot = parsed.boot_command(["torch", "deepspeed"], None, 10, (5, 6))
    assert boot[:5] == ["python3", "-u", "-W", "error", "-c"]
    assert boot[6:] == ["5", "6", "10", "", "torch,deepspeed"]


def test_startup_settings_that_differ_are_reported_and_epoch_settings_are_not() -> None:
    before = {"PATH": "/a", "OMP_NUM_THREADS": "1", "MASTER_PORT": "1", "RANK": "0"}
    after = {**before, "MASTER_PORT": "2", "GEMINI_RESTART_EPOCH": "3",
             "GEMINI_RESTORE_VERSION": "latest"}
    assert standby.startup_changes(before, after) == []
    changed = {**after, "OMP_NUM_THREADS": "4", "PYTHONHASHSEED": "1", "PATH": "/b"}
    del changed["RANK"]
    assert standby.startup_changes(before, changed) == ["OMP_NUM_THREADS", "PATH",
                                                        "PYTHONHASHSEED"]


def test_preimport_and_enable_settings() -> None:
    assert standby.preimport_list({}) == standby.DEFAULT_PREIMPORT
    assert standby.preimport_list({standby.PREIMPORT_ENV: " numpy, ,torch "}) == ("numpy",
                                                                                  "torch")
    assert standby.preimport_list({standby.PREIMPORT_ENV: ""}) == ()
    assert all(standby.enabled({standby.ENABLE_ENV: v}) for v in ("1", "On", "true"))
    assert not any(standby.enabled({standby.ENABLE_ENV: v}) for v in ("0", "false", "Off"))
    assert not standby.enabled({}), "opt-in: an interpreter per rank costs memory"


def test_the_scripts_own_modules_are_not_learned() -> None:
    assert standby._learnable("torch.nn", "/venv/lib/torch/nn/__init__.py", "/job")
    assert not standby._learnable("model", "/job/model.py", "/job")
    assert not standby._learnable("__main__", "/elsewhere/x.py", "/job")
    assert not standby._learnable("sys", None, "/job")
    assert standby._learnable("jobs", "/jobs/x.py", "/job"), "a sibling directory is another"


def test_defaults_of_packages_the_previous_run_never_imported_are_dropped() -> None:
    defaults = standby.DEFAULT_PREIMPORT
    assert standby.drop_unused_defaults(defaults, None) == list(defaults)  # nothing learned yet
    assert standby.drop_unused_defaults(defaults, []) == list(defaults)
    fsdp = ["torch", "torch.distributed.fsdp", "numpy"]
    assert standby.drop_unused_defaults(defaults, fsdp) == ["torch", "torch._dynamo"]
    zero = [*fsdp, "deepspeed", "deepspeed.runtime.engine"]
    assert standby.drop_unused_defaults(defaults, zero) == list(defaults)
    # what a user listed stays, even from a package the run did not import
    assert standby.drop_unused_defaults(("torch", "transformers"), fsdp) == [
        "torch", "transformers"]
