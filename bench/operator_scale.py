# Over 500 lines: a benchmark script, runnable alone: its cluster set-up, the 1000-rank job,
# the lost ranks and the report in one file.
"""The operator at scale on kwok's fake nodes: a 1000-rank GeminiJob, then 10 lost ranks.

Starts its own control plane, kwok and 1010 fake nodes (3 zones, 100 racks) in a temporary
directory, installs crds/geminijob.yaml and runs `gemini operator run` as a subprocess. Then,
per run (medians over --runs):
- create -> all 1000 worker pods created and the job's status populated (status.workers.ready
  == 1000 and status.placement covering every rank); target <= 60 s;
- 10 nodes holding ranks lost (`kwok_lose_node`: conditions Unknown, unreachable taints;
  timed from the last of the ten, `loss_spread_s` after the first) ->
  the recovery planned for every lost rank (status.recovery.plan.replaceRanks, or
  status.lastRecovery.failedRanks once finished) and a replacement pod created for each;
  target <= 5 s. Also shown: until the recovery is recorded as finished and the replacements
  run.
Baselines from the same run: a plain client creating the same 1000 one-per-node pods until all
Running (what the scheduler and kwok allow without an operator), and a plain client deleting
10 pods (grace 0) and creating their replacements (skipped with --no-baseline).
What fake nodes imply for the operator: nothing runs, so no sidecar answers (pod IPs are
loopback addresses where a connection is refused at once), and pods on a lost node stay
Terminating after eviction until someone deletes them with grace 0, as with a dead kubelet.
If the operator is missing or a step never happens, the message says what is missing (with
the operator's last warning), the JSON lines carry "value": null and that "error", the steps
measured before it are still shown, and no further runs are made; never a made-up number.
Then the creation JSON line, the recovery JSON line, and last a JSON line with the worse of
the two as a fraction of its target (<= 1: both targets met).
Ctrl-C or SIGTERM (a timeout) stops it cleanly: what it started is torn down (exit 130/143).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.cleanup import Cleanup, cleaning_up

from gemini import rank_detail
from gemini_local import kwok, processes
from gemini_local.controlplane import REPO_ROOT, ControlPlane

CRD = REPO_ROOT / "crds" / "geminijob.yaml"
# `python -m gemini_cli` rather than the `gemini` script: the pid file then names the
# interpreter that really runs (processes.running_pid compares it).
GEMINI = [sys.executable, "-m", "gemini_cli"]
GROUP, VERSION, PLURAL = "gemini.io", "v1beta1", "geminijobs"
LABEL_JOB, LABEL_RANK = "gemini.io/job-name", "gemini.io/rank"
NAMESPACE = "scale"
ZONES, RACKS = 3, 100
CREATE_TARGET_S, RECOVERY_TARGET_S = 60.0, 5.0
GPU = "nvidia.com/gpu"


class BenchError(RuntimeError):
    """A step did not happen; the message says what is missing."""


# ---------------------------------------------------------------------------------------------
# Watching pods: one raw watch, first-seen times per pod uid (the Python models are too slow).


@dataclass
class PodRecord:
    name: str
    rank: int
    uid: str
    seen: float  # wall clock, first event
    node: str = ""
    running: float | None = None
    deleting: bool = False
    gone: bool = False


@dataclass
class PodWatch:
    """Every worker pod of a namespace, by uid, kept current by a background watch."""

    core: Any
    namespace: str
    pods: dict[str, PodRecord] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                self._watch_once()
        except BaseException as err:  # surfaced by the waits
            self.error = err

    def _watch_once(self) -> None:
        listing = json.loads(self.core.list_namespaced_pod(
            self.namespace, label_selector=LABEL_JOB, _preload_content=False).data)
        for pod in listing["items"]:
            self._apply("ADDED", pod)
        resp = self.core.list_namespaced_pod(
            self.namespace, label_selector=LABEL_JOB, watch=True, timeout_seconds=300,
            resource_version=listing["metadata"]["resourceVersion"],
            allow_watch_bookmarks=False, _preload_content=False)
        buf = b""
        for chunk in resp.stream(65536, decode_content=True):
            if self.stop.is_set():
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.strip():
                    event = json.loads(line)
                    if event["type"] == "ERROR":
                        return  # e.g. 410 Gone: list again
                    self._apply(event["type"], event["object"])
        resp.release_conn()

    def _apply(self, kind: str, pod: dict[str, Any]) -> None:
        now = time.time()
        meta, status = pod["metadata"], pod.get("status") or {}
        with self.lock:
            rec = self.pods.get(meta["uid"])
            if rec is None:
                rec = PodRecord(meta["name"], int(meta["labels"].get(LABEL_RANK, -1)),
                                meta["uid"], now)
                self.pods[meta["uid"]] = rec
            rec.node = (pod.get("spec") or {}).get("nodeName") or ""
            if rec.running is None and status.get("phase") == "Running" and status.get("podIP"):
                rec.running = now
            rec.deleting = meta.get("deletionTimestamp") is not None
            rec.gone = kind == "DELETED"

    def snapshot(self) -> list[PodRecord]:
        if self.error is not None:
            raise BenchError(f"watching pods failed: {self.error!r}")
        with self.lock:
            return [PodRecord(**vars(r)) for r in self.pods.values()]


def wait_for(what: Callable[[], str | None], timeout: float, interval: float = 0.05) -> float:
    """Poll `what` (None: done; else a description of what is still missing); wall time done."""
    deadline = time.monotonic() + timeout
    missing: str | None = "not checked"
    while time.monotonic() < deadline:
        missing = what()
        if missing is None:
            return time.time()
        time.sleep(interval)
    raise BenchError(f"after {timeout:.0f} s: {missing}")


# ---------------------------------------------------------------------------------------------
# The operator


def check_operator_available() -> None:
    if not CRD.exists():
        raise BenchError(f"the GeminiJob CRD {CRD} is missing")
    result = subprocess.run([*GEMINI, "operator", "run", "--help"], capture_output=True,
                            text=True, check=False)
    if result.returncode != 0:
        raise BenchError("`gemini operator run` is not available: "
                         f"{(result.stderr or result.stdout).strip()[-500:]}")


def apply_crd(api: Any) -> None:
    import yaml
    from kubernetes import client

    crd = yaml.safe_load(CRD.read_text())
    ext: Any = client.ApiextensionsV1Api(api)
    ext.create_custom_resource_definition(crd)
    name = crd["metadata"]["name"]

    def established() -> str | None:
        raw = json.loads(ext.read_custom_resource_definition(name, _preload_content=False).data)
        conds = (raw.get("status") or {}).get("conditions") or []
        ok = any(c["type"] == "Established" and c["status"] == "True" for c in conds)
        return None if ok else f"CRD {name} not Established"

    wait_for(established, 30, 0.1)


def start_operator(plane: ControlPlane) -> tuple[int, Path]:
    port = processes.free_port()
    argv = [*GEMINI, "operator", "run", f"--kubeconfig={plane.kubeconfig}",
            f"--metrics-port={port}", "--log-level=INFO"]
    pid = processes.spawn("operator", argv, plane.pid_dir, plane.log_dir,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return pid, plane.log_dir / "operator.log"


def operator_alive(plane: ControlPlane, log: Path) -> None:
    if processes.running_pid("operator", plane.pid_dir) is None:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise BenchError(f"the operator exited; end of {log}:\n{tail}")


def job_manifest(name: str, ranks: int, spare_nodes: int) -> dict[str, Any]:
    # The trainer never runs on fake nodes; image and command only have to be valid.
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GeminiJob",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "numNodes": ranks,
            "template": {
                "image": "gemini-operator:dev", "command": ["python", "-m", "train"],
                "resourcesPerNode": {"requests": {"cpu": "4", "memory": "16Gi", GPU: "8"},
                                     "limits": {GPU: "8"}},
            },
            "checkpoint": {"replicas": 2, "sidecar": {"image": "gemini-operator:dev"}},
            "failurePolicy": {"spareNodes": spare_nodes, "maxRestarts": 100},
        },
    }


# ---------------------------------------------------------------------------------------------
# One run


@dataclass
class RunResult:
    """One run's measured steps (s) and, per target, what never happened."""

    operator_log: Path
    log_start: int = 0  # the log's size when the run began: older complaints are not its own
    steps: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # "create" / "recovery" -> why
    cleanup_error: str = ""  # the run's figures stand; no further run on an unclean cluster

    def step(self, name: str, since: float, at: float) -> float:
        self.steps[name] = at - since
        print(f"  {name}: {at - since:.2f}", file=sys.stderr, flush=True)
        return at

    def attempt(self, target: str, name: str, since: float,
                what: Callable[[], str | None], timeout: float, interval: float = 0.05,
                ) -> float | None:
        """Wait for a step of `target`; on a timeout record why and return None."""
        try:
            return self.step(name, since, wait_for(what, timeout, interval))
        except BenchError as err:
            why = f"{name}: {err}{last_operator_complaint(self.operator_log, self.log_start)}"
            self.errors.setdefault(target, why)
            print(f"  never: {why}", file=sys.stderr, flush=True)
            return None


