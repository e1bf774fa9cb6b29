# Over 500 lines: the demo's one run (bring-up, training through injected failures, the
# report) reads as one sequence; what stands alone is in crash, logs, report and reference.
"""`gemini demo` end to end: cluster, operator, job, failures, report, teardown.

The reference run starts first and runs while the cluster comes up; the job is submitted only
once it finished, so the failures' timings are not distorted by a second training run on the
same cores (docs/demo.md). SIGTERM and SIGINT stop it at any point through the same teardown
(gemini_demo.interrupt), unless --keep.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from gemini_demo import plan
from gemini_demo.crash import kill_training_process, launcher_gauge
from gemini_demo.interrupt import DemoInterrupted, SignalGuard
from gemini_demo.logs import StepLine, StepLog, resumption
from gemini_demo.plan import DemoConfig
from gemini_demo.reference import ReferenceRun, ReferenceRunError
from gemini_demo.reference_cache import ReferenceCache
from gemini_demo.report import FailureRecord, failure_row, losses_match
from gemini_local import cluster, faults, images
from gemini_local.processes import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_gpt_zero3.py"
CRD_PATH = REPO / "crds" / "geminijob.yaml"
POLL_S = 0.2
PRINT_EVERY_S = 1.0
RECOVERY_TIMEOUT_S = 240.0
START_TIMEOUT_S = 240.0


class DemoError(RuntimeError):
    """The demo cannot go on; the message says what went wrong and where to look."""


@dataclass(frozen=True)
class DemoOptions:
    config: DemoConfig
    state_dir: Path
    keep: bool = False
    plot: Path | None = None
    progress: TextIO = sys.stderr
    reference_cache: bool = True  # an earlier run of the same content serves as the reference


@dataclass
class Injected:
    kind: str
    target: str
    at: float
    generation: int
    detected_at: float | None = None
    resumed: tuple[StepLine, int] | None = None
    recovery: dict[str, Any] = field(default_factory=dict)  # status.lastRecovery after it
    earlier_recovery: dict[str, Any] = field(default_factory=dict)  # the one before it
    wall: float | None = None  # Unix time of the injection
    step_at: int | None = None  # the newest step printed when it was injected
    healed_at: float | None = None  # a slow link: when its node got its full speed back


class RecoveringWatch:
    """Times when the operator declared a recovery, from watches on the job (turning
    Recovering) and on its events (RecoveryNeeded arriving): a recovery that takes the
    operator under a second may never show in a polled status, and the API's timestamps have
    whole seconds only."""

    def __init__(self, custom: Any, core: Any, clock: Callable[[], float]) -> None:
        self.custom, self.core, self.clock = custom, core, clock
        self.turned: list[float] = []
        self.recovering = False
        self.seen: set[str] = set()
        self.started_unix: set[float] = set()
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(fn,), daemon=True)
                        for fn in (self._job, self._events)]

    def start(self) -> RecoveringWatch:
        for thread in self.threads:
            thread.start()
        return self

    def _loop(self, watch_once: Callable[[], None]) -> None:
        while not self.stopped.is_set():
            try:
                watch_once()
            except Exception:  # the API restarting or going away: watch again
                time.sleep(0.5)

    def _job(self) -> None:
        from kubernetes import watch

        for event in watch.Watch().stream(
                self.custom.list_namespaced_custom_object, "gemini.io", "v1beta1",
                plan.NAMESPACE, "geminijobs", field_selector=f"metadata.name={plan.JOB_NAME}",
                timeout_seconds=30):
            status = event["object"].get("status") or {}
            started = (status.get("recovery") or {}).get("startedUnix")
            if started is not None:  # the operator's own clock when it declared the recovery
                self.started_unix.add(float(started))
            now = recovering_now(status)
            if now and not self.recovering:
                self.turned.append(self.clock())
            self.recovering = now
            if self.stopped.is_set():
                return

    def _events(self) -> None:
        from kubernetes import watch

        for event in watch.Watch().stream(self.core.list_namespaced_event, plan.NAMESPACE,
                                          timeout_seconds=30):
            item = event["object"]
            # A new watch lists the old events again: each counts once.
            if item.reason == "RecoveryNeeded" and item.metadata.uid not in self.seen:
                self.seen.add(item.metadata.uid)
                self.turned.append(self.clock())
            if self.stopped.is_set():
                return

    def first_after(self, at: float, wall: float | None = None) -> float | None:
        """When the first recovery after `at` (demo clock; `wall`: the same instant in Unix
        time) was declared, in the demo's clock."""
        if wall is not None:
            started = min((t for t in list(self.started_unix) if t >= wall), default=None)
            if started is not None:
                return at + started - wall
        return min((t for t in list(self.turned) if t >= at), default=None)

    def stop(self) -> None:
        self.stopped.set()


