"""The demo's plan: configuration checks, the job manifest, failure targets, progress line."""

from __future__ import annotations

import pytest

from gemini_demo import plan
from gemini_demo.plan import DemoConfig

PLACEMENT = {
    "groups": [[0, 2], [1, 3]],
    "holders": {"0": [0, 2], "1": [1, 3], "2": [2, 0], "3": [3, 1]},
    "nodes": {"0": "node-0", "1": "node-1", "2": "node-4", "3": "node-3"},
}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"failures": ("trainer-crash", "meteor")}, "unknown failure kind(s) meteor"),
        ({"replicas": 5}, "--replicas must be between 1 and --workers (4)"),
        ({"replicas": 1}, "a group loss needs --replicas 2 or more"),
        ({"persist_interval": 0}, "--persist-interval must be at least 1 second"),
        ({"workers": 1}, "--workers must be between 2 and 16"),
        ({"model_size": "huge"}, "--model-size must be one of"),
        ({"steps": 5}, "--steps 5 is too few for 3 failure(s)"),
    ],
)
def test_a_bad_configuration_is_refused_with_what_to_change(
    kwargs: dict[str, object], message: str,
) -> None:
    with pytest.raises(ValueError, match=r".*") as err:
        DemoConfig(**kwargs)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_the_default_step_count_leaves_room_for_every_failure_and_the_s3_wait() -> None:
    crash_only = DemoConfig(failures=("trainer-crash",), warm_standby=False)
    everything = DemoConfig()
    assert crash_only.total_steps == plan.WARMUP_STEPS + 2 * plan.STEPS_BETWEEN
    # The group loss waits for a checkpoint in S3 (persisted every 30 s at the earliest).
    idle_steps = everything.total_steps - plan.WARMUP_STEPS - 4 * plan.STEPS_BETWEEN
    assert idle_steps * everything.step_sleep >= plan.PERSIST_INTERVAL_SECONDS
    # with one copy a node loss restores from S3: it waits for a checkpoint there too
    s3_only = DemoConfig(replicas=1, failures=("node-loss",), persist_interval=4)
    idle_steps = s3_only.total_steps - plan.WARMUP_STEPS - 2 * plan.STEPS_BETWEEN
    assert idle_steps * s3_only.step_sleep >= 4
    assert DemoConfig(replicas=1, failures=("trainer-crash",), warm_standby=False
                      ).total_steps == crash_only.total_steps


def test_the_persist_interval_reaches_the_manifest() -> None:
    manifest = plan.job_manifest(DemoConfig(persist_interval=1), "train.py", "http://s3",
                                 "bucket", "prefix")
    assert manifest["spec"]["persistence"]["intervalSeconds"] == 1


def test_spares_cover_every_node_the_failures_take_away() -> None:
    assert plan.spare_nodes(DemoConfig(failures=("trainer-crash",))) == 2
    assert plan.spare_nodes(DemoConfig()) == 1 + 2
    assert plan.spare_nodes(DemoConfig(workers=6, replicas=3)) == 1 + 3
    # a partitioned node is replaced too (healed later, it only then becomes a spare again)
    assert plan.spare_nodes(DemoConfig(failures=(*plan.DEFAULT_FAILURES, "partition"))) == 4


def test_the_default_failures_are_the_three_of_the_issue_and_a_partition_is_opt_in() -> None:
    assert DemoConfig().failures == ("trainer-crash", "node-loss", "group-loss")
    assert DemoConfig(failures=("partition",)).failures == ("partition",)
    with pytest.raises(ValueError, match="unknown failure kind"):
        DemoConfig(failures=("split-brain",))


def test_the_reference_gets_the_same_arguments_except_the_idling() -> None:
    config = DemoConfig(step_sleep=0.5)
    with_sleep = plan.trainer_args(config)
    assert with_sleep[-2:] == ["--step-sleep", "0.5"]
    assert plan.trainer_args(config, with_sleep=False) == with_sleep[:-2]
    assert "--engine" in with_sleep and with_sleep[with_sleep.index("--engine") + 1] == "deepspeed"


