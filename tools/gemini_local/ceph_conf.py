"""The files of a one-machine, in-memory Ceph cluster whose RADOS Gateway serves S3.

One monitor, one OSD on `memstore` (objects live in the OSD's memory), no authentication
inside the cluster, pools of size 1, and the gateway's beast frontend on loopback. This module
only lays out paths and renders `ceph.conf`; `gemini_local.s3` runs the daemons.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Unix socket paths are limited to 108 bytes; past this the admin sockets are left off.
_MAX_SOCKET_PATH = 100

RGW_NAME = "client.rgw.gemini"
MON_ID = "a"
OSD_ID = 0


@dataclass(frozen=True)
class CephLayout:
    """Where one local cluster keeps its files, and the ports it listens on (127.0.0.1)."""

    root: Path
    fsid: str
    mon_port: int
    rgw_port: int
    # What memstore reports as the OSD's size. The OSD stops writing at 97% of it (its own
    # failsafe, no manager needed): 1 GiB was full after one 4 x 256 MiB checkpoint, and the
    # next upload's requests hung until the client closed them.
    capacity_bytes: int = 8 << 30
    # Addresses the gateway listens on besides 127.0.0.1 (kubelet nodes' pods reach the host
    # at their bridge's address, not at its loopback).
    also_on: tuple[str, ...] = ()

    @property
    def conf(self) -> Path:
        return self.root / "ceph.conf"

    @property
    def monmap(self) -> Path:
        return self.root / "monmap"

    @property
    def mon_dir(self) -> Path:
        return self.root / "mon"

    @property
    def osd_dir(self) -> Path:
        return self.root / "osd"

    @property
    def osd_data(self) -> Path:
        return self.osd_dir / f"ceph-{OSD_ID}"

    @property
    def rgw_dir(self) -> Path:
        return self.root / "rgw"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def data_dirs(self) -> tuple[Path, ...]:
        """Directories wiped before each start: every start is a fresh, empty cluster."""
        return (self.mon_dir, self.osd_dir, self.rgw_dir, self.run_dir)


def render_ceph_conf(layout: CephLayout) -> str:
    """The whole ceph.conf; every path points inside `layout.root`, nothing under /var."""
    sections = [
        ("global", _global_options(layout)),
        ("mon", _mon_options(layout)),
        ("osd", _osd_options(layout)),
        (RGW_NAME, _rgw_options(layout)),
    ]
    return "\n".join(_section(name, options) for name, options in sections)


def _section(name: str, options: dict[str, str]) -> str:
    lines = [f"[{name}]", *(f"{key} = {value}" for key, value in options.items())]
    return "\n".join(lines) + "\n"


def _global_options(layout: CephLayout) -> dict[str, str]:
    root = layout.root
    admin_socket = f"{layout.run_dir}/$name.asok"
    return {
        "fsid": layout.fsid,
        "mon host": f"v2:127.0.0.1:{layout.mon_port}",
        "public addr": "127.0.0.1",
        # Only msgr2 on the monitor's one port, so nothing listens on 6789.
        "ms bind msgr1": "false",
        "auth cluster required": "none",
        "auth service required": "none",
        "auth client required": "none",
        # Daemons default to "secure" connections to the monitor, which need cephx: without
        # these the gateway never gets past AUTH_CONNECTING (EACCES).
        "ms mon client mode": "crc",
        "ms mon cluster mode": "crc",
        "ms mon service mode": "crc",
        "ms client mode": "crc",
        "ms cluster mode": "crc",
        "ms service mode": "crc",
        "keyring": "/dev/null",
        "run dir": str(layout.run_dir),
        "admin socket": admin_socket if len(admin_socket) <= _MAX_SOCKET_PATH else "",
        "log file": f"{layout.log_dir}/$name.log",
        "log to stderr": "false",
        "err to stderr": "true",
        "mon cluster log to file": "false",
        "crash dir": f"{root}/crash",
        "osd pool default size": "1",
        "osd pool default min size": "1",
        # The gateway makes 7 pools; small PG counts keep start-up quick on one OSD.
        "osd pool default pg num": "8",
        "osd pool default pgp num": "8",
        "osd pool default pg autoscale mode": "off",
        "osd crush chooseleaf type": "0",
    }


def _mon_options(layout: CephLayout) -> dict[str, str]:
    return {
        "mon data": f"{layout.mon_dir}/$cluster-$id",
        "mon allow pool size one": "true",
        "mon warn on pool no redundancy": "false",
        "mon max pg per osd": "1000",
        "mon osd down out interval": "0",
        # The monitor refuses to start below 5% free disk by default (CI saw that on a big,
        # shared disk with 15 GiB free); its store here is a few MB and objects live in memory.
        "mon data avail crit": "1",
        "mon data avail warn": "2",
        # Commit map changes (pool creation, OSD boot) without the default 1 s batching.
        "paxos propose interval": "0.05",
    }


def _osd_options(layout: CephLayout) -> dict[str, str]:
    return {
        "osd data": str(layout.osd_data),
        "osd objectstore": "memstore",
        # The size memstore reports; past 97% of it the OSD's failsafe drops every write
        # ("full status failsafe engaged" in osd.0.log) and S3 requests hang. Objects take
        # memory only as they are written, about 1.8 bytes per byte stored.
        "memstore device bytes": str(layout.capacity_bytes),
        "osd memory target": str(1 << 30),
        "osd op num shards": "2",
        "osd op num threads per shard": "2",
    }


def _rgw_options(layout: CephLayout) -> dict[str, str]:
    return {
        "rgw frontends": "beast " + " ".join(
            f"endpoint={address}:{layout.rgw_port}" for address in ("127.0.0.1", *layout.also_on)),
        "rgw data": str(layout.rgw_dir),
        # 512 worker threads by default; a handful is plenty on loopback.
        "rgw thread pool size": "64",
        "rgw init timeout": "60",
        # Deleted objects' data goes to garbage collection; reclaim it within ~20 s, not the
        # default two hours, so the OSD's memory follows what is stored (measured: it does).
        "rgw gc obj min wait": "10",
        "rgw gc processor period": "10",
        "rgw enable usage log": "false",
        "rgw enable ops log": "false",
    }