def recovering_now(status: dict[str, Any]) -> bool:
    return status.get("state") == "Recovering" or any(
        c.get("type") == "Recovering" and c.get("status") == "True"
        for c in status.get("conditions") or [])


@dataclass(frozen=True)
class Pods:
    """What the job's pods run, by the kind of node."""

    images: tuple[str, ...]  # the Dockerfile's targets the nodes run (the operator: the host)
    script: str  # the training script as the trainer container sees it

    def image(self, target: str) -> str:
        return images.image_name(target) if self.images else "gemini:local"


# Node agents run this checkout's Python whatever a pod names; a kubelet node's pods run the
# images (the examples image has the script in /app). Either reaches the host (S3, the
# operator's hint server) at the cluster's `hostFromPods`.
NODE_AGENT_PODS = Pods(images=(), script=str(SCRIPT))
KUBELET_PODS = Pods(images=("sidecar", "examples"), script="/app/examples/train_gpt_zero3.py")


class Demo:
    def __init__(self, options: DemoOptions) -> None:
        self.options = options
        self.config = options.config
        self.pods = KUBELET_PODS if self.config.kubelet else NODE_AGENT_PODS
        self.state_dir = options.state_dir
        self.work = self.state_dir / "demo"
        self.t0 = time.monotonic()
        self.operator: subprocess.Popen[bytes] | None = None
        self.reference: ReferenceRun | None = None
        self.api: Any = None
        self.core: Any = None
        self.custom: Any = None
        self.kubeconfig: Path | None = None
        self.prefix = ""
        self.s3: dict[str, Any] = {}
        self.host_from_pods = "127.0.0.1"  # the host as the pods reach it (from `up`)
        self.events_seen: set[str] = set()
        self.timeline: list[str] = []  # what say() said, for the error report
        self._standby_wait_since: float | None = None
        self.watch: RecoveringWatch | None = None
        self.unplanned: dict[int, dict[str, Any]] = {}  # epoch -> lastRecovery (note_recovery)
        self.cluster_started = False
        self.guard = SignalGuard()
        self.log = StepLog(self.state_dir, plan.NAMESPACE, f"{plan.JOB_NAME}-worker-0",
                           started=self.t0)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def say(self, message: str) -> None:
        line = f"[{self.now():6.1f}s] {message}"
        self.timeline.append(line)
        print(line, file=self.options.progress, flush=True)

    # --- the whole run ---------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """The whole demo; SIGTERM or SIGINT at any point ends it with DemoInterrupted once
        everything it started is torn down (or left running with --keep)."""
        self.guard.install()
        try:
            try:
                return self._run()
            finally:
                # A signal during the teardown waits for its end (and then wins over the
                # report or an error: the process was asked to stop).
                with self.guard.shielded(raise_after=False):
                    note = self.clean_up()
                self.guard.raise_pending(note)
        finally:
            self.guard.uninstall()

    def clean_up(self) -> str:
        """Stop the reference run; tear down operator and cluster unless --keep. Says what
        became of the cluster."""
        if self.reference is not None:
            self.reference.stop()
        if not self.cluster_started:
            return "nothing was running yet"
        if self.options.keep:
            self.say("left running (--keep); explore with:\n" + self.explore_hint())
            return f"left running (--keep): gemini local --state-dir {self.state_dir} down"
        return self.teardown()

    def _run(self) -> dict[str, Any]:
        self.work.mkdir(parents=True, exist_ok=True)
        cache = ReferenceCache() if self.options.reference_cache else None
        with self.guard.shielded():  # a signal now would lose the handles of its processes
            self.reference = ReferenceRun(
                SCRIPT, plan.trainer_args(self.config, with_sleep=False), self.config.world,
                self.work, cache=cache).start()
        if self.reference.cached is not None:
            self.say(f"reference: {self.config.total_steps} steps from an earlier run of the "
                     f"same script, arguments, packages and CPU ({cache and cache.folder})")
        else:
            self.say(f"reference run: {self.config.world} local processes, "
                     f"{self.config.total_steps} steps")
        self.bring_up()
        self.say("waiting for the reference run to finish before submitting the job")
        try:
            reference = self.reference.wait(timeout=600)
        except ReferenceRunError as err:
            raise DemoError(str(err)) from err
        self.say(f"reference done: {len(reference)} steps")
        self.watch = RecoveringWatch(self.custom, self.core, self.now).start()
        self.submit()
        try:
            injected = self.train_and_inject()
        finally:
            self.watch.stop()
        return self.report(reference, injected)

    # --- set-up ------------------------------------------------------------------------------

    def bring_up(self) -> None:
        from kubernetes import client, config

        nodes = self.config.workers + plan.spare_nodes(self.config)
        self.say(f"local cluster: {nodes} nodes ({plan.spare_nodes(self.config)} spare) in 2 "
                 "zones, S3")
        try:
            info = cluster.up(self.state_dir, cluster.Topology(nodes=nodes, zones=2, racks=2),
                              with_s3=True, timeout=120, kubelet=self.config.kubelet,
                              images=self.pods.images, with_monitoring=self.config.monitoring)
            self.cluster_started = True  # from here on, teardown owns it
        except DemoInterrupted:
            # up stops what it started when interrupted; the teardown makes sure (and says so)
            self.cluster_started = True
            raise
        self.s3 = info["s3"]
        self.prometheus_url = (info.get("monitoring") or {}).get("url")
        self.host_from_pods = info["hostFromPods"]
        self.kubeconfig = Path(info["kubeconfig"])
        self.api = config.new_client_from_config(str(self.kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.install_crd()
        self.create_namespace()
        self.start_operator()

    def install_crd(self) -> None:
        import yaml
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        crd = yaml.safe_load(CRD_PATH.read_text())
        api = client.ApiextensionsV1Api(self.api)
        try:
            api.create_custom_resource_definition(crd)
        except ApiException as err:
            if err.status != 409:
                raise
        name = crd["metadata"]["name"]

        def established() -> bool:
            found: Any = api.read_custom_resource_definition(name)
            return any(c.type == "Established" and c.status == "True"
                       for c in found.status.conditions or [])

        wait_until(established, 30, f"the CRD {name} to be Established")
        self.say(f"CRD {name} installed")

    def create_namespace(self) -> None:
        from kubernetes.client.exceptions import ApiException

        body: Any = {"metadata": {"name": plan.NAMESPACE}}
        self.core.create_namespace(body)

        def has_service_account() -> bool:
            try:
                self.core.read_namespaced_service_account("default", plan.NAMESPACE)
                return True
            except ApiException:
                return False

        wait_until(has_service_account, 30, "the namespace's default ServiceAccount")
        secret: Any = {
            "metadata": {"name": plan.S3_SECRET},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in {
                "AWS_ACCESS_KEY_ID": self.s3["access_key"],
                "AWS_SECRET_ACCESS_KEY": self.s3["secret_key"],
                "AWS_REGION": self.s3.get("region", "us-east-1")}.items()},
        }
        self.core.create_namespaced_secret(plan.NAMESPACE, secret)

    def start_operator(self) -> None:
        log = self.work / "operator.log"
        command = [sys.executable, "-m", "gemini_cli", "operator", "run", "--kubeconfig",
                   str(self.kubeconfig), "--namespace", plan.NAMESPACE, "--lease-namespace",
                   plan.NAMESPACE, "--sidecar-image", self.pods.image("sidecar")]
        # Launchers tell it of a failure at once (gemini_operator.calls.hints); it serves on every
        # host address.
        hint_port = free_port()
        command += ["--hint-port", str(hint_port),
                    "--hint-url", f"http://{self.host_from_pods}:{hint_port}"]
        metrics_port = free_port() if self.prometheus_url else None
        if metrics_port is not None:
            command += ["--metrics-port", str(metrics_port)]
        # a signal now would lose the operator's handle: it waits until the handle is kept
        with self.guard.shielded(), open(log, "wb") as out:
            self.operator = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True, cwd=REPO)
        (self.work / "operator.pid").write_text(str(self.operator.pid))
        # `gemini local down` stops it too (after --keep, or a demo killed with SIGKILL)
        cluster.attach(self.state_dir, "demo-operator", self.operator.pid, sys.executable)
        self.say(f"operator started (pid {self.operator.pid}, log {log})")
        if metrics_port is not None:
            self.apply_monitors(metrics_port)

    def apply_monitors(self, operator_port: int) -> None:
        from gemini_demo import monitors

        try:
            made = monitors.apply(self.custom, monitors.objects_for(plan.NAMESPACE, operator_port))
        except monitors.MonitorsError as err:
            raise DemoError(str(err)) from err
        self.say(f"Prometheus {self.prometheus_url} scrapes and evaluates the chart's "
                 f"{', '.join(made)}")

    def submit(self) -> None:
        body = plan.job_manifest(self.config, self.pods.script, self.s3["podURL"],
                                 self.s3["bucket"], f"demo-{int(time.time())}",
                                 image=self.pods.image("examples"))
        self.prefix = body["spec"]["persistence"]["bucketURI"].split("/", 3)[3]
        self.custom.create_namespaced_custom_object(
            "gemini.io", "v1beta1", plan.NAMESPACE, "geminijobs", body)
        self.say(f"GeminiJob {plan.NAMESPACE}/{plan.JOB_NAME} submitted "
                 f"({self.config.workers} workers, m={self.config.replicas})")

    # --- training, failures ------------------------------------------------------------------

    def job(self) -> dict[str, Any]:
        found: Any = self.custom.get_namespaced_custom_object(
            "gemini.io", "v1beta1", plan.NAMESPACE, "geminijobs", plan.JOB_NAME)
        return dict(found)

    def train_and_inject(self) -> list[Injected]:
        pending = list(self.config.failures)
        done: list[Injected] = []
        current: Injected | None = None
        baseline_step = plan.WARMUP_STEPS
        last_print = 0.0
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.operator is not None and self.operator.poll() is not None:
                raise DemoError(self.stuck(f"the operator exited with code "
                                           f"{self.operator.returncode}"))
            self.log.poll()
            status = self.job().get("status") or {}
            state = status.get("state")
            event = self.new_events()
            if current is None and done:
                self.note_recovery(done[-1], status)
            elif current is None and (early := status.get("lastRecovery")):
                self.note_unplanned(early)
            if current is not None and current.kind == "slow-link":
                if self.heal_slow_link(current):
                    done.append(current)
                    baseline_step = (current.step_at or 0) + plan.SLOW_LINK_STEPS \
                        + plan.STEPS_BETWEEN
                    current = None
                elif self.now() - current.at > RECOVERY_TIMEOUT_S:
                    raise DemoError(self.stuck(f"training made no {plan.SLOW_LINK_STEPS} "
                                               f"steps through the slow link within "
                                               f"{RECOVERY_TIMEOUT_S:.0f}s"))
            elif current is not None:
                self.follow(current, status)
                if current.resumed is not None:
                    done.append(current)
                    self.say(f"{current.kind}: training resumed at step "
                             f"{current.resumed[0].step} after "
                             f"{current.resumed[0].seen_at - current.at:.1f}s")
                    baseline_step = current.resumed[0].step + plan.STEPS_BETWEEN
                    if current.kind == "partition":
                        faults.heal_node(self.state_dir, current.target)
                        self.say(f"HEAL partition: {current.target} (it rejoins as a spare)")
                    current = None
                elif self.now() - current.at > RECOVERY_TIMEOUT_S:
                    raise DemoError(self.stuck(f"{current.kind} on {current.target} was not "
                                               f"recovered within {RECOVERY_TIMEOUT_S:.0f}s"))
            if state in ("Succeeded", "Failed"):
                break
            newest = self.log.last()
            if newest is None and time.monotonic() > deadline:
                raise DemoError(self.stuck(f"the job printed no training step within "
                                           f"{START_TIMEOUT_S:.0f}s"))
            if current is None and pending and plan.ready_to_inject(
                    pending[0], newest.step if newest else None, baseline_step, status,
                    self.config.replicas) and self.standby_warm_for(pending[0]):
                current = self.inject(pending.pop(0), status)
            if time.monotonic() - last_print >= PRINT_EVERY_S or event:
                last_print = time.monotonic()
                print(plan.progress_line(self.now(), newest.step if newest else None,
                                         float.fromhex(newest.loss) if newest else None,
                                         status, event), file=self.options.progress, flush=True)
            time.sleep(POLL_S)
        if state == "Failed":
            raise DemoError(self.stuck("the job Failed"))
        if current is not None or pending:
            left = [current.kind] if current else []
            why = "raise --steps"
            if pending and plan.needs_s3(pending[0], self.config.replicas) and not (
                    status.get("checkpoint") or {}).get("persistedStep"):
                why = (f"the {pending[0]} waits for a checkpoint in S3, and "
                       "status.checkpoint.persistedStep stayed empty: check the sidecars' S3 "
                       "settings, or raise --steps")
            raise DemoError(f"training finished before these failures were recovered or "
                            f"injected: {', '.join(left + pending)}; {why}")
        self.log.poll()
        return done

    def standby_warm_for(self, kind: str) -> bool:
        """With the warm standby, a trainer crash waits until the target's launcher reports
        its standbys ready (gemini_launcher_standby_ready: all of the pod's processes'), for
        STANDBY_WARM_S at most; other failures need none."""
        if kind != "trainer-crash" or not self.config.standby_expected:
            return True
        pod = plan.trainer_crash_pod(self.config.workers)
        if launcher_gauge(self.core, plan.NAMESPACE, pod, "gemini_launcher_standby_ready") == 1:
            self._standby_wait_since = None
            return True
        if self._standby_wait_since is None:
            self._standby_wait_since = self.now()
            self.say(f"waiting for the warm standby of {pod} to finish its imports")
        elif self.now() - self._standby_wait_since > plan.STANDBY_WARM_S:
            self.say(f"the warm standby of {pod} was not ready after {plan.STANDBY_WARM_S} s; "
                     "crashing anyway (the replacement pays the rest of the imports)")
            self._standby_wait_since = None
            return True
        return False

    def inject(self, kind: str, status: dict[str, Any]) -> Injected:
        placement = status["placement"]
        generation = self.log.generation
        at, wall = self.now(), time.time()  # the failure happens with the first signal
        if kind == "trainer-crash":
            pod = plan.trainer_crash_pod(self.config.workers)
            kill_training_process(self.state_dir, plan.NAMESPACE, pod)
            target = pod
        elif kind == "node-loss":
            target = plan.node_loss_target(placement, self.config.workers)
            faults.lose_node(self.state_dir, target)
        elif kind == "partition":
            target = plan.node_loss_target(placement, self.config.workers)
            faults.partition_node(self.state_dir, target)
        elif kind == "slow-link":
            target = plan.node_loss_target(placement, self.config.workers)
            faults.slow_link(self.state_dir, target, plan.SLOW_LINK_RATE)
        else:
            lost = plan.group_loss_nodes(placement)
            for node in lost:
                faults.lose_node(self.state_dir, node)
            target = ",".join(lost)
        self.say(f"INJECT {kind}: {target}")
        newest = self.log.last()
        return Injected(kind, target, at, generation,
                        earlier_recovery=dict(status.get("lastRecovery") or {}), wall=wall,
                        step_at=newest.step if newest else None)

    def heal_slow_link(self, item: Injected) -> bool:
        """End the slow link once training made its steps through it; True when healed."""
        newest = self.log.last()
        if not plan.slow_link_over(item.step_at, newest.step if newest else None):
            return False
        faults.heal_node(self.state_dir, item.target)
        item.healed_at = self.now()
        self.say(f"HEAL slow-link: {item.target} back to full speed after "
                 f"{item.healed_at - item.at:.1f}s")
        return True

    def follow(self, current: Injected, status: dict[str, Any]) -> None:
        seen = self.watch.first_after(current.at, current.wall) if self.watch else None
        if seen is not None:
            current.detected_at = seen
        elif current.detected_at is None and recovering_now(status):
            current.detected_at = self.now()
        current.resumed = resumption(self.log.lines, current.at, current.generation)
        self.note_recovery(current, status)

    def note_recovery(self, item: Injected, status: dict[str, Any]) -> None:
        """Keep the first status.lastRecovery written after the failure as its own (it may be
        written a moment after training resumed); a later epoch's is another recovery, one no
        injected failure asked for (kept apart: report's unplanned_recoveries)."""
        last = dict(status.get("lastRecovery") or {})
        if plan.is_own_recovery(last, item.earlier_recovery, item.recovery):
            item.recovery = last
        elif plan.is_new_recovery(last, item.earlier_recovery):
            self.note_unplanned(last)

    def note_unplanned(self, record: dict[str, Any]) -> None:
        """A recovery no injected failure asked for, once per epoch."""
        self.unplanned.setdefault(int(record.get("epoch") or 0), dict(record))

    def new_events(self) -> str:
        fresh = []
        for e in self.core.list_namespaced_event(plan.NAMESPACE).items:
            if e.metadata.uid in self.events_seen or e.involved_object.kind != "GeminiJob":
                continue
            self.events_seen.add(e.metadata.uid)
            fresh.append(f"{e.reason}: {e.message}")
        return " | ".join(fresh)[:200]

    # --- report ------------------------------------------------------------------------------

    def report(self, reference: dict[int, str], injected: list[Injected]) -> dict[str, Any]:
        iteration = iteration_seconds(self.log.lines)
        costs = self.s3_costs()
        rows = []
        for index, item in enumerate(injected):
            until = injected[index + 1].at if index + 1 < len(injected) else float("inf")
            row = failure_row(
                self.record(item), self.matches_after(item, until, reference), iteration,
                costs[0] if costs else None, costs[1] if costs else None)
            row["operator_recovery"] = item.recovery  # status.lastRecovery as written
            if item.kind == "slow-link":  # nothing lost: the models of lost work do not apply
                row.update(model_wasted_seconds_gemini=None, model_wasted_seconds_s3_only=None,
                           slow_link=self.slow_link_summary(item))
            rows.append(row)
        everything = losses_match(self.log.losses(), reference)
        report: dict[str, Any] = {
            "iteration_seconds": round(iteration, 3),
            "steps": self.config.total_steps,
            "workers": self.config.workers,
            "procs_per_node": self.config.procs_per_node,
            "engine": self.config.engine,
            "replicas": self.config.replicas,
            "losses_match": everything,
            "failures": rows,
            "unplanned_recoveries": [plan.recovery_summary(self.unplanned[e])
                                     for e in sorted(self.unplanned)],
            "s3_checkpoint": None if costs is None else {
                "write_seconds": round(costs[0], 3), "read_seconds": round(costs[1], 3),
                "bytes": costs[2]},
            "state_dir": str(self.state_dir),
        }
        if self.prometheus_url:
            from gemini_demo import monitors

            report["monitoring"] = monitors.scraped(self.prometheus_url)
        if self.options.plot is not None:
            from gemini_demo.report import plot

            plot(str(self.options.plot), self.log.timeline(), reference, rows)
            report["plot"] = str(self.options.plot)
        (self.work / "report.json").write_text(json.dumps(report, indent=2))
        return report

    def record(self, item: Injected) -> FailureRecord:
        if item.kind == "slow-link":  # training goes on through it: no downtime, no recovery
            return FailureRecord(
                kind=item.kind, target=item.target, injected_at=item.at, detected_at=None,
                resumed_at=item.at, source="", last_step_before=item.step_at or 0,
                resumed_from_step=None)
        resumed = item.resumed
        recovery = item.recovery
        seen = self.watch.first_after(item.at, item.wall) if self.watch else None
        if seen is not None and (resumed is None or seen <= resumed[0].seen_at):
            item.detected_at = seen
        breakdown = downtime_breakdown(item.at, item.detected_at,
                                       resumed[0].seen_at if resumed else None, recovery)
        return FailureRecord(
            kind=item.kind, target=item.target, injected_at=item.at,
            detected_at=item.detected_at, resumed_at=resumed[0].seen_at if resumed else None,
            source=plan.source_name(recovery.get("source")),
            last_step_before=resumed[1] if resumed else 0,
            resumed_from_step=resumed[0].step if resumed else None,
            breakdown={k: float(v) for k, v in breakdown.items()},
            restored_step=self.log.restored_after(item.at))

    def matches_after(self, item: Injected, until: float, reference: dict[int, str]) -> bool:
        """The losses printed from the failure's resumption until the next failure equal the
        reference's, replayed steps included."""
        if item.kind == "slow-link":
            start = item.at
        elif item.resumed is None:
            return False
        else:
            start = item.resumed[0].seen_at
        after = [(line.step, line.loss) for line in self.log.lines
                 if start <= line.seen_at < until]
        return bool(after) and all(reference.get(step) == loss for step, loss in after)

    def slow_link_summary(self, item: Injected) -> dict[str, Any]:
        """How training fared through the slow link: its steps' median time against the
        run's (report.iteration_seconds)."""
        end = item.healed_at if item.healed_at is not None else float("inf")
        during = [line for line in self.log.lines if item.at <= line.seen_at <= end]
        return {"rate_bytes_per_second": plan.SLOW_LINK_RATE,
                "slowed_seconds": None if item.healed_at is None
                else round(item.healed_at - item.at, 2),
                "steps_slowed": len({line.step for line in during}),
                "iteration_seconds_slowed": round(iteration_seconds(during), 3)}

    def s3_costs(self) -> tuple[float, float, int] | None:
        import boto3

        from gemini_demo.s3cost import checkpoint_costs

        s3 = boto3.client("s3", endpoint_url=self.s3["url"],
                          aws_access_key_id=self.s3["access_key"],
                          aws_secret_access_key=self.s3["secret_key"],
                          region_name=self.s3.get("region", "us-east-1"))
        try:
            return checkpoint_costs(s3, self.s3["bucket"], self.prefix)
        except Exception as err:  # the baseline is optional, the report is not
            self.say(f"could not time S3 for the baseline: {err}")
            return None

    # --- diagnostics and teardown ------------------------------------------------------------

    def stuck(self, what: str) -> str:
        lines = [what, "", "what happened:", *self.timeline[-12:], "",
                 f"operator log ({self.work / 'operator.log'}), last lines:"]
        lines += tail(self.work / "operator.log", 25)
        try:
            status = self.job().get("status") or {}
            lines += ["", f"job state: {status.get('state')}", "conditions:"]
            lines += [f"  {c.get('type')}={c.get('status')} {c.get('reason')}: "
                      f"{c.get('message')}" for c in status.get("conditions") or []]
        except Exception as err:  # diagnostics must not hide the error
            lines.append(f"(the job could not be read: {err})")
        lines += ["", "rank 0's trainer, last lines:"]
        files = self.log.files()
        lines += tail(files[-1], 15) if files else ["(no output yet)"]
        return "\n".join(lines)

    def explore_hint(self) -> str:
        kubectl = f"kubectl --kubeconfig {self.kubeconfig}"
        return "\n".join([
            f"  {kubectl} -n {plan.NAMESPACE} get geminijobs,pods -o wide",
            f"  {kubectl} -n {plan.NAMESPACE} get geminijob {plan.JOB_NAME} -o yaml",
            f"  {kubectl} -n {plan.NAMESPACE} logs {plan.JOB_NAME}-worker-0 -c trainer",
            f"  {kubectl} get nodes -L topology.kubernetes.io/zone",
            f"  operator log: {self.work / 'operator.log'}",
            f"  tear down (the operator too): gemini local --state-dir {self.state_dir} down",
        ])

    def teardown(self) -> str:
        if self.operator is not None and self.operator.poll() is None:
            os.killpg(self.operator.pid, signal.SIGTERM)
            try:
                self.operator.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.operator.pid, signal.SIGKILL)
                self.operator.wait()
        stopped = cluster.down(self.state_dir)
        self.say(f"torn down ({len(stopped)} components)")
        return f"tore down the operator, cluster and S3 in {self.state_dir}"


def downtime_breakdown(injected: float, detected: float | None, resumed: float | None,
                       recovery: dict[str, Any]) -> dict[str, float]:
    """Where the downtime went: detection (as the demo saw the job turn Recovering), the
    operator's phases (status.lastRecovery.breakdown), and the rest until the first step,
    which is the training processes starting again (imports, process group, restore)."""
    if detected is None or resumed is None:
        return {}
    phases = {str(k): float(v) for k, v in (recovery.get("breakdown") or {}).items()}
    operator = float(recovery.get("durationSeconds") or sum(phases.values()))
    return {"detection": detected - injected, **phases,
            "trainer_restart": max(0.0, resumed - detected - operator)}


def iteration_seconds(lines: list[StepLine]) -> float:
    """Median time between consecutive steps of one process, recoveries excluded."""
    gaps = [b.seen_at - a.seen_at for a, b in itertools.pairwise(lines)
            if b.generation == a.generation and b.step == a.step + 1]
    return statistics.median(gaps) if gaps else 0.0


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}")


def tail(path: Path, lines: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return [f"({path} cannot be read)"]


def run_demo(options: DemoOptions) -> dict[str, Any]:
    return Demo(options).run()
