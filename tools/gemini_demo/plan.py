"""What the demo runs and breaks, decided from its options: pure, no I/O.

The job manifest, the trainer's arguments (shared with the reference run so the losses can be
compared bit for bit), how many spare nodes the failures need, which nodes a whole placement
group lives on, and the one-line progress readout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FAILURE_KINDS = ("trainer-crash", "node-loss", "group-loss", "partition", "slow-link")
# What the demo injects unless told: the issue's three; a partition (cut off, then healed once
# training resumed) is opt-in since its detection waits for the node's heartbeat grace, and so
# is a slow link (training rides through it: nothing to recover).
DEFAULT_FAILURES = ("trainer-crash", "node-loss", "group-loss")
# The slow link: the last rank's node is policed to this rate each way for SLOW_LINK_STEPS
# steps, then healed. The tiny model moves some hundred KB per rank and step (ZeRO-3 gathers
# and reduce-scatter, the replica): a quarter MiB/s stretches a step visibly (2 workers:
# 1.06 s against 0.64 s, docs/demo.md), far from the hang timeout.
SLOW_LINK_RATE = 256 * 1024  # bytes per second
SLOW_LINK_STEPS = 8
MODEL_SIZES: Mapping[str, tuple[str, ...]] = {
    # (layers, d_model, heads): tiny keeps a step well under a second on one core.
    "tiny": ("--layers", "1", "--d-model", "32", "--heads", "2"),
    "small": ("--layers", "2", "--d-model", "64", "--heads", "4"),
    # bench/headline.py: about 90 M parameters, mostly the token embedding and the output
    # head, so ZeRO-3 over 4 ranks checkpoints 271 MB per rank (fp32 weights and Adam's two
    # moments) while a step of 16 tokens stays a few seconds on 2 cores.
    "headline": ("--layers", "2", "--d-model", "512", "--heads", "4", "--vocab", "84000",
                 "--seq", "16", "--batch", "1"),
}
# The example's training stacks. DDP rebuilds its gradient buckets after its first iteration,
# so a restarted DDP of more than two gloo ranks sums some gradients in another order (1 ulp):
# its losses match a reference only with two ranks in all.
ENGINES = ("deepspeed", "zero2", "zero1", "fsdp2", "ddp")  # deepspeed: ZeRO-3
_ZERO_STAGES = {"zero1": "1", "zero2": "2"}
JOB_NAME = "gpt-demo"
NAMESPACE = "gemini-demo"
S3_SECRET = "demo-s3"
PERSIST_INTERVAL_SECONDS = 30  # the demo's default: a checkpoint in S3 soon after the start


@dataclass(frozen=True)
class DemoConfig:
    workers: int = 4
    replicas: int = 2
    model_size: str = "tiny"
    steps: int | None = None  # None: enough for the failures (steps_needed)
    failures: tuple[str, ...] = DEFAULT_FAILURES
    step_sleep: float = 0.5  # idle per step: stretches the run so failures land mid-training
    seed: int = 1234
    warm_standby: bool = True  # launchers keep a pre-imported interpreter for restarts
    procs_per_node: int = 1  # training processes per worker pod (numProcPerNode)
    engine: str = "deepspeed"
    persist_interval: int = PERSIST_INTERVAL_SECONDS  # persistence.intervalSeconds
    kubelet: bool = False  # real kubelet nodes running the Dockerfile's images
    monitoring: bool = False  # Prometheus and the chart's monitors and rules (monitors.py)

    def __post_init__(self) -> None:
        unknown = [f for f in self.failures if f not in FAILURE_KINDS]
        if unknown:
            raise ValueError(f"unknown failure kind(s) {', '.join(unknown)}; choose from "
                             f"{', '.join(FAILURE_KINDS)}")
        if self.model_size not in MODEL_SIZES:
            raise ValueError(f"--model-size must be one of {', '.join(MODEL_SIZES)}")
        if not 2 <= self.workers <= 16:
            raise ValueError(f"--workers must be between 2 and 16, got {self.workers}")
        if not 1 <= self.replicas <= self.workers:
            raise ValueError(f"--replicas must be between 1 and --workers ({self.workers}), "
                             f"got {self.replicas}")
        if self.replicas == 1 and "group-loss" in self.failures:
            raise ValueError("a group loss needs --replicas 2 or more (with one copy, a node "
                             "loss already restores from S3)")
        if self.persist_interval < 1:
            raise ValueError(f"--persist-interval must be at least 1 second, got "
                             f"{self.persist_interval}")
        if not 1 <= self.procs_per_node <= 8:
            raise ValueError(f"--procs-per-node must be between 1 and 8, got "
                             f"{self.procs_per_node}")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}")
        if self.engine == "ddp" and self.world > 2:
            raise ValueError("--engine ddp compares with the reference bit for bit only with "
                             "two ranks in all (DDP rebuilds its buckets after a restart)")
        if self.steps is not None and self.steps < self.steps_minimum:
            raise ValueError(f"--steps {self.steps} is too few for {len(self.failures)} "
                             f"failure(s); use at least {self.steps_minimum}")

    @property
    def steps_minimum(self) -> int:
        """Fewer steps leave no room for the failures. A failure restored from S3 also needs
        a checkpoint there in time: steps_needed allows for it; explicit --steps may not (the
        demo then says to raise them)."""
        slowed = SLOW_LINK_STEPS * self.failures.count("slow-link")
        return WARMUP_STEPS + STEPS_BETWEEN * (len(self.failures) + 1) + slowed

    @property
    def steps_needed(self) -> int:
        # Warm-up, then STEPS_BETWEEN good steps before each failure and after the last one;
        # a failure restored from S3 also waits for a checkpoint there (persist_interval).
        wait_s3 = 0
        if any(needs_s3(kind, self.replicas) for kind in self.failures):
            wait_s3 = int(self.persist_interval * 1.5 / max(self.step_sleep, 0.1))
        wait_standby = 0
        if self.standby_expected and "trainer-crash" in self.failures:
            wait_standby = int(STANDBY_WARM_S / max(self.step_sleep, 0.1))
        # both count from the start: the S3 checkpoint is made while the standby warms
        return self.steps_minimum + max(wait_s3, wait_standby)

    @property
    def standby_expected(self) -> bool:
        """Launchers keep a warm standby per training process (with several per pod too)."""
        return self.warm_standby

    @property
    def world(self) -> int:
        """Training processes in all: the reference run starts as many."""
        return self.workers * self.procs_per_node

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else self.steps_needed


WARMUP_STEPS = 3
# With --warm-standby a trainer crash waits for the target's standby to finish its imports
# (10-15 s of training here: it imports at a low priority while training runs), so the
# figure is that of a warm standby, as in a job failing hours in; steps for that wait.
STANDBY_WARM_S = 30
STEPS_BETWEEN = 4


def spare_nodes(config: DemoConfig) -> int:
    """Two spares at least, more when the failures replace more nodes than that."""
    lost = (("node-loss" in config.failures) + ("partition" in config.failures)
            + config.replicas * ("group-loss" in config.failures))
    return max(2, lost)


def trainer_args(config: DemoConfig, with_sleep: bool = True) -> list[str]:
    """The example's arguments. Everything but --step-sleep shapes the losses, so the
    reference uses the same list without the idling."""
    engine = ["--engine", config.engine]
    if config.engine in _ZERO_STAGES:
        engine = ["--engine", "deepspeed", "--zero-stage", _ZERO_STAGES[config.engine]]
    args = [*engine, "--steps", str(config.total_steps),
            *MODEL_SIZES[config.model_size], "--seed", str(config.seed)]
    if with_sleep and config.step_sleep:
        args += ["--step-sleep", str(config.step_sleep)]
    return args


def job_manifest(config: DemoConfig, script: str, s3_url: str, bucket: str,
                 prefix: str, image: str = "gemini:local") -> dict[str, Any]:
    """The GeminiJob (v1beta1, a pod template): procs_per_node trainers per node, a checkpoint
    every iteration, S3 persistence."""
    trainer = {
        "name": "trainer",
        "image": image,  # node agents run the host's Python whatever it names
        "command": ["python", script],
        "args": trainer_args(config),
        "env": [{"name": "OMP_NUM_THREADS", "value": "1"},
                {"name": "PYTHONUNBUFFERED", "value": "1"}],
    }
    return {
        "apiVersion": "gemini.io/v1beta1",
        "kind": "GeminiJob",
        "metadata": {"name": JOB_NAME, "namespace": NAMESPACE},
        "spec": {
            "numNodes": config.workers,
            "numProcPerNode": config.procs_per_node,
            "template": {"metadata": {"labels": {"app.kubernetes.io/part-of": "gemini-demo"}},
                         "spec": {"containers": [trainer]}},
            "checkpoint": {"replicas": config.replicas, "intervalIterations": 1},
            "persistence": {
                "bucketURI": f"s3://{bucket}/{prefix}",
                "endpoint": s3_url,
                "credentialsSecretRef": {"name": S3_SECRET},
                "intervalSeconds": config.persist_interval,
                "keep": 2,
            },
            "failurePolicy": {"maxRestarts": 20, "hangTimeoutSeconds": 120,
                              "spareNodes": spare_nodes(config),
                              "warmStandby": config.warm_standby},
        },
    }


def trainer_crash_target(workers: int) -> int:
    """The rank whose trainer crashes: rank 1 (rank 0 holds the rendezvous; a crash
    elsewhere is the common case)."""
    return 1 if workers > 1 else 0


def trainer_crash_pod(workers: int) -> str:
    return f"{JOB_NAME}-worker-{trainer_crash_target(workers)}"


def node_loss_target(placement: Mapping[str, Any], workers: int) -> str:
    """The node of the last rank (lost, cut off by a partition, or slowed)."""
    return str(placement["nodes"][str(workers - 1)])


def slow_link_over(step_at_injection: int | None, newest_step: int | None) -> bool:
    """Heal the slowed node once training made SLOW_LINK_STEPS steps through the slow link."""
    if newest_step is None:
        return False
    return newest_step >= (step_at_injection or 0) + SLOW_LINK_STEPS


def group_loss_nodes(placement: Mapping[str, Any]) -> list[str]:
    """Every node holding rank 0's shard (its own and its replicas): with them gone, that
    shard survives only in S3. status.placement: holders rank -> [ranks], nodes rank -> node."""
    holders = placement.get("holders", {}).get("0")
    if not holders:
        groups: Sequence[Sequence[int]] = placement.get("groups", [])
        holders = next((g for g in groups if 0 in g), None)
    if not holders:
        raise ValueError(f"status.placement names no holders of rank 0's shard: {placement}")
    return sorted({str(placement["nodes"][str(r)]) for r in holders})


def needs_s3(kind: str, replicas: int) -> bool:
    """Whether this failure leaves some shard only in S3: a group loss always, a lost or cut
    off node when nobody else holds a copy (m = 1)."""
    return kind == "group-loss" or (replicas == 1 and kind in ("node-loss", "partition"))


def ready_to_inject(kind: str, newest_step: int | None, not_before_step: int,
                    status: Mapping[str, Any], replicas: int = 2) -> bool:
    """Inject the next failure once the job runs, has a placement, made progress past
    `not_before_step`, and (when it leaves a shard only in S3, needs_s3) has a checkpoint in
    S3."""
    if status.get("state") != "Running" or not status.get("placement"):
        return False
    if any(c.get("type") == "Recovering" and c.get("status") == "True"
           for c in status.get("conditions") or []):
        return False  # the previous recovery is not finished in the operator's view
    if newest_step is None or newest_step < not_before_step:
        return False
    return not needs_s3(kind, replicas) or (status.get("checkpoint") or {}).get(
        "persistedStep") is not None


def progress_line(elapsed: float, step: int | None, loss: float | None,
                  status: Mapping[str, Any], event: str) -> str:
    """One line of the live readout."""
    checkpoint = status.get("checkpoint") or {}
    parts = [
        f"{elapsed:6.1f}s",
        f"step {step if step is not None else '-':>4}",
        f"loss {loss:.4f}" if loss is not None else "loss    -  ",
        f"ckpt mem {_dash(checkpoint.get('inMemoryStep'))} s3 "
        f"{_dash(checkpoint.get('persistedStep'))}",
        f"{status.get('state') or 'Pending':<10}",
    ]
    line = "  ".join(parts)
    return f"{line}  {event}" if event else line


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def is_new_recovery(last: Mapping[str, Any], before: Mapping[str, Any]) -> bool:
    """Whether status.lastRecovery `last` was written since `before` was there."""
    return bool(last) and last != before


def is_own_recovery(last: Mapping[str, Any], before: Mapping[str, Any],
                    kept: Mapping[str, Any]) -> bool:
    """Whether status.lastRecovery `last` is the failure's own: the first one written after
    it (`before` was there at the injection), or the same epoch as the one `kept`; a later
    epoch is another recovery."""
    return is_new_recovery(last, before) and (not kept or last.get("epoch") == kept.get("epoch"))


def recovery_summary(record: Mapping[str, Any]) -> dict[str, Any]:
    """What the report keeps of a status.lastRecovery no injected failure asked for."""
    return {"epoch": record.get("epoch"), "cause": record.get("cause"),
            "source": source_name(record.get("source")),
            "failed_ranks": record.get("failedRanks"), "message": record.get("message"),
            "restored_step": record.get("restoredStep"), "detected_at": record.get("detectedAt")}


def source_name(raw: str | None) -> str:
    """status.lastRecovery.source (Local | Peers | S3) as the report spells it."""
    return {"local": "local", "peers": "peer", "peer": "peer", "s3": "s3"}.get(
        (raw or "").lower(), "")
