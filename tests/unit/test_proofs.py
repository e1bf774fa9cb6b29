"""The CI proof guard (tests/proofs.py): every fault kind and capability proven in CI, on real
kubelet nodes where required; proves() typos refused; with CI=true, skips fail the run."""

import pytest

from tests.proofs import KINDS, Kind, Proof, missing_proofs, unknown_kinds

pytest_plugins = ["pytester"]


def _proof(kind: Kind, *, kinds: frozenset[str] | None = None, kubelet: bool | None = None,
           long: bool = False) -> Proof:
    return Proof(nodeid=f"tests/e2e/test_x.py::test_{kind.name}",
                 kinds=frozenset({kind.name}) if kinds is None else kinds,
                 kubelet=kind.kubelet if kubelet is None else kubelet, long=long)


def _complete_proofs() -> list[Proof]:
    return [_proof(kind) for kind in KINDS]


def _with_zone_loss(replacement: Proof) -> list[Proof]:
    return [replacement if proof.nodeid.endswith("test_zone-loss") else proof
            for proof in _complete_proofs()]


_ZONE_LOSS = next(kind for kind in KINDS if kind.name == "zone-loss")


def test_registry_names_are_unique_and_described() -> None:
    names = [kind.name for kind in KINDS]
    assert len(names) == len(set(names))
    assert all(kind.what for kind in KINDS)


def test_a_complete_set_of_proofs_misses_nothing() -> None:
    assert missing_proofs(KINDS, _complete_proofs()) == []


def test_a_kind_whose_only_kubelet_proof_lost_its_marker_is_missing() -> None:
    missing = missing_proofs(KINDS, _with_zone_loss(_proof(_ZONE_LOSS, kinds=frozenset())))
    assert missing == ["no CI test proves 'zone-loss' on real kubelet nodes "
                       "(a test marked kubelet and proves('zone-loss'), not long)"]


def test_a_kind_proven_only_by_a_long_test_is_missing_and_the_test_named() -> None:
    [missing] = missing_proofs(KINDS, _with_zone_loss(_proof(_ZONE_LOSS, long=True)))
    assert "'zone-loss'" in missing
    assert "not counted: tests/e2e/test_x.py::test_zone-loss" in missing


def test_a_kubelet_kind_proven_only_on_node_agents_is_missing() -> None:
    [missing] = missing_proofs(KINDS, _with_zone_loss(_proof(_ZONE_LOSS, kubelet=False)))
    assert missing.startswith("no CI test proves 'zone-loss' on real kubelet nodes")


def test_a_node_agent_proof_is_enough_for_a_kind_that_does_not_need_kubelet() -> None:
    kind = Kind("two-jobs-at-once", "two jobs side by side", kubelet=False)
    assert missing_proofs([kind], [_proof(kind, kubelet=False)]) == []
    assert missing_proofs([kind], [_proof(kind, kubelet=False, long=True)]) != []


def test_an_unknown_kind_is_named_with_its_test() -> None:
    typo = Proof("tests/e2e/test_x.py::test_zone", frozenset({"zone-los"}), True, False)
    assert unknown_kinds(KINDS, [typo]) == [
        "unknown kind 'zone-los' in proves() of tests/e2e/test_x.py::test_zone"]


# A synthetic suite, run in-process with the plugin, one test per kind in the real registry.

@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv("CI", raising=False)
    pytester.makeini("[pytest]\n"
                     "addopts = --strict-markers -p tests.proofs\n"
                     "asyncio_default_fixture_loop_scope = function\n"
                     "markers =\n    cuda: needs a CUDA GPU\n")
    return pytester


def _suite_source(zone_loss_marks: str = '@pytest.mark.kubelet\n@pytest.mark.proves("zone-loss")'
                  ) -> str:
    tests = [_test_source(kind) for kind in KINDS if kind.name != "zone-loss"]
    tests.append(f"{zone_loss_marks}\ndef test_zone_loss():\n    pass\n")
    # A node agent twin and a long kubelet run never count as zone-loss's CI proof.
    tests.append('@pytest.mark.proves("zone-loss")\ndef test_zone_loss_on_node_agents():\n'
                 "    pass\n")
    tests.append('@pytest.mark.long\n@pytest.mark.kubelet\n@pytest.mark.proves("zone-loss")\n'
                 "def test_zone_loss_at_scale():\n    pass\n")
    return "import pytest\n\n\n" + "\n\n".join(tests)


