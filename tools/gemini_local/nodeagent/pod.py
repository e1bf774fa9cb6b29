# Over 500 lines: one pod's lifecycle is one state machine (as the kubelet's pod worker);
# its containers, processes and volumes are in the modules beside it.
"""One pod on this node, from its first sight to its final delete: the kubelet's pod worker.

Order of events (as the kubelet): volumes and IP; init containers one by one, a native sidecar
(init container with restartPolicy Always) only until it has started, then kept running; all
main containers; restarts per restartPolicy with back-off; once every main container is done for
good, sidecars stop and the phase is final. Deletion: SIGTERM to main containers, SIGKILL at the
end of the grace period, sidecars last, then the object is deleted with grace 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from gemini_local.nodeagent import procs
from gemini_local.nodeagent.config import AgentConfig
from gemini_local.nodeagent.container import (
    ContainerRun,
    ProbeTarget,
    exec_prefix,
    exit_code,
    fallback_message,
    now_iso,
    probe_once,
    spawn,
    stop_process,
    terminated_state,
)
from gemini_local.nodeagent.hosts import hosts_file, mounts_etc_hosts, pod_hostname
from gemini_local.nodeagent.kubeapi import ApiError, KubeApi
from gemini_local.nodeagent.podspec import (
    ConfigError,
    Obj,
    PodFacts,
    condition,
    container_env,
    expand,
    is_sidecar,
    pod_phase,
    referenced_objects,
    restart_delay,
    should_restart,
)
from gemini_local.nodeagent.volumes import (
    Mount,
    container_mounts,
    materialize,
    namespaced_argv,
    volume_env,
)
from gemini_local.processes import torch_extensions_dir

DEFAULT_GRACE_S = 30.0
_CONFIG_RETRY_S = 2.0


@dataclass
class NodeContext:
    """What every pod worker of the agent shares."""

    api: KubeApi
    config: AgentConfig
    http: aiohttp.ClientSession
    mountns: bool
    allocate_ip: Callable[[], str]
    release_ip: Callable[[str], None]

    @property
    def node_dir(self) -> Path:
        return Path(self.config.node_dir)


def pod_tmp_dir(uid: str) -> Path:
    """The pod's containers' TMPDIR parent: short, for Unix socket paths made in it."""
    return Path(tempfile.gettempdir()) / f"gemini-pod-{uid[:13]}"


class PodWorker:
    def __init__(self, ctx: NodeContext, pod: Obj) -> None:
        self.ctx = ctx
        self.pod = pod
        meta = pod["metadata"]
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        spec = pod["spec"]
        self.restart_policy = spec.get("restartPolicy", "Always")
        self.dir = ctx.node_dir / "pods" / f"{self.namespace}_{self.name}_{self.uid}"
        self.shm_dir = Path(ctx.config.shm_dir) / self.uid
        self.tmp_dir = pod_tmp_dir(self.uid)
        self.inits = [ContainerRun(c, "sidecar" if is_sidecar(c) else "init", self.dir)
                      for c in spec.get("initContainers") or []]
        self.mains = [ContainerRun(c, "main", self.dir) for c in spec["containers"]]
        self.pod_ip = ""
        self.start_time = now_iso()
        self.prepared = self.initialized = self.init_failed = self.finished = False
        self.stopping = self.sidecars_stopping = self.gone = False
        self.stop_requested = asyncio.Event()
        self.wake = asyncio.Event()
        self.dirty = asyncio.Event()
        self.env_base: dict[str, str] = {}
        self.objects: dict[tuple[str, str], Obj | None] = {}
        self.dirs: dict[str, Path] = {}
        self.conditions: dict[str, Obj] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._events: set[asyncio.Task[None]] = set()
        self._last_error = ""
        self._written: Obj | None = None

    @property
    def path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods/{self.name}"

    def containers(self) -> list[ContainerRun]:
        return [*self.inits, *self.mains]

    # --- events from the watch ---------------------------------------------------------------

    def update(self, pod: Obj) -> None:
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self.stop_requested.set()
        # Someone else changed readiness (the node controller marks pods of an unreachable node
        # not ready): write ours again, as a kubelet reconciles its status.
        if self._written is not None and _ready(pod.get("status") or {}) != _ready(self._written):
            self._written = None
            self.dirty.set()

    def removed(self) -> None:
        """The object is gone from the API (force delete): stop at once, write nothing."""
        self.gone = True
        self.pod["metadata"]["deletionGracePeriodSeconds"] = 0
        self.stop_requested.set()

    # --- the whole life ----------------------------------------------------------------------

    async def run(self) -> None:
        writer = asyncio.create_task(self._status_writer())
        life = asyncio.create_task(self._guarded_lifecycle())
        self.dirty.set()
        try:
            await self.stop_requested.wait()
            grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
            await self._terminate(DEFAULT_GRACE_S if grace is None else float(grace))
            life.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await life
            if not self.gone:
                await self._write_status()
                await self._delete()
        finally:
            writer.cancel()
            for task in self._tasks:
                task.cancel()
            self._cleanup()

    async def _guarded_lifecycle(self) -> None:
        try:
            await self._lifecycle()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a bug must show in the pod, not kill the agent silently
            traceback.print_exc()
            for run in self.containers():
                if "running" not in run.state:
                    run.set_waiting("NodeAgentError", f"{type(err).__name__}: {err}")
            self.dirty.set()

    async def _lifecycle(self) -> None:
        await self._prepare()
        for run in self.inits:
            if run.kind == "sidecar":
                self._tasks.append(asyncio.create_task(self._supervise(run)))
                await self._until(run.started_event.wait())
            elif not await self._run_init(run):
                self.init_failed = True
                break
            if self.stopping:
                return
        if not self.init_failed:
            self.initialized = True
            self.dirty.set()
            await asyncio.gather(*(self._supervise(run) for run in self.mains))
        if self.stopping:
            return
        self.sidecars_stopping = True
        await self._stop_sidecars(self._grace())
        self.finished = True
        self.dirty.set()

    async def _prepare(self) -> None:
        """Pod IP, referenced ConfigMaps/Secrets and volumes; retried until they can be made."""
        host_network = bool(self.pod["spec"].get("hostNetwork"))
        self.pod_ip = self.ctx.config.node_ip if host_network else self.ctx.allocate_ip()
        while not self.stopping:
            try:
                await self._fetch_objects()
                facts = self._facts()
                self.dirs = await materialize(self.pod, self.dir, self.shm_dir, facts,
                                              self.objects, self._token)
                self.dir.mkdir(parents=True, exist_ok=True)  # a pod without volumes has none yet
                (self.dir / "etc-hosts").write_text(hosts_file(self.pod, self.pod_ip))
                self.prepared = True
                self.dirty.set()
                return
            except ConfigError as err:
                for run in self.containers():
                    run.set_waiting("CreateContainerConfigError", str(err))
                self._config_error(str(err))
                self.dirty.set()
                await self._sleep(_CONFIG_RETRY_S)
            except (ApiError, aiohttp.ClientError, TimeoutError, OSError) as err:
                print(f"preparing pod {self.namespace}/{self.name}: {err!r}", flush=True)
                await self._sleep(_CONFIG_RETRY_S)  # the API server is unreachable: try again

    async def _fetch_objects(self) -> None:
        for kind, name in referenced_objects(self.pod):
            plural = "configmaps" if kind == "configmap" else "secrets"
            self.objects[(kind, name)] = await self.ctx.api.get_or_none(
                f"/api/v1/namespaces/{self.namespace}/{plural}/{name}")

    async def _token(self, projection: Obj) -> str:
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
            "audiences": [projection["audience"]] if projection.get("audience") else None,
            "expirationSeconds": int(projection.get("expirationSeconds") or 3607),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.name,
                               "uid": self.uid}}}
        try:
            result = await self.ctx.api.request(
                "POST", f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{sa}/token", body)
        except ApiError as err:
            raise ConfigError(f"token for service account {sa!r}: {err}") from err
        return str(result["status"]["token"])

    def _facts(self) -> PodFacts:
        return PodFacts(self.pod, self.pod_ip, self.ctx.config.node_ip,
                        self.ctx.config.spec.capacity())

    # --- containers --------------------------------------------------------------------------

    async def _run_init(self, run: ContainerRun) -> bool:
        """Run a plain init container to success; False if it failed for good (Never)."""
        while not self.stopping:
            code = await self._run_once(run)
            if self.stopping or code == 0:
                return code == 0
            if code is not None and self.restart_policy == "Never":
                return False
            await self._backoff(run)
        return False

    async def _supervise(self, run: ContainerRun) -> None:
        """Run a main container or sidecar, restarting it as its policy says."""
        while not self._done(run):
            code = await self._run_once(run)
            if self._done(run):
                return
            if run.kind == "main" and code is not None and not should_restart(
                    self.restart_policy, code):
                run.restarting = False
                self.dirty.set()
                return
            await self._backoff(run)

    def _done(self, run: ContainerRun) -> bool:
        return self.stopping or (run.kind == "sidecar" and self.sidecars_stopping)

    async def _backoff(self, run: ContainerRun) -> None:
        run.restarting = True
        run.crash_loop += 1
        delay = restart_delay(run.crash_loop)
        if delay > 0 and "waiting" in run.state:
            # Not created (CreateContainerConfigError, ...): as a kubelet, the state keeps
            # that reason while it retries; only a run that ended is a crash loop.
            await self._sleep(delay)
        elif delay > 0:
            run.last_state, run.state = run.state, {"waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:.0f}s restarting failed container={run.name} "
                           f"pod={self.name}"}}
            self.dirty.set()
            self._event("Warning", "BackOff", f"Back-off restarting failed container {run.name} "
                        f"in pod {self.name}", run)
            await self._sleep(delay)

    async def _run_once(self, run: ContainerRun) -> int | None:
        """One run of the container, probes included; its exit code (None: could not start)."""
        try:
            argv, env, cwd = self._command(run)
        except ConfigError as err:
            run.set_waiting("CreateContainerConfigError", str(err))
            self._config_error(str(err))
            self.dirty.set()
            return None
        if run.runs:
            if "terminated" in run.state:
                run.last_state = run.state
            run.restart_count += 1
        try:
            proc = await spawn(run, argv, env, cwd, self.ctx.node_dir)
        except ConfigError as err:
            run.set_waiting("CreateContainerError", str(err))
            self._config_error(str(err))
            self.dirty.set()
            return None
        started_at = now_iso()
        run.state = {"running": {"startedAt": started_at}}
        self._event("Normal", "Started", f"Started container {run.name}", run)
        loop = asyncio.get_running_loop()
        began = loop.time()
        probes = asyncio.create_task(self._probe(run, env, cwd))
        self.dirty.set()
        returncode = await proc.wait()
        probes.cancel()
        procs.kill_group(proc.pid)
        procs.forget_group(self.ctx.node_dir, proc.pid)
        run.pid_file.unlink(missing_ok=True)
        code = exit_code(returncode)
        run.state = terminated_state(code, started_at, run.container_id(self.uid),
                                     fallback_message(run, code))
        run.ready = run.started = False
        if loop.time() - began > 20:
            run.crash_loop = 0
        self.dirty.set()
        return code

    def _command(self, run: ContainerRun) -> tuple[list[str], dict[str, str], Path]:
        spec = run.spec
        env = container_env(spec, self._facts(), self.objects,
                            {**self._base_env(), "TMPDIR": str(self._tmp_dir(run))})
        env.update(volume_env(spec, self.dirs))
        argv = [expand(str(a), env) for a in [*(spec.get("command") or []),
                                              *(spec.get("args") or [])]]
        if not argv:
            raise ConfigError(
                f"container {run.name!r} has no command: the local node agent does not run "
                "images, so give the program to run in `command` (it is looked up on PATH, "
                "the project's virtual environment first)")
        workdir = spec.get("workingDir") or str(self.dir / "workdir")
        if self.ctx.mountns:
            mounts = container_mounts(spec, self.dirs)
            hostname = None
            if self._own_network():  # the pod's name, resolving to the pod IP
                hostname = pod_hostname(self.pod)
                if not mounts_etc_hosts(spec):
                    mounts.append(Mount(self.dir / "etc-hosts", "/etc/hosts", read_only=False))
            return namespaced_argv(argv, mounts, workdir, hostname), env, self.dir
        Path(workdir).mkdir(parents=True, exist_ok=True)
        return argv, env, Path(workdir)

    def _tmp_dir(self, run: ContainerRun) -> Path:
        """The container's own temporary folder, removed with the pod, as a container's /tmp
        is: processes here share the host's /tmp, where killed ones left their files. Short,
        under /tmp, not in the pod's folder: Unix socket paths made in it must fit 107 bytes."""
        path = self.tmp_dir / run.name
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o1777)  # like /tmp: whatever user the container runs as can write there
        return path

    def _own_network(self) -> bool:
        """hostNetwork pods keep the node's hostname and /etc/hosts, as with a kubelet."""
        return not self.pod["spec"].get("hostNetwork")

    def _base_env(self) -> dict[str, str]:
        config = self.ctx.config
        target = self.ctx.api.target
        return {
            "PATH": f"{config.venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
                    "/sbin:/bin",
            "HOME": str(Path.home()), "LANG": "C.UTF-8",
            # The "image" is the venv: its JIT-built DeepSpeed ops too (see ./dev setup).
            "TORCH_EXTENSIONS_DIR": torch_extensions_dir(config.venv_bin),
            "HOSTNAME": pod_hostname(self.pod) if self._own_network() else config.spec.name,
            "KUBERNETES_SERVICE_HOST": target.host,
            "KUBERNETES_SERVICE_PORT": str(target.port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(target.port),
            "GEMINI_POD_IP": self.pod_ip, "GEMINI_NODE_NAME": config.spec.name,
            "GEMINI_NODE_IP": config.node_ip,
        }

    # --- probes ------------------------------------------------------------------------------

    async def _probe(self, run: ContainerRun, env: dict[str, str], cwd: Path) -> None:
        spec = run.spec
        ports = {p["name"]: int(p["containerPort"]) for p in spec.get("ports") or []
                 if p.get("name")}
        pid = run.process.pid if run.process else None
        target = ProbeTarget(self.pod_ip, ports, env, exec_prefix(pid, self.ctx.mountns),
                             Path(spec.get("workingDir") or self.dir / "workdir"))
        if self.ctx.mountns:  # the pod's workdir exists in every namespace; use it for nsenter
            target = ProbeTarget(target.pod_ip, ports, env, target.exec_prefix, self.dir)
        if spec.get("startupProbe") and not await self._probe_until(
                run, "startupProbe", target, want=True):
            return await self._kill_unhealthy(run, "Startup")
        run.started = True
        run.started_event.set()
        if not spec.get("readinessProbe"):
            run.ready = True
        self.dirty.set()
        tasks = [asyncio.create_task(self._readiness(run, target))] if spec.get(
            "readinessProbe") else []
        try:
            if spec.get("livenessProbe"):
                await self._probe_until(run, "livenessProbe", target, want=False)
                await self._kill_unhealthy(run, "Liveness")
            else:
                await asyncio.Event().wait()
        finally:
            for task in tasks:
                task.cancel()

    async def _probe_until(self, run: ContainerRun, kind: str, target: ProbeTarget,
                           want: bool) -> bool:
        """Probe until success (want=True) or until failureThreshold failures in a row."""
        probe = run.spec[kind]
        await asyncio.sleep(float(probe.get("initialDelaySeconds") or 0))
        failures, threshold = 0, int(probe.get("failureThreshold") or 3)
        while True:
            ok = await probe_once(probe, target, self.ctx.http)
            if ok and want:
                return True
            failures = 0 if ok else failures + 1
            if failures >= threshold:
                return False
            await asyncio.sleep(float(probe.get("periodSeconds") or 10))

    async def _readiness(self, run: ContainerRun, target: ProbeTarget) -> None:
        probe = run.spec["readinessProbe"]
        await asyncio.sleep(float(probe.get("initialDelaySeconds") or 0))
        successes = failures = 0
        while True:
            ok = await probe_once(probe, target, self.ctx.http)
            successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
            if ok and successes >= int(probe.get("successThreshold") or 1) and not run.ready:
                run.ready = True
                self.dirty.set()
            if not ok and failures >= int(probe.get("failureThreshold") or 3) and run.ready:
                run.ready = False
                self.dirty.set()
            if not ok and failures == int(probe.get("failureThreshold") or 3):
                self._event("Warning", "Unhealthy", "Readiness probe failed", run)
            await asyncio.sleep(float(probe.get("periodSeconds") or 10))

    async def _kill_unhealthy(self, run: ContainerRun, probe: str) -> None:
        self._event("Warning", "Unhealthy", f"{probe} probe failed", run)
        self._event("Normal", "Killing", f"Container {run.name} failed {probe.lower()} probe, "
                    "will be restarted", run)
        if run.process is not None:
            await stop_process(run.process, self._grace())

    # --- stopping ----------------------------------------------------------------------------

    def _grace(self) -> float:
        value = self.pod["spec"].get("terminationGracePeriodSeconds")
        return DEFAULT_GRACE_S if value is None else float(value)

    async def _terminate(self, grace: float) -> None:
        """Stop everything: main containers first within the grace period, sidecars last."""
        self.stopping = True
        self.wake.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        plain = [r for r in self.containers() if r.kind != "sidecar"]
        for run in self.containers():
            if run.process is not None and run.process.returncode is None and not self.gone:
                self._event("Normal", "Killing", f"Stopping container {run.name}", run)
        await asyncio.gather(*(stop_process(r.process, grace) for r in plain if r.process))
        remaining = max(deadline - loop.time(), min(grace, 1.0))
        await self._stop_sidecars(remaining)

    async def _stop_sidecars(self, grace: float) -> None:
        self.wake.set()
        sidecars = [r for r in reversed(self.inits) if r.kind == "sidecar" and r.process]
        await asyncio.gather(*(stop_process(r.process, grace) for r in sidecars if r.process))

    async def _sleep(self, seconds: float) -> None:
        """Sleep, cut short when the pod or its sidecars are being stopped."""
        self.wake.clear()
        if self.stopping or self.sidecars_stopping:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wake.wait(), seconds)

    async def _until(self, awaitable: Awaitable[Any]) -> None:
        """Await, giving up when the pod is being stopped."""
        task = asyncio.ensure_future(awaitable)
        stop = asyncio.create_task(self.stop_requested.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        task.cancel()

    async def _delete(self) -> None:
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                "preconditions": {"uid": self.uid}}
        while True:  # until it is gone: through API errors and partitions
            try:
                await self.ctx.api.request("DELETE", self.path, body)
                return
            except ApiError as err:
                if err.status in (404, 409):
                    return
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(1)

    def _cleanup(self) -> None:
        for run in self.containers():
            if run.process is not None and run.process.returncode is None:
                procs.kill_group(run.process.pid)
        if self.pod_ip and self.pod_ip != self.ctx.config.node_ip:
            self.ctx.release_ip(self.pod_ip)
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- events ------------------------------------------------------------------------------

    def _config_error(self, message: str) -> None:
        if message != self._last_error:
            self._last_error = message
            self._event("Warning", "Failed", f"Error: {message}")

    def _event(self, kind: str, reason: str, message: str, run: ContainerRun | None = None) -> None:
        """Post an Event as the kubelet does; best effort, never awaited by the pod's life."""
        node = self.ctx.config.spec.name
        now = now_iso()
        involved: Obj = {"apiVersion": "v1", "kind": "Pod", "namespace": self.namespace,
                         "name": self.name, "uid": self.uid}
        if run is not None:
            section = "initContainers" if run.kind != "main" else "containers"
            involved["fieldPath"] = f"spec.{section}{{{run.name}}}"
        body = {"apiVersion": "v1", "kind": "Event",
                "metadata": {"generateName": f"{self.name}.", "namespace": self.namespace},
                "involvedObject": involved, "reason": reason, "message": message, "type": kind,
                "source": {"component": "kubelet", "host": node}, "count": 1,
                "firstTimestamp": now, "lastTimestamp": now,
                "reportingComponent": "kubelet", "reportingInstance": node}
        task = asyncio.create_task(self._post_event(body))
        self._events.add(task)
        task.add_done_callback(self._events.discard)

    async def _post_event(self, body: Obj) -> None:
        with contextlib.suppress(ApiError, aiohttp.ClientError, TimeoutError, OSError):
            await self.ctx.api.request("POST", f"/api/v1/namespaces/{self.namespace}/events",
                                       body)

    # --- status ------------------------------------------------------------------------------

    async def _status_writer(self) -> None:
        while True:
            await self.dirty.wait()
            await asyncio.sleep(0.02)  # coalesce bursts of changes into one write
            self.dirty.clear()
            status = self.status()
            if status == self._written or self.gone:
                continue
            try:
                await self.ctx.api.merge_patch(self.path + "/status", {"status": status})
                self._written = status
            except (TimeoutError, ApiError, aiohttp.ClientError, OSError) as err:
                if isinstance(err, ApiError) and err.status == 404:
                    continue
                await asyncio.sleep(1)
                self.dirty.set()

    async def _write_status(self) -> None:
        with contextlib.suppress(ApiError, aiohttp.ClientError, asyncio.TimeoutError, OSError):
            await self.ctx.api.merge_patch(self.path + "/status", {"status": self.status()})

    def status(self) -> Obj:
        """The pod status as a kubelet would report it now."""
        now = now_iso()
        mains_ready = all(r.ready for r in self.mains)
        sidecars_ready = all(r.ready for r in self.inits if r.kind == "sidecar")
        phase = pod_phase(self.restart_policy, self.initialized, self.init_failed,
                          [r.state for r in self.mains], [r.restarting for r in self.mains])
        if phase in ("Succeeded", "Failed") and not (self.finished or self.stopping):
            # As a kubelet (1.27+): terminal only once every container, sidecars too, stopped.
            phase = "Running" if self.initialized else "Pending"
        ready = mains_ready and sidecars_ready and phase == "Running"
        not_ready_reason = ("PodCompleted" if phase in ("Succeeded", "Failed")
                            else "ContainersNotReady")
        conds = [
            self._condition("PodReadyToStartContainers", self.prepared, now),
            self._condition("Initialized", self.initialized, now,
                            "" if self.initialized else "ContainersNotInitialized"),
            self._condition("ContainersReady", ready, now, "" if ready else not_ready_reason),
            self._condition("Ready", ready, now, "" if ready else not_ready_reason),
        ]
        mine = {c["type"] for c in conds}
        others = [c for c in (self.pod.get("status") or {}).get("conditions") or []
                  if c["type"] not in mine]
        status: Obj = {
            "phase": phase, "conditions": others + conds, "hostIP": self.ctx.config.node_ip,
            "hostIPs": [{"ip": self.ctx.config.node_ip}], "startTime": self.start_time,
            "containerStatuses": [r.status(self.uid) for r in self.mains],
        }
        if self.pod_ip:
            status["podIP"] = self.pod_ip
            status["podIPs"] = [{"ip": self.pod_ip}]
        if self.inits:
            status["initContainerStatuses"] = [self._init_status(r) for r in self.inits]
        return status

    def _init_status(self, run: ContainerRun) -> Obj:
        out = run.status(self.uid)
        if run.kind == "init":
            done = run.state.get("terminated", {}).get("exitCode") == 0
            out["ready"] = done
            out["started"] = "running" in run.state
        return out

    def _condition(self, kind: str, value: bool, now: str, reason: str = "") -> Obj:
        cond = condition(kind, value, now, reason, self.conditions.get(kind))
        self.conditions[kind] = cond
        return cond


def _ready(status: Obj) -> str | None:
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Ready":
            return str(cond.get("status"))
    return None