def job_status(custom: Any, name: str, sizes: list[int] | None = None) -> dict[str, Any]:
    """The job's full status (per-rank maps joined in from its rank-detail ConfigMap when
    the status names one); `sizes` gets the stored status's size in bytes."""
    from kubernetes import client

    resp = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name,
                                               _preload_content=False)
    stored = json.loads(resp.data).get("status") or {}
    if sizes is not None:
        sizes.append(len(json.dumps(stored, separators=(",", ":"))))
    core = client.CoreV1Api(custom.api_client)

    def configmap(cm: str) -> dict[str, Any]:
        raw: Any = core.read_namespaced_config_map(cm, NAMESPACE, _preload_content=False)
        return dict(json.loads(raw.data))  # the HTTP response, not the typed ConfigMap

    return rank_detail.resolve(stored, configmap)


def one_run(plane: ControlPlane, api: Any, watch: PodWatch, log: Path, name: str, ranks: int,
            lost: int, spare_nodes: int, timeout: float, recovery_timeout: float,
            ) -> RunResult:
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    t0 = time.time()
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL,
                                           job_manifest(name, ranks, spare_nodes))

    def live() -> list[PodRecord]:
        operator_alive(plane, log)
        return [p for p in watch.snapshot() if not p.gone and not p.deleting]

    def all_created() -> str | None:
        n = len({p.rank for p in live()})
        return None if n == ranks else f"the operator created {n} of {ranks} worker pods"

    def all_running() -> str | None:
        n = sum(p.running is not None for p in live())
        return None if n == ranks else f"{n} of {ranks} worker pods Running on fake nodes"

    sizes: list[int] = []  # the stored status's bytes, each time it is read

    def populated() -> str | None:
        status = job_status(custom, name, sizes)
        ready = (status.get("workers") or {}).get("ready", 0)
        placed = len((status.get("placement") or {}).get("nodes") or {})
        if ready == ranks and placed == ranks:
            return None
        return (f"status.workers.ready is {ready} and status.placement.nodes covers {placed} "
                f"of {ranks} ranks (state {status.get('state')!r})")

    result = RunResult(log, log.stat().st_size if log.exists() else 0)
    t_created = result.step("pods_created_s", t0, wait_for(all_created, timeout))
    result.step("pods_running_s", t0, wait_for(all_running, timeout))
    t_status = result.attempt("create", "status_populated_s", t0, populated, timeout, 0.2)
    if t_status is not None:
        result.steps["create_total_s"] = max(t_created, t_status) - t0

    # Lose `lost` nodes that hold ranks, spread over the job.
    pods = sorted(live(), key=lambda p: p.rank)
    victims = [pods[i * len(pods) // lost] for i in range(lost)]
    old_uids = {p.uid for p in victims}
    lost_ranks = {p.rank for p in victims}
    time.sleep(2.0)  # a steady state before the failure
    with ThreadPoolExecutor(lost) as pool:
        stamps = list(pool.map(lambda p: kwok.kwok_lose_node(plane.kubeconfig, p.node),
                               victims))
    # On a busy API server the ten losses take seconds to write: time from the last one (each
    # stamp is taken before its node's conditions are written, so this is not lenient).
    t_loss = max(s.timestamp() for s in stamps)
    result.steps["loss_spread_s"] = t_loss - min(s.timestamp() for s in stamps)
    lost_nodes = {p.node for p in victims}

    def replaced() -> str | None:
        new = [p for p in live() if p.rank in lost_ranks and p.uid not in old_uids]
        if len({p.rank for p in new}) == lost:
            return None
        return f"replacement pods exist for {len({p.rank for p in new})} of {lost} lost ranks"

    planned_ranks: set[int] = set()  # over time: the ten may be planned in batches

    def planned() -> str | None:
        status = job_status(custom, name, sizes)
        plan = (status.get("recovery") or {}).get("plan") or {}
        planned_ranks.update(plan.get("replaceRanks") or [])
        planned_ranks.update((status.get("lastRecovery") or {}).get("failedRanks") or [])
        if lost_ranks <= planned_ranks:
            return None
        return (f"status.recovery.plan.replaceRanks and lastRecovery.failedRanks showed "
                f"{sorted(planned_ranks)[:20]}, not all of {sorted(lost_ranks)}")

    recorded_ranks: set[int] = set()  # over time: the ten may be recovered in batches

    def recorded() -> str | None:
        rec = job_status(custom, name).get("lastRecovery") or {}
        recorded_ranks.update(rec.get("failedRanks") or [])
        if lost_ranks <= recorded_ranks:
            return None
        return (f"status.lastRecovery.failedRanks showed {sorted(recorded_ranks)[:20]}, "
                f"not all of {sorted(lost_ranks)}")

    def replacements_running() -> str | None:
        new = [p for p in live() if p.rank in lost_ranks and p.uid not in old_uids
               and p.running is not None]
        on_lost = [p for p in new if p.node in lost_nodes]
        if on_lost:
            raise BenchError(f"replacement pods were placed on lost nodes: {on_lost}")
        return None if len(new) == lost else f"{len(new)} of {lost} replacements Running"

    t_planned = result.attempt("recovery", "recovery_planned_s", t_loss, planned,
                               recovery_timeout, 0.05)
    t_replaced = result.attempt("recovery", "replacements_created_s", t_loss, replaced,
                                recovery_timeout)
    if t_replaced is not None and t_planned is not None:
        result.steps["recovery_total_s"] = max(t_replaced, t_planned) - t_loss
    result.attempt("recovery", "recovery_recorded_s", t_loss, recorded, recovery_timeout, 0.1)
    if t_replaced is not None:
        result.attempt("recovery", "replacements_running_s", t_loss, replacements_running,
                       recovery_timeout)
    # Only the lost ranks should get new pods (the others restore from local memory).
    before = {p.uid for p in pods}
    result.steps["other_ranks_recreated"] = len(
        {p.rank for p in live() if p.rank not in lost_ranks and p.uid not in before})
    largest = result.steps["status_bytes_max"] = max(sizes, default=0)
    print(f"  status_bytes_max: {largest}", file=sys.stderr, flush=True)
    try:
        cleanup(plane, api, custom, name, lost_nodes)
    except Exception as err:  # said in the report; the figures above stand
        result.cleanup_error = f"{type(err).__name__}: {str(err)[:300]}"
    return result


def cleanup(plane: ControlPlane, api: Any, custom: Any, name: str, lost_nodes: set[str]) -> None:
    from kubernetes.client.exceptions import ApiException

    core = kwok.core_api(plane.kubeconfig, pool=4)
    custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
    # Not left to KCM's garbage collector: a thousand deletes at its client's rate take minutes.
    # 8,192 deletes outlast the API server's 60 s request timeout (504): ask again for the rest.
    for attempt in range(10):
        try:
            core.delete_collection_namespaced_pod(
                NAMESPACE, label_selector=f"{LABEL_JOB}={name}", grace_period_seconds=0)
            break
        except ApiException as err:
            if err.status != 504 or attempt == 9:
                raise
    for node in lost_nodes:
        kwok.kwok_restore_node(plane.kubeconfig, node)
    kwok.wait_nodes_ready(plane.kubeconfig, lost_nodes, timeout=60)

    def gone() -> str | None:
        left = json.loads(core.list_namespaced_pod(
            NAMESPACE, label_selector=f"{LABEL_JOB}={name}", _preload_content=False).data)
        n = len(left["items"])
        return None if n == 0 else f"{n} pods of {name} still exist"

    wait_for(gone, 120, 0.5)


# ---------------------------------------------------------------------------------------------
# Baselines: the same work by a plain client, without the operator


def baseline_pods(core: Any, ranks: int, lost: int) -> tuple[float, float]:
    """(s) 1000 one-per-node pods created until all Running; 10 deleted + recreated."""
    ns = "baseline"
    core.create_namespace({"metadata": {"name": ns}})

    def pod(i: int) -> dict[str, Any]:
        return {"metadata": {"name": f"w-{i}", "labels": {"app": "baseline"}}, "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "trainer", "image": "none", "resources": {
                "requests": {"cpu": "4", "memory": "16Gi", GPU: "8"}, "limits": {GPU: "8"}}}],
            "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": "baseline"}},
                 "topologyKey": "kubernetes.io/hostname"}]}}}}

    def running() -> int:
        items = json.loads(core.list_namespaced_pod(ns, _preload_content=False).data)["items"]
        return sum(1 for p in items if (p.get("status") or {}).get("phase") == "Running"
                   and (p.get("status") or {}).get("podIP")
                   and not p["metadata"].get("deletionTimestamp"))

    start = time.time()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: core.create_namespaced_pod(ns, pod(i), _preload_content=False),
                      range(ranks)))
    wait_for(lambda: None if running() == ranks else f"{running()} baseline pods Running",
             300, 0.5)
    create_s = time.time() - start
    # 10 replaced by a plain client: delete (grace 0) and create again, in parallel.
    start = time.time()

    def replace(i: int) -> None:
        core.delete_namespaced_pod(f"w-{i}", ns, grace_period_seconds=0, _preload_content=False)
        core.create_namespaced_pod(ns, pod(ranks + i), _preload_content=False)

    with ThreadPoolExecutor(lost) as pool:
        list(pool.map(replace, range(lost)))
    replace_s = time.time() - start
    core.delete_collection_namespaced_pod(ns, grace_period_seconds=0)
    core.delete_namespace(ns)
    return create_s, replace_s


