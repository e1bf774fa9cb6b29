"""Sidecar configuration from the environment (the operator sets these on the container).

Every setting is one GEMINI_* variable; `SidecarConfig` documents each field. A bad value
raises ConfigError naming the variable and what to put there. The placement part (peers,
holders, targets) can change at run time through the control API, so it is its own value.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gemini.control.signing import PublicKey, public_key_setting
from gemini.metric_labels import DEFAULT_NAMESPACE, namespace_from_env

TrafficMode = Literal["interleaved", "immediate"]


class ConfigError(Exception):
    """A setting is missing or malformed; the message names the variable and the fix."""


@dataclass(frozen=True)
class PeerAddress:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Placement:
    """Who this sidecar talks to; replaced as a whole when the operator re-places ranks."""

    peers: Mapping[int, PeerAddress]  # rank -> that rank's sidecar peer address
    hold_ranks: tuple[int, ...]  # ranks whose shards this sidecar keeps replicas of
    send_to: tuple[int, ...]  # ranks this sidecar sends its own shard to (m-1 of them)


@dataclass(frozen=True)
class S3Settings:
    bucket: str  # GEMINI_S3_BUCKET
    # GEMINI_S3_PREFIX: keys are <prefix>/<namespace>/<job>/<uid>/step-<v>/rank-<r>.bin
    prefix: str = "gemini"
    endpoint_url: str | None = None  # GEMINI_S3_ENDPOINT (None: AWS default)
    region: str = "us-east-1"  # GEMINI_S3_REGION
    access_key: str | None = field(default=None, repr=False)  # GEMINI_S3_ACCESS_KEY
    secret_key: str | None = field(default=None, repr=False)  # GEMINI_S3_SECRET_KEY
    retain: int = 3  # GEMINI_S3_RETAIN: committed checkpoints kept
    part_bytes: int = 64 << 20  # GEMINI_S3_PART_BYTES: multipart part size
    concurrency: int = 8  # GEMINI_S3_CONCURRENCY: parts in flight


@dataclass(frozen=True)
class ServerLimits:
    """What each listener (peer protocol, HTTP API) lets one connection take, so no client,
    authenticated or not, can starve the others (each setting is per listener)."""

    # GEMINI_HEADER_TIMEOUT_S: a new connection must finish its peer handshake or HTTP request
    # header within this; an idle HTTP keep-alive connection is closed after it too.
    header_timeout_s: float = 10.0
    # GEMINI_READ_TIMEOUT_S: once a peer frame or an HTTP body has started, the rest must come
    # within this (a peer's bulk payload: no byte for this long ends the connection).
    read_timeout_s: float = 30.0
    max_connections: int = 256  # GEMINI_MAX_CONNECTIONS: open connections in total
    max_connections_per_host: int = 32  # GEMINI_MAX_CONNECTIONS_PER_HOST: from one address


@dataclass(frozen=True)
class SidecarConfig:
    job: str  # GEMINI_JOB: job name; peers of other jobs are refused
    rank: int  # GEMINI_RANK: the rank of the trainer in this pod
    world_size: int  # GEMINI_WORLD_SIZE
    bind_host: str  # GEMINI_POD_IP (or GEMINI_BIND_ADDRESS): where both servers listen
    peer_port: int  # GEMINI_SIDECAR_PORT: peer data protocol
    api_port: int  # GEMINI_SIDECAR_API_PORT (default peer port + 1): HTTP control API
    placement: Placement  # GEMINI_PEERS, GEMINI_HOLD_RANKS, GEMINI_SEND_TO
    memory_budget_bytes: int  # GEMINI_MEMORY_BUDGET_BYTES: replica store limit
    auth_token: bytes = field(repr=False)  # GEMINI_AUTH_TOKEN: per-job shared secret
    shm_dir: Path = Path("/dev/shm")  # GEMINI_SHM_DIR: tmpfs shared with the trainer
    # GEMINI_HEARTBEAT_FILE: where the trainer writes its last step (in the shared volume);
    # /inventory reports it, so the operator's poll needs no call to the launcher.
    heartbeat_file: Path | None = None
    traffic_mode: TrafficMode = "interleaved"  # GEMINI_TRAFFIC_MODE
    # GEMINI_CHUNK_BYTES: largest replication chunk (the paper's R/p). Each chunk costs a
    # few hundred microseconds of Python per side, so chunks are large; interleaving splits
    # them further to fit idle spans.
    chunk_bytes: int = 16 << 20
    max_frame_bytes: int = 64 << 20  # GEMINI_MAX_FRAME_BYTES: larger frames are refused
    s3: S3Settings | None = None  # None when GEMINI_S3_BUCKET is unset
    # GEMINI_REPLICAS: m, copies per shard. A version is acknowledged to the trainer only once
    # m-1 peers have it, so not before a placement with m-1 targets arrived; 0 (unset): as
    # many peers as the placement names.
    replicas: int = 0
    limits: ServerLimits = field(default_factory=ServerLimits)  # GEMINI_*_TIMEOUT_S, _MAX_*
    # GEMINI_PEER_SENDER_CHECK (address | off): a rank's replica only from that rank's address
    check_senders: bool = True
    # GEMINI_CONTROL_PUBLIC_KEY: the key the operator signs its calls with; with it, the job
    # token only reads and makes the trainer's calls (gemini.control.verifier.admitted)
    control_public_key: PublicKey | None = field(default=None, repr=False)
    # GEMINI_NAMESPACE and GEMINI_JOB_UID (the GeminiJob's metadata.uid): with the job name,
    # whose S3 checkpoints these are, and the metrics' geminijob_namespace label. The operator
    # always sets both; a sidecar started by hand without them keeps its checkpoints under
    # namespace "default" (said in a warning at start) and uid "no-uid".
    namespace: str = DEFAULT_NAMESPACE
    job_uid: str = ""
    # GEMINI_PEER_ENCRYPTION (on | off): payloads between sidecars encrypted (peer_keys.py);
    # on, this sidecar's peer server also refuses peers that do not encrypt
    peer_encryption: bool = False
    # GEMINI_SIDECAR_PROBE_PORT: /healthz alone, on a listener of its own that connections held
    # to the API cannot starve (gemini.serving.probes; the operator sets it for the kubelet's
    # probes). None (unset): /healthz on the API port only.
    probe_port: int | None = None


def _control_public_key(env: Mapping[str, str]) -> PublicKey | None:
    try:
        return public_key_setting(env)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _peer_encryption(env: Mapping[str, str]) -> bool:
    mode = env.get("GEMINI_PEER_ENCRYPTION", "off").strip()
    if mode not in ("on", "off"):
        raise ConfigError(f"GEMINI_PEER_ENCRYPTION must be on or off, got {mode!r}")
    return mode == "on"


def _sender_check(env: Mapping[str, str]) -> bool:
    mode = env.get("GEMINI_PEER_SENDER_CHECK", "address").strip()
    if mode not in ("address", "off"):
        raise ConfigError(f"GEMINI_PEER_SENDER_CHECK must be address or off, got {mode!r}")
    return mode == "address"


def parse_peers(text: str) -> dict[int, PeerAddress]:
    """`{"0": "10.0.0.1:7070", ...}` (JSON) or `0=10.0.0.1:7070,1=...`."""
    text = text.strip()
    if not text:
        return {}
    pairs: list[tuple[str, str]]
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"GEMINI_PEERS is not valid JSON: {err}") from err
        if not isinstance(doc, dict):
            raise ConfigError("GEMINI_PEERS JSON must be an object of rank -> host:port")
        pairs = [(str(k), str(v)) for k, v in doc.items()]
    else:
        pairs = []
        for item in filter(None, (p.strip() for p in text.split(","))):
            rank, sep, addr = item.partition("=")
            if not sep:
                raise ConfigError(f"GEMINI_PEERS entry {item!r} is not rank=host:port")
            pairs.append((rank, addr))
    return {_int("GEMINI_PEERS rank", r, 0): parse_address(a) for r, a in pairs}


def parse_address(text: str) -> PeerAddress:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host:
        raise ConfigError(f"peer address {text!r} is not host:port")
    return PeerAddress(host.strip("[]"), _int("peer port", port, 1, 65535))


def _int(name: str, text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(str(text).strip())
    except ValueError as err:
        raise ConfigError(f"{name} must be an integer, got {text!r}") from err
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ConfigError(f"{name} must be {bound}, got {value}")
    return value


def _seconds(name: str, text: str, low: float, high: float) -> float:
    try:
        value = float(str(text).strip())
    except ValueError as err:
        raise ConfigError(f"{name} must be a number of seconds, got {text!r}") from err
    if not low <= value <= high:  # also refuses nan
        raise ConfigError(f"{name} must be between {low:g} and {high:g} seconds, got {text}")
    return value


def _limits_from_env(env: Mapping[str, str]) -> ServerLimits:
    default = ServerLimits()
    total = _int("GEMINI_MAX_CONNECTIONS",
                 env.get("GEMINI_MAX_CONNECTIONS", str(default.max_connections)), 1, 65535)
    return ServerLimits(
        header_timeout_s=_seconds("GEMINI_HEADER_TIMEOUT_S", env.get(
            "GEMINI_HEADER_TIMEOUT_S", str(default.header_timeout_s)), 0.1, 3600),
        read_timeout_s=_seconds("GEMINI_READ_TIMEOUT_S", env.get(
            "GEMINI_READ_TIMEOUT_S", str(default.read_timeout_s)), 0.1, 3600),
        max_connections=total,
        max_connections_per_host=_int("GEMINI_MAX_CONNECTIONS_PER_HOST", env.get(
            "GEMINI_MAX_CONNECTIONS_PER_HOST", str(default.max_connections_per_host)), 1, total),
    )


def parse_ranks(name: str, text: str, world_size: int) -> tuple[int, ...]:
    ranks = tuple(_int(name, r, 0, world_size - 1) for r in text.split(",") if r.strip())
    return tuple(sorted(set(ranks)))


def make_placement(
    peers: Mapping[int, PeerAddress], hold: tuple[int, ...], send_to: tuple[int, ...],
    rank: int, world_size: int,
) -> Placement:
    """Validate a placement: ranks in range, never ourselves, every target has an address."""
    for name, ranks in (("hold ranks", hold), ("send-to ranks", send_to), ("peers", peers)):
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise ConfigError(f"{name} {bad} outside the world of {world_size} ranks")
    if rank in hold or rank in send_to:
        raise ConfigError(f"rank {rank} cannot hold or send to itself")
    missing = [r for r in send_to if r not in peers]
    if missing:
        raise ConfigError(f"no peer address for send-to ranks {missing}: add them to the peers")
    return Placement(dict(peers), hold, send_to)


def _s3_from_env(env: Mapping[str, str]) -> S3Settings | None:
    bucket = env.get("GEMINI_S3_BUCKET", "").strip()
    if not bucket:
        return None
    return S3Settings(
        bucket=bucket,
        prefix=env.get("GEMINI_S3_PREFIX", "gemini").strip("/"),
        endpoint_url=env.get("GEMINI_S3_ENDPOINT") or None,
        region=env.get("GEMINI_S3_REGION", "us-east-1"),
        access_key=env.get("GEMINI_S3_ACCESS_KEY") or None,
        secret_key=env.get("GEMINI_S3_SECRET_KEY") or None,
        retain=_int("GEMINI_S3_RETAIN", env.get("GEMINI_S3_RETAIN", "3"), 1),
        part_bytes=_int("GEMINI_S3_PART_BYTES", env.get("GEMINI_S3_PART_BYTES", str(64 << 20)),
                        5 << 20),
        concurrency=_int("GEMINI_S3_CONCURRENCY", env.get("GEMINI_S3_CONCURRENCY", "8"), 1, 64),
    )


def _required(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise ConfigError(f"{name} is not set; the operator sets it on the sidecar container")
    return value


def from_env(env: Mapping[str, str] | None = None) -> SidecarConfig:
    """Read and validate the whole configuration; raises ConfigError on the first problem."""
    env = os.environ if env is None else env
    job = _required(env, "GEMINI_JOB")
    world = _int("GEMINI_WORLD_SIZE", _required(env, "GEMINI_WORLD_SIZE"), 1)
    rank = _int("GEMINI_RANK", _required(env, "GEMINI_RANK"), 0, world - 1)
    token = _required(env, "GEMINI_AUTH_TOKEN").encode()
    if len(token) < 16:
        raise ConfigError("GEMINI_AUTH_TOKEN must be at least 16 characters (a per-job secret)")
    peer_port = _int("GEMINI_SIDECAR_PORT", env.get("GEMINI_SIDECAR_PORT", "7070"), 0, 65535)
    api_default = str(peer_port + 1) if peer_port else "0"  # 0: any free port (tests)
    mode = env.get("GEMINI_TRAFFIC_MODE", "interleaved").strip()
    if mode not in ("interleaved", "immediate"):
        raise ConfigError(f"GEMINI_TRAFFIC_MODE must be interleaved or immediate, got {mode!r}")
    max_frame = _int("GEMINI_MAX_FRAME_BYTES", env.get("GEMINI_MAX_FRAME_BYTES", str(64 << 20)),
                     4096)
    chunk = _int("GEMINI_CHUNK_BYTES", env.get("GEMINI_CHUNK_BYTES", str(16 << 20)), 4096,
                 max_frame) // 8 * 8
    placement = make_placement(
        parse_peers(env.get("GEMINI_PEERS", "")),
        parse_ranks("GEMINI_HOLD_RANKS", env.get("GEMINI_HOLD_RANKS", ""), world),
        parse_ranks("GEMINI_SEND_TO", env.get("GEMINI_SEND_TO", ""), world),
        rank, world,
    )
    return SidecarConfig(
        job=job,
        rank=rank,
        world_size=world,
        bind_host=env.get("GEMINI_POD_IP") or env.get("GEMINI_BIND_ADDRESS") or "127.0.0.1",
        peer_port=peer_port,
        api_port=_int("GEMINI_SIDECAR_API_PORT",
                      env.get("GEMINI_SIDECAR_API_PORT", api_default), 0, 65535),
        probe_port=_int("GEMINI_SIDECAR_PROBE_PORT", env["GEMINI_SIDECAR_PROBE_PORT"], 0, 65535)
        if env.get("GEMINI_SIDECAR_PROBE_PORT") else None,
        placement=placement,
        memory_budget_bytes=_int("GEMINI_MEMORY_BUDGET_BYTES",
                                 _required(env, "GEMINI_MEMORY_BUDGET_BYTES"), 0),
        auth_token=token,
        shm_dir=Path(env.get("GEMINI_SHM_DIR", "/dev/shm")),
        heartbeat_file=Path(env["GEMINI_HEARTBEAT_FILE"]) if env.get(
            "GEMINI_HEARTBEAT_FILE") else None,
        traffic_mode="immediate" if mode == "immediate" else "interleaved",
        chunk_bytes=chunk,
        max_frame_bytes=max_frame,
        s3=_s3_from_env(env),
        replicas=_int("GEMINI_REPLICAS", env.get("GEMINI_REPLICAS", "0"), 0, world),
        limits=_limits_from_env(env),
        check_senders=_sender_check(env),
        control_public_key=_control_public_key(env),
        namespace=namespace_from_env(env, "S3 keys and the metrics' geminijob_namespace label"),
        job_uid=env.get("GEMINI_JOB_UID", "").strip(),
        peer_encryption=_peer_encryption(env),
    )
