# Over 500 lines: the RADOS Gateway's start, pause, resume and stop share its process and
# port bookkeeping, which is most of the file.
"""A real S3 server for the local cluster: Ceph's RADOS Gateway on a one-OSD, in-memory cluster.

`start_s3` runs three detached daemons (monitor, OSD, gateway) whose pid files and logs live in
the state directory, makes a user and a bucket, and writes the endpoint to `<state_dir>/s3.json`.
`stop_s3` ends them from any process, even after the one that started them crashed: it finds
them by pid file and by the state directory's ceph.conf on their command line. Every start is a
fresh, empty cluster (objects live in the OSD's memory and are dropped on stop).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

from gemini_local.ceph_conf import MON_ID, OSD_ID, RGW_NAME, CephLayout, render_ceph_conf
from gemini_local.processes import free_port

log = logging.getLogger(__name__)

DAEMONS = ("mon", "osd", "rgw")
REQUIRED_BINARIES = ("monmaptool", "ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph")
DEBIAN_PACKAGES = ("radosgw", "ceph-mon", "ceph-osd", "ceph-common")
ENDPOINT_FILE = "s3.json"
PAUSED_FILE = "paused"
REGION = "us-east-1"
_USER = "gemini"
_STOP_GRACE_S = 5.0
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")
# glibc keeps freed multi-MiB request buffers in its heap (the gateway grew to 170 MB after one
# 256 MiB upload); a fixed mmap threshold hands them back to the system on free (50 MB).
_DAEMON_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}


class S3Error(RuntimeError):
    """The local S3 server could not do what was asked; the message says what to do."""


class S3BinariesMissing(S3Error):
    pass


class S3PortBusy(S3Error):
    pass


class S3AlreadyRunning(S3Error):
    pass


class S3NotRunning(S3Error):
    pass


class S3StartFailed(S3Error):
    pass


class PauseMode(StrEnum):
    """How `pause_s3` makes the gateway unavailable."""

    REFUSE = "refuse"  # the gateway process ends: connections are refused at once
    FREEZE = "freeze"  # the gateway is SIGSTOPped: connections hang until the client times out


@dataclass(frozen=True)
class S3Endpoint:
    """Where and how to reach the bucket (path-style addressing, SigV4)."""

    url: str
    access_key: str
    secret_key: str
    bucket: str
    region: str = REGION

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, str]) -> S3Endpoint:
        return cls(**{key: str(data[key]) for key in cls.__dataclass_fields__})


# --- public API -------------------------------------------------------------------------------


def start_s3(
    state_dir: Path, port: int | None = None, bucket: str = "gemini", *,
    timeout_s: float = 60.0, stop_with_pid: int | None = None, also_on: Sequence[str] = (),
) -> S3Endpoint:
    """Start mon, OSD and gateway on 127.0.0.1:`port` (free port if None; the gateway also on
    the addresses `also_on`); wait for the bucket.

    With `stop_with_pid`, a detached watchdog stops the server once that process is gone, so
    a test session killed outright leaves nothing behind. Memory: ~130 MB when empty, plus
    about 1.8 bytes per byte stored (measured), so delete what you write (deleted data is
    reclaimed within ~20 s). Past 97% of `CephLayout.capacity_bytes` (8 GiB) stored, the OSD
    drops writes and uploads hang.
    """
    state_dir = state_dir.resolve()
    if not _BUCKET_NAME.fullmatch(bucket):
        raise S3Error(f"bucket name {bucket!r} is not valid: use 3-63 lowercase letters, "
                      "digits and hyphens, starting and ending with a letter or digit")
    _require_binaries()
    running = _our_pids(state_dir)
    if running:
        raise S3AlreadyRunning(
            f"an S3 server already runs in {state_dir} (pids {sorted(running.values())}); "
            "stop it first with stop_s3 / `gemini local down`, or use another state directory"
        )
    layout = CephLayout(state_dir, str(uuid.uuid4()), free_port(), _choose_port(port),
                        also_on=tuple(also_on))
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    try:
        _prepare(layout)
        _bootstrap(layout, deadline)
        endpoint = _provision(layout, bucket, deadline)
        if stop_with_pid is not None:
            _spawn_watchdog(layout, stop_with_pid)
    except BaseException:
        _stop_pids(_our_pids(state_dir))
        raise
    (state_dir / ENDPOINT_FILE).write_text(json.dumps(endpoint.to_dict(), indent=2) + "\n")
    log.info("S3 up at %s in %.1f s", endpoint.url, time.monotonic() - started)
    return endpoint


def stop_s3(state_dir: Path) -> bool:
    """End every daemon of the server in `state_dir`; False when nothing was running."""
    state_dir = state_dir.resolve()
    pids = _our_pids(state_dir)
    _stop_pids(pids)
    for name in (*(f"pids/{d}.pid" for d in DAEMONS), ENDPOINT_FILE, PAUSED_FILE):
        (state_dir / name).unlink(missing_ok=True)
    return bool(pids)


def s3_status(state_dir: Path) -> dict[str, object]:
    """running (mon, OSD and gateway up, or the gateway paused by us), paused, endpoint, pids."""
    state_dir = state_dir.resolve()
    pids = {name: _daemon_pid(state_dir, name) for name in DAEMONS}
    paused = _paused_mode(state_dir)
    rgw_ok = pids["rgw"] is not None or paused is PauseMode.REFUSE
    endpoint = read_endpoint(state_dir)
    return {
        "running": pids["mon"] is not None and pids["osd"] is not None and rgw_ok,
        "paused": paused.value if paused else None,
        "endpoint": endpoint.to_dict() if endpoint else None,
        "pids": pids,
        "state_dir": str(state_dir),
    }


def read_endpoint(state_dir: Path) -> S3Endpoint | None:
    """The endpoint written by the last successful start, or None."""
    try:
        return S3Endpoint.from_dict(json.loads((state_dir / ENDPOINT_FILE).read_text()))
    except (OSError, ValueError, KeyError):
        return None


def pause_s3(state_dir: Path, mode: PauseMode = PauseMode.REFUSE) -> None:
    """Make the gateway unavailable (monitor and OSD keep the data) until `resume_s3`."""
    state_dir = state_dir.resolve()
    if _paused_mode(state_dir) is not None:
        return
    pid = _require_daemon(state_dir, "rgw")
    (state_dir / PAUSED_FILE).write_text(mode.value)
    if mode is PauseMode.FREEZE:
        os.kill(pid, signal.SIGSTOP)
    else:
        _stop_pids({"rgw": pid})


def resume_s3(state_dir: Path, timeout_s: float = 30.0) -> None:
    """Bring the gateway back after `pause_s3` and wait until it answers again."""
    state_dir = state_dir.resolve()
    mode = _paused_mode(state_dir)
    endpoint = read_endpoint(state_dir)
    if mode is None or endpoint is None:
        return
    deadline = time.monotonic() + timeout_s
    if mode is PauseMode.FREEZE:
        os.kill(_require_daemon(state_dir, "rgw"), signal.SIGCONT)
    else:
        _require_daemon(state_dir, "osd")
        port = int(endpoint.url.rsplit(":", 1)[1])
        if not _port_free(port):
            raise S3PortBusy(f"port {port} was taken while S3 was paused; stop_s3 and start again")
        _spawn(state_dir, "rgw", _rgw_argv(state_dir / "ceph.conf"))
    (state_dir / PAUSED_FILE).unlink()
    _wait_until(lambda: _gateway_answers(endpoint.url), deadline, "the gateway to answer",
                state_dir, ("rgw",))


# --- start-up steps -----------------------------------------------------------------------------


def _require_binaries() -> None:
    missing = [name for name in REQUIRED_BINARIES if shutil.which(name) is None]
    if missing:
        packages = " ".join(DEBIAN_PACKAGES)
        raise S3BinariesMissing(
            f"{', '.join(missing)} not found on PATH: install the Debian packages {packages} "
            f"(./dev does; or `apt-get install --no-install-recommends {packages}` as root)"
        )


def _choose_port(port: int | None) -> int:
    if port is None:
        return free_port()
    if not _port_free(port):
        raise S3PortBusy(f"port {port} on 127.0.0.1 is in use: free it or pick another port")
    return port


def _prepare(layout: CephLayout) -> None:
    for path in layout.data_dirs:
        shutil.rmtree(path, ignore_errors=True)
    for path in (*layout.data_dirs, layout.osd_data, layout.log_dir, layout.root / "pids"):
        path.mkdir(parents=True, exist_ok=True)
    for name in (ENDPOINT_FILE, PAUSED_FILE):
        (layout.root / name).unlink(missing_ok=True)
    layout.conf.write_text(render_ceph_conf(layout))


def _bootstrap(layout: CephLayout, deadline: float) -> None:
    """Monitor, then OSD 0, then the gateway, which makes its pools as the OSD comes up."""
    conf = str(layout.conf)
    osd_uuid = str(uuid.uuid4())
    _run(["monmaptool", "--create", "--clobber", "--fsid", layout.fsid,
          "--addv", MON_ID, f"[v2:127.0.0.1:{layout.mon_port}]", str(layout.monmap)],
         deadline, layout)
    _run(["ceph-mon", "-c", conf, "--mkfs", "-i", MON_ID, "--monmap", str(layout.monmap)],
         deadline, layout)
    _spawn(layout.root, "mon", ["ceph-mon", "-c", conf, "-f", "-i", MON_ID])
    _run(["ceph-osd", "-c", conf, "--no-mon-config", "--mkfs", "-i", str(OSD_ID),
          "--osd-uuid", osd_uuid], deadline, layout)
    _wait_until(lambda: _tcp_open(layout.mon_port), deadline, "the monitor to listen",
                layout.root, ("mon",))
    _run(["ceph", "-c", conf, "--connect-timeout", "10", "osd", "new", osd_uuid, str(OSD_ID)],
         deadline, layout)
    _spawn(layout.root, "osd", ["ceph-osd", "-c", conf, "-f", "-i", str(OSD_ID)])
    _spawn(layout.root, "rgw", _rgw_argv(layout.conf))


def _provision(layout: CephLayout, bucket: str, deadline: float) -> S3Endpoint:
    """A user with fresh keys and the bucket, once the gateway answers."""
    url = f"http://127.0.0.1:{layout.rgw_port}"
    _wait_until(lambda: _gateway_answers(url), deadline, "the gateway to answer", layout.root,
                DAEMONS)
    endpoint = S3Endpoint(url, _random_key(20, string.ascii_uppercase + string.digits),
                          _random_key(40, string.ascii_letters + string.digits), bucket)
    _run(["radosgw-admin", "-c", str(layout.conf), "user", "create", f"--uid={_USER}",
          f"--display-name={_USER}", f"--access-key={endpoint.access_key}",
          f"--secret={endpoint.secret_key}"], deadline, layout)
    _wait_until(lambda: _create_bucket(endpoint), deadline, f"bucket {bucket!r} to be created",
                layout.root, DAEMONS)
    return endpoint


def _spawn_watchdog(layout: CephLayout, owner_pid: int) -> None:
    owner_start = _start_time(owner_pid)
    if owner_start is None:
        raise S3StartFailed(f"process {owner_pid} (stop_with_pid) is not running")
    # The conf path on its command line makes stop_s3 end the watchdog along with the daemons.
    argv = [sys.executable, "-m", "gemini_local.s3", "watchdog", str(layout.conf),
            str(owner_pid), str(owner_start)]
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    _spawn(layout.root, "watchdog", argv, record=False, env={"PYTHONPATH": path})


def _watchdog(conf: Path, owner_pid: int, owner_start: int) -> None:
    """Poll until the owner is gone (then stop the server) or the server is (then just exit)."""
    state_dir = conf.parent
    while _daemon_pid(state_dir, "mon") is not None or _daemon_pid(state_dir, "osd") is not None:
        if _start_time(owner_pid) != owner_start:
            log.warning("process %d is gone: stopping the S3 server in %s", owner_pid, state_dir)
            stop_s3(state_dir)
            return
        time.sleep(1.0)


def _rgw_argv(conf: Path) -> list[str]:
    return ["radosgw", "-c", str(conf), "-f", "-n", RGW_NAME]


def _create_bucket(endpoint: S3Endpoint) -> bool:
    import boto3  # deferred: boto3 takes ~0.5 s to import and only start-up needs it here
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.client(
        "s3", endpoint_url=endpoint.url, aws_access_key_id=endpoint.access_key,
        aws_secret_access_key=endpoint.secret_key, region_name=endpoint.region,
        config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10),
    )
    try:
        client.create_bucket(Bucket=endpoint.bucket)
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code", "")
        if code == "InvalidBucketName":
            raise S3StartFailed(f"{endpoint.bucket!r} is not a valid S3 bucket name") from error
        log.debug("creating bucket %s: %s", endpoint.bucket, error)
        return bool(code == "BucketAlreadyOwnedByYou")
    except BotoCoreError as error:
        log.debug("creating bucket %s: %s", endpoint.bucket, error)
        return False
    return True


def _random_key(length: int, alphabet: str) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(length))


# --- processes ----------------------------------------------------------------------------------


def _spawn(
    state_dir: Path, name: str, argv: Sequence[str], *, record: bool = True,
    env: dict[str, str] | None = None,
) -> int:
    """Start `argv` in its own session, re-parented to init (the shell between exits at once),
    so it outlives us and never lingers as our zombie; pid and start time go to a pid file."""
    log_path = state_dir / "log" / f"{name}.out"
    script = 'exec 3>&1 0</dev/null 1>>"$0" 2>&1; "$@" 3>&- & echo $! >&3'
    shell = subprocess.run(["/bin/sh", "-c", script, str(log_path), *argv], check=True,
                           capture_output=True, text=True, start_new_session=True, timeout=10,
                           env={**os.environ, **_DAEMON_ENV, **(env or {})})
    pid = int(shell.stdout.split()[-1])
    if record:
        start = _start_time(pid)
        (state_dir / "pids" / f"{name}.pid").write_text(f"{pid} {start or 0}\n")
    log.debug("started %s (pid %d): %s", name, pid, " ".join(argv))
    return pid


def _run(argv: Sequence[str], deadline: float, layout: CephLayout) -> str:
    timeout = max(1.0, deadline - time.monotonic())
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        raise S3StartFailed(f"{argv[0]} took over {timeout:.0f} s; {_logs_hint(layout.root)}") \
            from error
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-800:]
        raise S3StartFailed(
            f"{' '.join(argv[:3])} ... failed (exit {done.returncode}): {tail}; "
            f"{_logs_hint(layout.root)}"
        )
    return done.stdout


def _wait_until(
    ready: Callable[[], bool], deadline: float, what: str, state_dir: Path,
    watched: Iterable[str],
) -> None:
    """Poll `ready`; fail fast when a watched daemon has died, and at the deadline."""
    while not ready():
        dead = [name for name in watched if _daemon_pid(state_dir, name) is None]
        if dead:
            raise S3StartFailed(f"{', '.join(dead)} exited while waiting for {what}; "
                                f"{_logs_hint(state_dir, dead)}")
        if time.monotonic() > deadline:
            raise S3StartFailed(f"timed out waiting for {what}; {_logs_hint(state_dir)}")
        time.sleep(0.1)


def _logs_hint(state_dir: Path, names: Sequence[str] = ()) -> str:
    tails = [f"--- {name}: {_tail(state_dir / 'log' / f'{name}.out')}" for name in names]
    return " ".join([f"logs in {state_dir / 'log'}", *tails])


def _tail(path: Path, chars: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip() or "(empty)"
    except OSError:
        return "(no output)"


def _our_pids(state_dir: Path) -> dict[str, int]:
    """Live processes of this server: from the pid files, plus any process whose command line
    names this state directory's ceph.conf (one started just before a crash, radosgw-admin)."""
    pids = {name: pid for name in DAEMONS if (pid := _daemon_pid(state_dir, name)) is not None}
    known = set(pids.values())
    for pid in _pids_using_conf(state_dir / "ceph.conf"):
        if pid not in known:
            pids[f"pid-{pid}"] = pid
    return pids


