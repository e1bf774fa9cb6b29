"""A version is acknowledged to the trainer (in its slot file) only once every peer of the
placement has it, and never before a placement with m-1 peers arrived."""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path

import pytest

from gemini.slots.layout import shard_path
from gemini.slots.shard import ShardSlots
from gemini_sidecar.app import Sidecar
from gemini_sidecar.config import PeerAddress, SidecarConfig, make_placement
from tests.integration.sidecar.conftest import (
    free_port,
    make_config,
    payload,
    replica_complete,
    started,
    wait_for,
    write_local,
)

pytestmark = pytest.mark.integration


def acknowledged(sidecar: Sidecar) -> int:
    with ShardSlots(shard_path(sidecar.cfg.rank, sidecar.cfg.shm_dir, sidecar.cfg.job)) as s:
        return s.acknowledged_seq


def pair(tmp_path: Path, placed: bool = True) -> tuple[SidecarConfig, SidecarConfig]:
    """Rank 0 sends to rank 1 (m = 2); without `placed`, neither has a placement yet."""
    ports = {0: free_port(), 1: free_port()}
    return (make_config(0, 2, tmp_path, ports, send_to=(1,) if placed else (), replicas=2),
            make_config(1, 2, tmp_path, ports, hold=(0,) if placed else (), replicas=2))


async def test_a_version_is_acknowledged_once_the_peer_has_it(tmp_path):
    async with started(*pair(tmp_path)) as (a, b):
        info = write_local(a.cfg, 1, payload(1, 1 << 20))
        a.notify(1, 0.0)
        await wait_for(partial(replica_complete, b, 0, 1), what="version 1 at rank 1")
        await wait_for(lambda: acknowledged(a) == info.seq, what="the acknowledgement")
        assert a.replicator.status.acknowledged_version == 1


async def test_nothing_is_acknowledged_before_the_placement_then_the_newest_is_sent(tmp_path):
    async with started(*pair(tmp_path, placed=False)) as (a, b):
        info = write_local(a.cfg, 7, payload(7, 1 << 20))
        a.notify(7, 0.0)
        await asyncio.wait_for(a.replicator.idle.wait(), 10)
        assert acknowledged(a) == 0  # sent to nobody: no peer has it
        peers = {r: PeerAddress("127.0.0.1", s.cfg.peer_port) for r, s in enumerate((a, b))}
        b.set_placement(make_placement(peers, (0,), (), 1, 2))
        a.set_placement(make_placement(peers, (), (1,), 0, 2))  # no new notice from the trainer
        await wait_for(partial(replica_complete, b, 0, 7), what="version 7 at rank 1")
        await wait_for(lambda: acknowledged(a) == info.seq, what="the acknowledgement")


async def test_a_restarted_sidecar_sends_the_newest_version_without_a_notice(tmp_path):
    cfg_a, cfg_b = pair(tmp_path)
    info = write_local(cfg_a, 3, payload(3, 1 << 20))  # committed while the sidecar was down
    async with started(cfg_b, cfg_a) as (b, a):
        await wait_for(partial(replica_complete, b, 0, 3), what="version 3 at rank 1")
        await wait_for(lambda: acknowledged(a) == info.seq, what="the acknowledgement")


async def test_a_version_whose_notice_was_lost_is_still_sent(tmp_path):
    async with started(*pair(tmp_path)) as (a, b):
        info = write_local(a.cfg, 4, payload(4, 1 << 20))  # committed; no notice follows
        await wait_for(partial(replica_complete, b, 0, 4), timeout=15, what="version 4")
        await wait_for(lambda: acknowledged(a) == info.seq, what="the acknowledgement")


async def test_a_notice_of_an_older_version_withdraws_the_acknowledgement_of_the_abandoned_run(
        tmp_path):
    """After a restore of step 3 the sidecar must not go on reporting step 5 of the run that
    was abandoned as acknowledged (the operator shows it as the recoverable step)."""
    async with started(*pair(tmp_path)) as (a, _b):
        for version in (3, 5):
            write_local(a.cfg, version, payload(version, 1 << 20))
            a.notify(version, 0.0)
            await wait_for(lambda v=version: a.replicator.status.acknowledged_version == v,
                           what=f"version {version} acknowledged")
        write_local(a.cfg, 4, payload(40, 1 << 20))  # the restored run's step 4
        a.notify(4, 0.0)
        assert a.replicator.status.acknowledged_version == -1
        await wait_for(lambda: a.replicator.status.acknowledged_version == 4,
                       what="the restored run's version 4 acknowledged")
