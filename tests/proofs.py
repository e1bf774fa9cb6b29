"""What CI must prove, and the guards that keep CI's promise: every fault kind and capability
is proven at least once in CI, on real kubelet nodes where required, and nothing in CI passes
by being skipped.

Tests say what they prove with `@pytest.mark.proves("zone-loss", ...)`. `--ci-proofs` checks the
selected tests against KINDS; the intended use is
`python -m pytest --collect-only -q -m "not long" --ci-proofs tests`.
With CI=true, a skipped test (other than one marked cuda) or an empty session fails the run.
"""

import os
from collections.abc import Iterable
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Kind:
    """A fault kind or capability that CI must prove; kubelet: only a test on real kubelet
    nodes counts as its proof."""

    name: str
    what: str
    kubelet: bool


@dataclass(frozen=True)
class Proof:
    """What one selected test proves, and where it runs."""

    nodeid: str
    kinds: frozenset[str]
    kubelet: bool
    long: bool


FAULTS: tuple[Kind, ...] = (
    Kind("trainer-crash", "a training process crash, restored in place from local memory", True),
    Kind("trainer-container-kill", "the trainer container killed, restarted by the kubelet", True),
    Kind("hang", "a hung rank, found by the hang timeout", True),
    Kind("sidecar-crash", "the sidecar container killed: restarted, it holds its peers' replicas "
         "again, no recovery", True),
    Kind("sidecar-hang", "the sidecar stopped a while: let go, it holds newer replicas, no "
         "recovery", True),
    Kind("node-loss", "a lost node, its shards restored from a peer", True),
    Kind("m-minus-one-at-once", "m-1 nodes of a replica group lost at once", True),
    Kind("loss-during-recovery", "a node lost while a recovery is in progress", True),
    Kind("partition-heal", "a network partition that heals", True),
    Kind("zone-loss", "every node of one zone lost at once", True),
    Kind("loss-mid-replication", "a node lost while checkpoint replication is in flight", True),
    Kind("s3-outage", "S3 down while a persist is due", True),
    Kind("group-loss-s3", "every in-memory copy gone, restored from S3", True),
    Kind("suspend-resume", "a job suspended and resumed from its checkpoint", True),
    Kind("operator-killed-mid-recovery", "the operator killed during a recovery", True),
    Kind("lagging-replication", "replication over a slow link falls behind training", True),
    Kind("oom", "a trainer killed for running out of memory", True),
)

CAPABILITIES: tuple[Kind, ...] = (
    Kind("helm-install", "the operator installed with the Helm chart", True),
    Kind("shipped-examples", "the shipped example manifests train to the reference losses", True),
    Kind("demo", "`gemini demo` through a crash and a node loss", True),
    Kind("kueue-admission", "a queued job admitted by the real Kueue and run", True),
    Kind("kueue-preemption", "a job preempted by Kueue saves to S3 and resumes from it", False),
    Kind("two-procs-per-node", "two training processes per worker pod (numProcPerNode)", True),
    Kind("two-jobs-at-once", "two jobs failing at the same moment, each from its tier", False),
    Kind("repeated-crashes", "one job recovers crash after crash in place", True),
    Kind("live-metrics", "live scrapes of operator and sidecars count a recovery", False),
    Kind("warm-standby", "a crashed rank's new epoch runs in its launcher's warm standby", True),
    Kind("prometheus-scrape", "a real Prometheus, configured by the Prometheus Operator, scrapes "
         "a ServiceMonitor's and a PodMonitor's pod and fires a PrometheusRule's alert", False),
    Kind("prometheus-dashboards", "the chart's monitors and rules in a real Prometheus: every "
         "dashboard panel answers for a job through a crash and a node loss, an alert fires and "
         "clears", True),
    Kind("refused-pod-template", "a pod template the API server refuses fails the job, naming "
         "the field", False),
    Kind("misspelled-pod-field", "a misspelled field of the pod template (strict field "
         "validation) fails the job, naming the field", False),
)

# The registry the hooks read (through the module, so a test can replace it).
KINDS: tuple[Kind, ...] = FAULTS + CAPABILITIES

_CI_PROOFS_OPTION = "--ci-proofs"
_MARKERS = (
    "proves(*kinds): the fault kinds and capabilities this test proves (names in "
    "tests/proofs.py; --ci-proofs checks that CI proves every one)",
    "long: runs only in `./dev long` (twins on node agents, repeated counts, scale), not in CI",
    "kubelet: runs on real kubelet nodes",
)
_CI_SKIP_ALLOWED_MARKER = "cuda"  # CI machines have no GPU.

_deselected_key = pytest.StashKey[list[pytest.Item]]()


def missing_proofs(kinds: Iterable[Kind], proofs: Iterable[Proof]) -> list[str]:
    """Why each kind that no CI test proves is missing (empty: CI proves them all)."""
    listed = list(proofs)
    return [_why_missing(kind, listed) for kind in kinds
            if not any(_proves_in_ci(proof, kind) for proof in listed)]