def _test_source(kind: Kind) -> str:
    kubelet = "@pytest.mark.kubelet\n" if kind.kubelet else ""
    name = kind.name.replace("-", "_")
    return f'{kubelet}@pytest.mark.proves("{kind.name}")\ndef test_{name}():\n    pass\n'


def _collect_for_ci(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("--collect-only", "-q", "-m", "not long", "--ci-proofs", *args)


def test_ci_proofs_pass_when_every_kind_is_proven(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_suite=_suite_source())
    assert _collect_for_ci(suite).ret == pytest.ExitCode.OK


def test_ci_proofs_fail_naming_the_kind_whose_kubelet_test_lost_its_marker(
        suite: pytest.Pytester) -> None:
    suite.makepyfile(test_suite=_suite_source(zone_loss_marks="@pytest.mark.kubelet"))
    result = _collect_for_ci(suite)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*no CI test proves 'zone-loss' on real kubelet nodes*"
                                 "not counted: test_suite.py::test_zone_loss_on_node_agents"])
    assert "'trainer-crash'" not in result.stderr.str()


def test_ci_proofs_see_only_the_tests_left_after_marker_deselection(
        suite: pytest.Pytester) -> None:
    suite.makepyfile(test_suite=_suite_source())
    result = _collect_for_ci(suite, "-m", "not kubelet")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*no CI test proves 'trainer-crash' on real kubelet nodes*"])
    assert "'two-jobs-at-once'" not in result.stderr.str()


def test_an_unknown_proves_name_fails_collection_even_when_deselected(
        suite: pytest.Pytester) -> None:
    suite.makepyfile(test_typo='import pytest\n\n\n'
                               '@pytest.mark.long\n@pytest.mark.proves("zone-los")\n'
                               'def test_zone():\n    pass\n')
    result = suite.runpytest("--collect-only", "-q", "-m", "not long")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown kind 'zone-los' in proves() of test_typo.py::test_zone"])


_SKIPS = """import pytest


def test_passes():
    pass


def test_skipped():
    pytest.skip("needs root")


@pytest.mark.xfail(reason="known bug")
def test_xfails():
    assert False


@pytest.mark.cuda
@pytest.mark.skipif(True, reason="needs a GPU")
def test_on_a_gpu():
    pass
"""


def test_with_ci_a_skipped_test_fails_the_run_and_is_named(
        suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    suite.makepyfile(test_skips=_SKIPS)
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["CI=true: skipped tests fail the run: test_skips.py::test_skipped: needs root"])
    assert "test_on_a_gpu:" not in result.stdout.str()
    assert "test_xfails:" not in result.stdout.str()


def test_with_ci_a_skipped_cuda_test_and_an_xfail_pass(
        suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    suite.makepyfile(test_skips=_SKIPS.replace('pytest.skip("needs root")', "pass"))
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest()
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=2, skipped=1, xfailed=1)


def test_with_ci_a_module_skipped_at_collection_fails_the_run(
        suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    suite.makepyfile(test_gone='import pytest\n\npytest.skip("no radosgw", '
                               "allow_module_level=True)\n\n\ndef test_s3():\n    pass\n")
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["CI=true: skipped tests fail the run: test_gone.py: no radosgw"])


def test_without_ci_a_skipped_test_passes(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_skips=_SKIPS)
    result = suite.runpytest()
    assert result.ret == pytest.ExitCode.OK
    assert "CI=true" not in result.stdout.str()


def test_with_ci_a_session_without_tests_fails(
        suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    suite.makepyfile(test_layer="import pytest\n\n\n@pytest.mark.long\ndef test_x():\n    pass\n")
    assert suite.runpytest("-m", "not long").ret == pytest.ExitCode.NO_TESTS_COLLECTED
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest("-m", "not long")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["CI=true: no tests collected"])


def test_with_ci_collect_only_is_not_a_session_without_tests(
        suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    suite.makepyfile(test_suite=_suite_source())
    monkeypatch.setenv("CI", "true")
    assert _collect_for_ci(suite).ret == pytest.ExitCode.OK
