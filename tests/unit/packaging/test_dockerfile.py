"""The Dockerfile stays honest without a container engine: what it copies exists and is in the
build context, its entrypoints are the project's real commands, it installs exactly the lock,
its images run as a non-root user from a pinned base, and the code needs nothing the image
would not install."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from tests.unit.packaging import dockerfile as df
from tests.unit.packaging.commands import unknown_part
from tests.unit.packaging.imports import (
    SOURCE_DIRS,
    distributions_of,
    dotted_imports,
    runtime_closure,
    third_party_imports,
)

ROOT = Path(__file__).resolve().parents[3]
TEXT = (ROOT / "Dockerfile").read_text()
STAGES = df.stages(TEXT)
BY_NAME = {s.name: s for s in STAGES}
IGNORE = df.read_dockerignore(ROOT / ".dockerignore")
# The images users run, and the command each starts.
TARGETS = {
    "operator": ["gemini", "operator", "run"],
    "sidecar": ["gemini", "sidecar"],
    "trainer": ["gemini", "launch", "--"],
    "examples": ["gemini", "launch", "--"],  # the trainer image with the example scripts
}
EXAMPLE_IMAGE = "gemini-examples"  # what `docker build --target examples -t` names it


def context_copies() -> list[tuple[str, str]]:
    """(stage, source) of every COPY from the build context (not from another stage)."""
    return [
        (stage.name, source)
        for stage in STAGES
        for ins in stage.all("COPY")
        if "from" not in ins.flags()
        for source in ins.words()[:-1]
    ]


def test_every_target_exists_as_a_named_stage():
    assert set(TARGETS) <= set(BY_NAME), f"stages: {sorted(BY_NAME)}"


@pytest.mark.parametrize("stage, source", context_copies())
def test_every_copied_file_exists_and_is_in_the_build_context(stage, source):
    assert (ROOT / source).exists(), f"stage {stage} copies {source}, which does not exist"
    assert not df.dockerignore_excludes(IGNORE, source), (
        f"stage {stage} copies {source}, but .dockerignore leaves it out of the build context")


@pytest.mark.parametrize("manifest", sorted((ROOT / "examples").glob("geminijob-*.yaml")),
                         ids=lambda p: p.name)
def test_each_example_job_runs_an_image_and_script_the_dockerfile_builds(manifest):
    job = yaml.safe_load(manifest.read_text())
    [trainer] = [c for c in job["spec"]["template"]["spec"]["containers"]
                 if c["name"] == "trainer"]
    version = yaml.safe_load((ROOT / "helm/gemini-operator/Chart.yaml").read_text())["appVersion"]
    assert trainer["image"] == f"{EXAMPLE_IMAGE}:{version}"
    assert f"-t {EXAMPLE_IMAGE}:{version}" in TEXT  # the build line in the header says so
    copied = {f"/app/examples/{Path(src).name}" for ins in BY_NAME["examples"].all("COPY")
              for src in ins.words()[:-1]}
    scripts = [word for word in trainer["command"] if word.startswith("/app/")]
    assert scripts and set(scripts) <= copied, f"{scripts} not among {sorted(copied)}"


def test_copies_from_other_stages_name_earlier_stages():
    for i, stage in enumerate(STAGES):
        for ins in stage.all("COPY"):
            source = ins.flags().get("from")
            if source is not None:
                assert source in [s.name for s in STAGES[:i]], (
                    f"{stage.name}: COPY --from={source} names no earlier stage")


@pytest.mark.parametrize("target, command", TARGETS.items())
def test_entrypoints_are_the_projects_real_commands(target, command):
    entrypoint = next(s.last("ENTRYPOINT") for s in df.ancestry(STAGES, target)
                      if s.last("ENTRYPOINT"))
    assert entrypoint is not None and entrypoint.args.startswith("["), (
        f"{target}: ENTRYPOINT must be in exec (JSON) form so signals reach the process")
    assert entrypoint.words() == command
    assert unknown_part(command) is None, unknown_part(command)


@pytest.mark.parametrize("target", TARGETS)
def test_images_run_as_a_fixed_non_root_user(target):
    user = next((s.last("USER") for s in df.ancestry(STAGES, target) if s.last("USER")), None)
    assert user is not None, f"{target} runs as root: add USER"
    uid = user.args.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, (
        f"{target}: USER {user.args} must be a numeric non-root uid (runAsNonRoot checks it)")


@pytest.mark.parametrize("target", TARGETS)
def test_runtime_images_carry_no_build_tools(target):
    """Slim: each image starts again from the base image and only copies the venv in."""
    chain = df.ancestry(STAGES, target)
    assert all(not s.all("RUN") or "pip" not in " ".join(i.args for i in s.all("RUN"))
               for s in chain), f"{target} installs packages itself instead of copying a venv"
    assert chain[-1].base == STAGES[0].base


def test_the_base_image_is_pinned_to_the_python_the_project_requires():
    base = STAGES[0].base
    match = re.fullmatch(r"python:(\d+)\.(\d+)\.(\d+)-slim-\w+", base)
    assert match, f"base image {base!r} must be pinned as python:X.Y.Z-slim-<debian release>"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert f">={match[1]}.{match[2]}" in requires, f"{base} does not match {requires}"
    assert all(s.base == base or s.base in BY_NAME for s in STAGES), "one base image for all"


def test_every_pip_install_is_constrained_by_requirements_lock():
    installs = [i for s in STAGES for i in s.all("RUN") if "pip install" in i.args]
    assert installs, "the Dockerfile installs nothing"
    for ins in installs:
        assert re.search(r"(--constraint|-c) requirements\.lock\b", ins.args), (
            f"`{ins.args}` does not install from requirements.lock")
        assert not re.search(r"(-r|--requirement)\s", ins.args), ins.args
    assert ("build-env", "requirements.lock") in context_copies()


def test_the_trainer_dependencies_are_a_layer_a_code_change_leaves_alone():
    """The 5 GB of torch and DeepSpeed come from stages that see only the lock and
    pyproject.toml; the project goes into the trainer image as a layer of its own files."""
    deps_chain = df.ancestry(STAGES, "build-trainer-deps")
    seen = {source for stage, source in context_copies()
            if stage in {s.name for s in deps_chain}}
    assert seen == {"requirements.lock", "pyproject.toml"}, seen
    (project,) = BY_NAME["build-trainer"].all("RUN")
    assert "--no-deps" in project.args and "/project" in project.args
    (copy,) = BY_NAME["trainer"].all("COPY")
    assert copy.flags() == {"from": "build-trainer"} and copy.words()[0].startswith("/project/")
    assert BY_NAME["trainer"].base == BY_NAME["build-trainer"].base == "trainer-deps"


def test_runtime_imports_are_declared_dependencies():
    """A module the shipped code imports must come with `pip install .[train]`, not only with
    the dev tools that happen to be in the lock (the image installs no dev extra)."""
    declared = runtime_closure(extras=["train"])
    missing = {
        module: sorted(map(str, paths))
        for module, paths in third_party_imports().items()
        if not distributions_of(module) & declared
    }
    assert not missing, (
        f"imported but not a run-time dependency in pyproject.toml (add it to "
        f"[project].dependencies; the version is in requirements.lock): {missing}")


def test_what_the_images_leave_out_is_imported_by_nothing_they_run():
    """The build stages delete parts of installed packages (the Kubernetes client's asyncio
    copy): no shipped module, and no module of the kept part of that package, imports them."""
    (env,) = [i for i in BY_NAME["build-env"].all("ENV") if i.args.startswith("UNUSED=")]
    removed = [p.split("/site-packages/")[1].replace("/", ".")
               for p in env.args.partition("=")[2].strip('"').split()]
    assert removed == ["kubernetes.aio"]
    for stage in ("build-operator", "build-sidecar", "build-trainer-deps"):
        assert any("rm -rf ${UNUSED}" in i.args for i in BY_NAME[stage].all("RUN")), stage
    package_dir = Path(str(metadata.distribution("kubernetes").locate_file("kubernetes")))
    kept = {p: ".".join(("kubernetes", *p.relative_to(package_dir).parent.parts))
            for p in package_dir.rglob("*.py") if "aio" not in p.relative_to(package_dir).parts}
    sources = {p: "" for d in SOURCE_DIRS for p in d.rglob("*.py")} | kept
    for path, package in sources.items():
        for name in dotted_imports(path, package):
            assert not any(name == r or name.startswith(r + ".") for r in removed), (
                f"{path} imports {name}, which the images delete")