def test_the_job_checkpoints_every_iteration_and_persists_to_the_local_s3() -> None:
    config = DemoConfig(workers=4, replicas=2)
    job = plan.job_manifest(config, "/repo/examples/train_gpt_zero3.py", "http://127.0.0.1:7480",
                            "gemini", "demo-1")
    spec = job["spec"]
    assert spec["numNodes"] == 4
    assert spec["checkpoint"] == {"replicas": 2, "intervalIterations": 1}
    assert spec["persistence"]["bucketURI"] == "s3://gemini/demo-1"
    assert spec["persistence"]["endpoint"] == "http://127.0.0.1:7480"
    assert spec["persistence"]["credentialsSecretRef"] == {"name": plan.S3_SECRET}
    (trainer,) = spec["template"]["spec"]["containers"]
    assert trainer["name"] == "trainer"
    assert trainer["command"] == ["python", "/repo/examples/train_gpt_zero3.py"]
    assert trainer["args"] == plan.trainer_args(config)
    assert spec["failurePolicy"]["spareNodes"] == 3


def test_the_warm_standby_is_on_unless_turned_off() -> None:
    def policy(config: DemoConfig) -> dict[str, object]:
        job = plan.job_manifest(config, "/s.py", "http://s3", "b", "p")
        return dict(job["spec"]["failurePolicy"])

    assert policy(DemoConfig())["warmStandby"] is True
    assert policy(DemoConfig(warm_standby=False))["warmStandby"] is False


def test_failure_targets_come_from_the_placement() -> None:
    assert plan.trainer_crash_target(4) == 1
    assert plan.node_loss_target(PLACEMENT, 4) == "node-3"
    assert plan.group_loss_nodes(PLACEMENT) == ["node-0", "node-4"]
    # Without holders, the group containing rank 0 is used.
    assert plan.group_loss_nodes({"groups": [[1, 3], [0, 2]], "nodes": PLACEMENT["nodes"]}) == [
        "node-0", "node-4"]
    with pytest.raises(ValueError, match="no holders"):
        plan.group_loss_nodes({"nodes": {}})


def test_the_progress_line_shows_step_loss_checkpoints_state_and_event() -> None:
    status = {"state": "Recovering", "checkpoint": {"inMemoryStep": 12, "persistedStep": 9}}
    line = plan.progress_line(42.25, 13, 3.5, status, "NodeLost: node-3")
    assert line.split() == ["42.2s", "step", "13", "loss", "3.5000", "ckpt", "mem", "12", "s3",
                            "9", "Recovering", "NodeLost:", "node-3"]
    assert "step    -" in plan.progress_line(0.0, None, None, {}, "")


def test_a_failure_keeps_the_first_recovery_written_after_it_not_a_later_one() -> None:
    """A recovery after the failure's own (a later epoch: another crash once training
    resumed) is not the failure's; the report lists it apart."""
    before = {"epoch": 3, "source": "Peers"}
    own = {"epoch": 4, "source": "S3"}
    later = {"epoch": 5, "source": "Local"}
    assert not plan.is_own_recovery({}, before, {})
    assert not plan.is_own_recovery(before, before, {})  # the earlier failure's, still there
    assert plan.is_own_recovery(own, before, {})
    assert plan.is_own_recovery({**own, "message": "rewritten"}, before, own)
    assert not plan.is_own_recovery(later, before, own)
    assert plan.recovery_summary({**later, "message": "rank 1: exited with code 1"}) == {
        "epoch": 5, "cause": None, "source": "local", "failed_ranks": None,
        "message": "rank 1: exited with code 1", "restored_step": None, "detected_at": None}


@pytest.mark.parametrize(("raw", "name"), [("Local", "local"), ("Peers", "peer"), ("S3", "s3"),
                                           (None, ""), ("weird", "")])