def unknown_kinds(kinds: Iterable[Kind], proofs: Iterable[Proof]) -> list[str]:
    """Each proves() name that is not in the registry, so that a typo cannot pass silently."""
    known = {kind.name for kind in kinds}
    return [f"unknown kind {name!r} in proves() of {proof.nodeid}"
            for proof in proofs for name in sorted(proof.kinds - known)]


def _proves_in_ci(proof: Proof, kind: Kind) -> bool:
    return kind.name in proof.kinds and not proof.long and (proof.kubelet or not kind.kubelet)


def _why_missing(kind: Kind, proofs: list[Proof]) -> str:
    if kind.kubelet:
        why = (f"no CI test proves {kind.name!r} on real kubelet nodes "
               f"(a test marked kubelet and proves({kind.name!r}), not long)")
    else:
        why = f"no CI test proves {kind.name!r} (a test marked proves({kind.name!r}), not long)"
    # Name the tests that prove it but do not count, so the fix is obvious.
    near = [proof.nodeid for proof in proofs if kind.name in proof.kinds]
    return why + (f"; not counted: {', '.join(near)}" if near else "")


def proof_of(item: pytest.Item) -> Proof:
    """What a collected test proves, read from its markers (any level: function, class,
    module)."""
    kinds = frozenset(_kind_name(arg) for mark in item.iter_markers("proves") for arg in mark.args)
    return Proof(nodeid=item.nodeid, kinds=kinds,
                 kubelet=item.get_closest_marker("kubelet") is not None,
                 long=item.get_closest_marker("long") is not None)


def _kind_name(arg: object) -> str:
    # A non-string argument can never match a kind; its repr makes the error readable.
    return arg if isinstance(arg, str) else repr(arg)


def _ci_is_on() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(_CI_PROOFS_OPTION, action="store_true", default=False,
                     help="fail collection unless the selected tests prove every fault kind and "
                          "capability in tests/proofs.py (not long; on kubelet nodes where "
                          "required)")


def pytest_configure(config: pytest.Config) -> None:
    for line in _MARKERS:
        config.addinivalue_line("markers", line)
    config.stash[_deselected_key] = []
    if _ci_is_on():
        config.pluginmanager.register(CiSkipGuard(), "tests.proofs.ci-skip-guard")


def pytest_deselected(items: list[pytest.Item]) -> None:
    # Deselected tests still get their proves() names checked.
    if items:
        items[0].config.stash[_deselected_key].extend(items)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    """Runs after -m/-k deselection: items are exactly the tests this session runs."""
    selected = [proof_of(item) for item in items]
    deselected = [proof_of(item) for item in config.stash[_deselected_key]]
    unknown = unknown_kinds(KINDS, selected + deselected)
    if unknown:
        raise _usage_error("proves() names a kind that tests/proofs.py does not know:", unknown)
    # A collection error already fails the run; missing kinds would only hide its cause.
    if config.getoption(_CI_PROOFS_OPTION) and not session.testsfailed:
        _check_ci_proofs(selected)


def _check_ci_proofs(selected: list[Proof]) -> None:
    missing = missing_proofs(KINDS, selected)
    if missing:
        raise _usage_error("CI does not prove every fault kind and capability (tests/proofs.py):",
                           missing)


def _usage_error(title: str, lines: list[str]) -> pytest.UsageError:
    return pytest.UsageError("\n  ".join([title, *lines]))


class CiSkipGuard:
    """With CI=true: a skipped test (unless marked cuda) or an empty session fails the run.
    An object per config, so a pytest run inside a test keeps its own skips."""

    def __init__(self) -> None:
        self.skips: list[tuple[str, str]] = []
        self.failures: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # An xfail is reported as skipped too, but it ran; only real skips count.
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append((report.nodeid, _skip_reason(report)))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        # A module skipped at collection hides all its tests, as a skipped test would.
        if report.skipped:
            self.skips.append((report.nodeid, _skip_reason(report)))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.failures = self._failures(session)
        # Keep a worse status (interrupted, internal error) as it is.
        if self.failures and session.exitstatus in (pytest.ExitCode.OK,
                                                    pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        for line in self.failures:
            terminalreporter.write_line(line, red=True, bold=True)

    def _failures(self, session: pytest.Session) -> list[str]:
        may_skip = {item.nodeid for item in session.items
                    if item.get_closest_marker(_CI_SKIP_ALLOWED_MARKER)}
        failures = [f"CI=true: skipped tests fail the run: {nodeid}: {reason}"
                    for nodeid, reason in self.skips if nodeid not in may_skip]
        # The layer scripts accept pytest's "no tests" exit code; in CI an empty layer is a bug.
        if session.testscollected == 0 and not session.config.option.collectonly:
            failures.append("CI=true: no tests collected")
        return failures


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")