# ---------------------------------------------------------------------------------------------


def main() -> int:
    with cleaning_up() as cleanup:
        return measure(cleanup)


def measure(cleanup: Cleanup) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--lost", type=int, default=10)
    parser.add_argument("--spare-nodes", type=int, default=0,
                        help="failurePolicy.spareNodes of the job")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="per step of creation (s); the target is 60")
    parser.add_argument("--recovery-timeout", type=float, default=60.0,
                        help="per step of the recovery (s); the target is 5")
    parser.add_argument("--keep", action="store_true", help="keep the state directory")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the plain client's baseline (at 8,192 ranks it alone takes "
                        "more than 300 s on 2 cores); its JSON fields are then null")
    parser.add_argument("--lease-seconds", type=int, default=kwok.LEASE_SECONDS,
                        help="the fake nodes' lease duration (kwok renews every quarter of it; "
                        "KCM's grace is 3 leases). 8,192 nodes on 2 cores need about 1200: "
                        "at the default the API server cannot keep up with the renewals")
    args = parser.parse_args()
    nodes = args.ranks + max(args.lost, args.spare_nodes)

    results: list[RunResult] = []
    setup: dict[str, float] = {}
    error = ""
    # whatever happens, nothing naming the state dir (control plane, kwok, operator) outlives it
    state_dir = cleanup.cluster(Path(tempfile.mkdtemp(prefix="gemini-scale-")))
    try:
        check_operator_available()
        t = time.monotonic()
        plane = kwok.start_kwok_cluster(state_dir, lease_seconds=args.lease_seconds)
        setup["control_plane_and_kwok_s"] = time.monotonic() - t
        t = time.monotonic()
        fake = kwok.create_fake_nodes(plane.kubeconfig, nodes, ZONES, RACKS)
        setup["create_nodes_s"] = time.monotonic() - t
        kwok.wait_nodes_ready(plane.kubeconfig, [n.name for n in fake], timeout=300)
        setup["nodes_ready_s"] = time.monotonic() - t
        core = kwok.core_api(plane.kubeconfig, pool=32)
        if not args.no_baseline:
            base_create, base_replace = baseline_pods(core, args.ranks, args.lost)
            setup["plain_client_create_running_s"] = base_create
            setup["plain_client_replace_s"] = base_replace
        print(f"set-up and baselines (s): { {k: round(v, 2) for k, v in setup.items()} }",
              file=sys.stderr, flush=True)

        from kubernetes import config

        api = config.new_client_from_config(str(plane.kubeconfig))
        apply_crd(api)
        core.create_namespace({"metadata": {"name": NAMESPACE}})
        _, log = start_operator(plane)
        watch = PodWatch(core, NAMESPACE)
        watch.start()
        warm_up(plane, api, watch, log, args.timeout)
        for i in range(args.runs):
            result = one_run(plane, api, watch, log, f"scale-{i}", args.ranks, args.lost,
                             args.spare_nodes, args.timeout, args.recovery_timeout)
            results.append(result)
            print(f"run {i}: { {k: round(v, 2) for k, v in result.steps.items()} } "
                  f"{result.errors or ''}", file=sys.stderr, flush=True)
            if result.errors:
                break  # a target missed once has no median; more runs would only repeat it
            if result.cleanup_error:
                print(f"cleaning up after run {i} failed: {result.cleanup_error}",
                      file=sys.stderr, flush=True)
                break
        watch.stop.set()
    except Exception as err:  # reported in the JSON lines, never as a number
        error = str(err) if isinstance(err, BenchError) else f"{type(err).__name__}: {err}"
        error += last_operator_complaint(state_dir / "logs" / "operator.log")
        print(f"error: {error}", file=sys.stderr)
    finally:
        processes.stop("operator", state_dir / "pids")
        kwok.stop_kwok_cluster(state_dir)
        if args.keep or error or any(r.errors for r in results):
            print(f"state and logs kept in {state_dir}", file=sys.stderr)
        else:
            shutil.rmtree(state_dir, ignore_errors=True)
    report(results, setup, error, args)
    return 1 if error or any(r.errors for r in results) else 0