def _daemon_pid(state_dir: Path, name: str) -> int | None:
    try:
        pid_text, start_text = (state_dir / "pids" / f"{name}.pid").read_text().split()[:2]
        pid, start = int(pid_text), int(start_text)
    except (OSError, ValueError):
        return None
    return pid if _start_time(pid) == start else None


def _pids_using_conf(conf: Path) -> list[int]:
    wanted = str(conf).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted in args and _start_time(int(entry.name)) is not None:
            found.append(int(entry.name))
    return found


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (tells a recycled pid apart); None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _stop_pids(pids: dict[str, int]) -> None:
    """End the gateway (and strays) first, then the OSD, then the monitor: a gateway whose
    monitor is gone hangs in its shutdown. The OSD gets SIGKILL, since on SIGTERM memstore
    first copies every object to disk for nothing."""
    order = {"osd": 1, "mon": 2}
    for stage in range(3):
        group = {name: pid for name, pid in pids.items() if order.get(name, 0) == stage}
        _end_group(group, signal.SIGKILL if stage == 1 else signal.SIGTERM)


def _end_group(pids: dict[str, int], sig: signal.Signals) -> None:
    """Send `sig` (and SIGCONT, so a frozen process gets it); SIGKILL after the grace period."""
    starts = {pid: _start_time(pid) for pid in pids.values()}
    for pid in starts:
        _signal(pid, sig)
        _signal(pid, signal.SIGCONT)
    if _gone_within(starts, _STOP_GRACE_S):
        return
    for pid in _alive(starts):
        _signal(pid, signal.SIGKILL)
    _gone_within(starts, _STOP_GRACE_S)


def _gone_within(starts: dict[int, int | None], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(starts):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _alive(starts: dict[int, int | None]) -> list[int]:
    return [pid for pid, start in starts.items() if start and _start_time(pid) == start]


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _require_daemon(state_dir: Path, name: str) -> int:
    pid = _daemon_pid(state_dir, name)
    if pid is None:
        raise S3NotRunning(f"the S3 {name} daemon is not running in {state_dir}: start_s3 first")
    return pid


def _paused_mode(state_dir: Path) -> PauseMode | None:
    try:
        return PauseMode((state_dir / PAUSED_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


# --- network ------------------------------------------------------------------------------------


def _port_free(port: int) -> bool:
    """Whether the gateway could bind `port` (it sets SO_REUSEADDR too)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _tcp_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _gateway_answers(url: str) -> bool:
    """Any HTTP answer counts (anonymous listing gives 200)."""
    try:
        with urllib.request.urlopen(url + "/", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "watchdog":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
        _watchdog(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit("usage: python -m gemini_local.s3 watchdog CEPH_CONF OWNER_PID OWNER_START")
