"""The reference cache: one run per content serves as many steps or fewer, kept across runs."""

from __future__ import annotations

from pathlib import Path

from gemini_demo.reference import ReferenceRun
from gemini_demo.reference_cache import ReferenceCache, content_digest

# Prints every step's "loss" (the step number in float hex) on every rank; counts its runs.
COUNTING = """
import os, pathlib, sys
steps = int(sys.argv[sys.argv.index("--steps") + 1])
runs = pathlib.Path(sys.argv[sys.argv.index("--runs") + 1])
with open(runs / ("rank" + os.environ["RANK"]), "a") as out:
    out.write("run\\n")
for step in range(1, steps + 1):
    print(f"step {step} loss {float(step).hex()}")
"""


def _losses(steps: int, world: int = 2) -> list[dict[int, str]]:
    return [{s: float(s).hex() for s in range(1, steps + 1)} for _ in range(world)]


def _script(tmp_path: Path, code: str = "print()\n") -> Path:
    script = tmp_path / "train.py"
    script.write_text(code)
    return script


def test_a_run_serves_as_many_steps_or_fewer_and_a_longer_request_misses(
        tmp_path: Path) -> None:
    cache, script = ReferenceCache(tmp_path / "cache"), _script(tmp_path)
    args = ["--layers", "1", "--steps", "12", "--step-sleep", "2.0"]
    assert cache.get(script, 2, args) is None
    cache.put(script, 2, args, _losses(12))
    fewer = cache.get(script, 2, ["--layers", "1", "--steps", "5"])
    assert fewer == _losses(5)
    assert cache.get(script, 2, ["--layers", "1", "--steps", "13"]) is None
    assert cache.get(script, 3, args) is None  # another world
    assert cache.get(script, 2, ["--layers", "2", "--steps", "5"]) is None  # another model


def test_a_shorter_run_does_not_replace_a_longer_one_and_an_incomplete_one_is_not_kept(
        tmp_path: Path) -> None:
    cache, script = ReferenceCache(tmp_path / "cache"), _script(tmp_path)
    cache.put(script, 2, ["--steps", "12"], _losses(12))
    cache.put(script, 2, ["--steps", "4"], _losses(4))
    assert cache.get(script, 2, ["--steps", "12"]) == _losses(12)
    gap = _losses(8)
    del gap[1][3]
    cache.put(script, 2, ["--steps", "20"], [*_losses(20)[:1], gap[1]])
    assert cache.get(script, 2, ["--steps", "20"]) is None


def test_the_key_follows_the_script_and_settings_but_not_steps_or_idle_time(tmp_path: Path) -> None:
    script = _script(tmp_path)
    base = content_digest(script, 2, ["--d-model", "32", "--steps", "12"])
    assert base == content_digest(script, 2, ["--d-model", "32", "--steps", "30",
                                              "--step-sleep", "1.0"])
    assert base != content_digest(script, 2, ["--d-model", "64", "--steps", "12"])
    assert base != content_digest(script, 2, ["--d-model", "32", "--steps", "12"],
                                  {"LOCAL_WORLD_SIZE": "2"})
    script.write_text("print('changed')\n")
    assert base != content_digest(script, 2, ["--d-model", "32", "--steps", "12"])


def test_a_cached_reference_run_starts_no_process(tmp_path: Path) -> None:
    script, runs = _script(tmp_path, COUNTING), tmp_path / "runs"
    runs.mkdir()
    cache = ReferenceCache(tmp_path / "cache")
    args = ["--runs", str(runs), "--steps", "6"]
    first = ReferenceRun(script, args, 2, tmp_path / "a", cache=cache).start()
    assert first.wait(timeout=60) == _losses(6)[0]
    again = ReferenceRun(script, [*args[:2], "--steps", "4"], 2, tmp_path / "b",
                         cache=cache).start()
    assert again.cached is not None and not again.running()
    assert again.wait(timeout=60) == _losses(4)[0]
    assert (runs / "rank0").read_text() == "run\n"  # the script ran once