def warm_up(plane: ControlPlane, api: Any, watch: PodWatch, log: Path, timeout: float) -> None:
    """A 2-rank job first: the operator is watching and leading before anything is timed."""
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL,
                                           job_manifest("warmup", 2, 0))

    def created() -> str | None:
        operator_alive(plane, log)
        n = sum(1 for p in watch.snapshot() if p.name.startswith("warmup-") and not p.gone)
        return None if n == 2 else (f"the operator created {n} of 2 pods of a 2-rank "
                                    f"GeminiJob (see {log})")

    wait_for(created, timeout, 0.1)
    cleanup(plane, api, custom, "warmup", set())


def last_operator_complaint(log: Path, start: int = 0) -> str:
    """The operator's newest warning or error written from byte `start` on (the run's own),
    which usually says why a step never happened."""
    if not log.exists():
        return ""
    with log.open("rb") as file:
        file.seek(start)
        text = file.read().decode(errors="replace")
    lines = [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line]
    return f"; the operator's last complaint: {lines[-1][:600]}" if lines else ""


def report(results: list[RunResult], setup: dict[str, float], error: str,
           args: argparse.Namespace) -> None:
    """Three JSON lines, creation, recovery, and the worse of them as a fraction of its
    target; a value only when every run got there."""

    def median(key: str) -> float | None:
        values = [r.steps[key] for r in results if key in r.steps]
        return round(statistics.median(values), 3) if values else None

    unclean = next((r.cleanup_error for r in results if r.cleanup_error), "")

    def line(target: str, metric: str, total: str, goal: float, steps: list[str],
             baseline: str) -> str:
        errors = [r.errors[target] for r in results if target in r.errors]
        why = error or (errors[0] if errors else "")
        complete = bool(results) and not why
        return json.dumps({
            "metric": metric, "value": median(total) if complete else None, "target": goal,
            "better": "lower", "unit": "s",
            # Steps measured before anything failed are real numbers, shown for diagnosis.
            **{k: median(k) for k in steps},
            f"baseline_{baseline}": round(setup[baseline], 3) if baseline in setup else None,
            "runs": len(results), "ranks": args.ranks, "lost": args.lost,
            "node_lease_seconds": args.lease_seconds,
            **({"cleanup_error": unclean} if unclean else {}),
            **({"error": why} if why else {}),
        })

    print(line("create", f"operator_{args.ranks}_rank_job_created_and_status_populated_median",
               "create_total_s", CREATE_TARGET_S,
               ["pods_created_s", "pods_running_s", "status_populated_s"],
               "plain_client_create_running_s"))
    print(line("recovery", f"operator_{args.lost}_lost_ranks_replaced_median", "recovery_total_s",
               RECOVERY_TARGET_S,
               ["loss_spread_s", "recovery_planned_s", "replacements_created_s",
                "recovery_recorded_s", "replacements_running_s", "other_ranks_recreated",
                "status_bytes_max"],
               "plain_client_replace_s"))
    print(worst_line(results, error, median))


def worst_line(results: list[RunResult], error: str,
               median: Callable[[str], float | None]) -> str:
    """Both targets in one number: max(create / 60 s, recovery / 5 s); <= 1 meets both."""
    create, recovery = median("create_total_s"), median("recovery_total_s")
    why = error or next((e for r in results for e in r.errors.values()), "")
    value = None
    if results and not why and create is not None and recovery is not None:
        value = round(max(create / CREATE_TARGET_S, recovery / RECOVERY_TARGET_S), 3)
    return json.dumps({
        "metric": "operator_scale_worst_fraction_of_target", "value": value, "target": 1.0,
        "better": "lower", "unit": "fraction of target", "create_total_s": create,
        "recovery_total_s": recovery, "runs": len(results), **({"error": why} if why else {}),
    })


if __name__ == "__main__":
    sys.exit(main())