def test_recovery_sources_are_named_as_the_report_spells_them(raw: str | None, name: str) -> None:
    assert plan.source_name(raw) == name


RUNNING = {"state": "Running", "placement": PLACEMENT, "checkpoint": {"inMemoryStep": 7}}


@pytest.mark.parametrize(
    ("kind", "step", "status", "expected"),
    [
        ("trainer-crash", 7, RUNNING, True),
        ("trainer-crash", 6, RUNNING, False),  # not enough progress since the last recovery
        ("trainer-crash", None, RUNNING, False),
        ("node-loss", 9, {**RUNNING, "state": "Recovering"}, False),
        ("node-loss", 9, {**RUNNING, "placement": None}, False),  # targets come from it
        ("node-loss", 9, {**RUNNING, "conditions": [{"type": "Recovering", "status": "True"}]},
         False),
        ("node-loss", 9, {**RUNNING, "conditions": [{"type": "Recovering", "status": "False"}]},
         True),
        ("group-loss", 9, RUNNING, False),  # nothing in S3 yet
        ("group-loss", 9, {**RUNNING, "checkpoint": {"persistedStep": 4}}, True),
    ],
)
def test_a_failure_is_injected_only_once_training_runs_and_progressed(
    kind: str, step: int | None, status: dict[str, object], expected: bool,
) -> None:
    assert plan.ready_to_inject(kind, step, 7, status) is expected


@pytest.mark.parametrize(
    ("kind", "persisted", "expected"),
    [
        ("node-loss", None, False),  # the only copy goes with the node: S3 must have one
        ("node-loss", 4, True),
        ("partition", None, False),
        ("trainer-crash", None, True),  # restored from the node's own memory
    ],
)
def test_with_one_copy_a_lost_node_waits_for_a_checkpoint_in_s3(
    kind: str, persisted: int | None, expected: bool,
) -> None:
    status = {**RUNNING, "checkpoint": {"inMemoryStep": 9, "persistedStep": persisted}}
    assert plan.ready_to_inject(kind, 9, 7, status, replicas=1) is expected


def test_a_slow_link_is_opt_in_takes_no_node_away_and_gets_its_steps() -> None:
    with_slow = DemoConfig(failures=(*plan.DEFAULT_FAILURES, "slow-link"))
    assert "slow-link" not in DemoConfig().failures
    assert plan.spare_nodes(with_slow) == plan.spare_nodes(DemoConfig())
    # one more failure's STEPS_BETWEEN, and the steps made through the slow link
    assert with_slow.total_steps == (DemoConfig().total_steps + plan.STEPS_BETWEEN
                                     + plan.SLOW_LINK_STEPS)


def test_the_slow_link_is_healed_after_its_steps() -> None:
    assert not plan.slow_link_over(10, None)
    assert not plan.slow_link_over(10, 10 + plan.SLOW_LINK_STEPS - 1)
    assert plan.slow_link_over(10, 10 + plan.SLOW_LINK_STEPS)
    assert plan.slow_link_over(None, plan.SLOW_LINK_STEPS)  # injected before any step printed


def test_a_warm_standby_crash_gets_steps_to_wait_for_the_standby() -> None:
    cold = DemoConfig(failures=("trainer-crash",), warm_standby=False)
    warm = DemoConfig(failures=("trainer-crash",))
    assert warm.steps_needed - cold.steps_needed == int(plan.STANDBY_WARM_S / warm.step_sleep)
    # pods with several processes keep a standby per process: they wait as well
    assert DemoConfig(failures=("trainer-crash",), procs_per_node=2).steps_needed > DemoConfig(
        failures=("trainer-crash",), procs_per_node=2, warm_standby=False).steps_needed
    # a node loss does not wait for a standby
    assert DemoConfig(failures=("node-loss",)).steps_needed == DemoConfig(
        failures=("node-loss",), warm_standby=False).steps_needed
