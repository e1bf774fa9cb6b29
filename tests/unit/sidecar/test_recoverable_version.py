"""A recoverable version always exists: random interleavings of snapshots (decided together
by every rank), partial and complete replications, losses and recoveries, with the real slot
file (gemini.slots) and replica store (gemini_sidecar.store). Once some version has been
acknowledged by every rank, any loss of at most m-1 machines per placement group leaves one
version with a complete copy of every shard in surviving memory, at every moment.

The same run without the overwrite rule (every rank writes at every step, as before) loses
that promise: the last test shows the check can tell."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import combinations, product
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from gemini.domain.placement import Placement, mixed_placement
from gemini.slots.layout import payload_checksum
from gemini.slots.shard import ShardSlots
from gemini_sidecar.store import ReplicaStore

SIZE = 64  # bytes of every shard version: contents are what is checked, not sizes


def data_of(rank: int, version: int, run: int) -> bytes:
    return bytes([rank, version % 256, run % 256]) * (SIZE // 3) + bytes(SIZE % 3)


@dataclass
class Machine:
    slots: ShardSlots
    store: ReplicaStore = field(default_factory=lambda: ReplicaStore(1 << 20))
    restored_seq: int = 0


class Model:
    """N ranks, their slot files and replica stores, sends in flight, and the acknowledgements
    a sidecar gives once every peer of the placement has a version."""

    def __init__(self, tmp: Path, n: int, m: int, rule: bool = True) -> None:
        self.tmp, self.m, self.rule = tmp, m, rule
        self.placement: Placement = mixed_placement(n, m)
        self.files = 0
        self.machines = {r: self._fresh(r) for r in range(n)}
        self.sends: dict[tuple[int, int], tuple[int, int]] = {}  # (from, to) -> version, seq
        self.acks: dict[tuple[int, int], set[int]] = {}  # (rank, seq) -> peers that have it
        self.acknowledged: dict[int, set[int]] = {r: set() for r in self.machines}  # versions
        self.step = 0
        self.run = 0  # bumped by each recovery: a new run writes different bytes
        self.acknowledged_once = False

    def _fresh(self, rank: int) -> Machine:
        self.files += 1
        return Machine(ShardSlots(self.tmp / f"r{rank}-{self.files}.slots", SIZE, rank=rank))

    def close(self) -> None:
        for machine in self.machines.values():
            machine.slots.close()

    # -- training --------------------------------------------------------------------------
    def snapshot(self) -> None:
        self.step += 1
        if self.rule and not all(
                m.slots.may_overwrite(max(m.slots.acknowledged_seq, m.restored_seq))
                for m in self.machines.values()):
            return  # every rank skips together
        for rank, machine in self.machines.items():
            view = machine.slots.begin(self.step, SIZE)
            view[:] = data_of(rank, self.step, self.run)
            view.release()
            info = machine.slots.commit(self.step)
            targets = self.placement.sends_to(rank)
            for peer in targets:  # a newer version supersedes the one in flight
                self.sends[(rank, peer)] = (self.step, info.seq)
            self.acks[(rank, info.seq)] = set()
            if not targets:
                self._acknowledge(rank, info.seq, self.step)

    # -- replication ---------------------------------------------------------------------------
    def deliver(self, pick: int, partial: bool) -> None:
        if not self.sends:
            return
        key = sorted(self.sends)[pick % len(self.sends)]
        rank, peer = key
        version, seq = self.sends[key]
        source = self.machines[rank].slots
        info = source.find(version)
        if info is None or info.seq != seq:  # the slot was reused: the send is void
            del self.sends[key]
            return
        data = bytes(source.read(version))
        store = self.machines[peer].store
        store.begin(rank, version, SIZE, info.checksum)
        half = SIZE // 2 if partial else SIZE
        store.chunk_view(rank, version, 0, half)[:] = data[:half]
        store.chunk_done(rank, version, 0, half, payload_checksum(data[:half]))
        if partial:
            return  # cut off mid-transfer; the send is tried again later
        store.finish(rank, version, info.checksum)
        del self.sends[key]
        self.acks.setdefault((rank, seq), set()).add(peer)
        if self.acks[(rank, seq)] >= set(self.placement.sends_to(rank)):
            self._acknowledge(rank, seq, version)

    def _acknowledge(self, rank: int, seq: int, version: int) -> None:
        """What the sidecar does once every peer has the version. The promise starts once one
        version was acknowledged by every rank (before, only S3 or a fresh start can help)."""
        self.machines[rank].slots.acknowledge(seq)
        self.acknowledged[rank].add(version)
        if set.intersection(*self.acknowledged.values()):
            self.acknowledged_once = True

    # -- failures --------------------------------------------------------------------------
    def loss_sets(self) -> Iterator[set[int]]:
        """Every loss of at most m-1 machines in each group."""
        per_group = [[set(c) for k in range(self.m) for c in combinations(g, k)]
                     for g in self.placement.groups]
        for choice in product(*per_group):
            yield set().union(*choice)

    def common_versions(self, lost: set[int]) -> set[int]:
        """Versions with a complete copy of every shard in the memory that survives `lost`
        (a rank's own slots, and its peers' replica stores)."""
        common: set[int] | None = None
        for rank, holders in self.placement.holders.items():
            have = set()
            if rank not in lost:
                have |= {i.version for i in self.machines[rank].slots.slot_info() if i.complete}
            for peer in holders[1:]:
                if peer not in lost:
                    have |= {c.version for c in self.machines[peer].store.inventory()
                             if c.rank == rank and c.complete}
            common = have if common is None else common & have
        return common or set()

    def check(self) -> None:
        if not self.acknowledged_once:
            return  # nothing was on every holder yet: S3 or a fresh start
        for lost in self.loss_sets():
            assert self.common_versions(lost), (
                f"losing {sorted(lost)} leaves no version complete for every rank at step "
                f"{self.step}")

    def lose_and_recover(self, pick: int) -> None:
        if not self.acknowledged_once:
            return
        options = list(self.loss_sets())
        lost = options[pick % len(options)]
        version = max(self.common_versions(lost))
        copies = {r: self._copy_of(r, version, lost) for r in self.placement.holders}
        for rank in lost:
            self.machines[rank].slots.close()
            self.machines[rank] = self._fresh(rank)
            self.acknowledged[rank] = set(set.intersection(*self.acknowledged.values()))
        for rank, data in copies.items():  # every rank restores `version`
            slots = self.machines[rank].slots
            if slots.find(version) is None:
                slots.put(version, [data], payload_checksum(data))
            slots.drop_newer_than(version)
            self.machines[rank].restored_seq = slots.find(version).seq
        for rank in self.machines:  # every holder pulls the replicas it lacks, at that version
            for owner in self.placement.receives_from(rank):
                store = self.machines[rank].store
                if any(c.rank == owner and c.version == version and c.complete
                       for c in store.inventory()):
                    continue
                store.begin(owner, version, SIZE, payload_checksum(copies[owner]))
                store.chunk_view(owner, version, 0, SIZE)[:] = copies[owner]
                store.chunk_done(owner, version, 0, SIZE, payload_checksum(copies[owner]))
                store.finish(owner, version, payload_checksum(copies[owner]))
        self.sends.clear()  # the replicators drop what was in flight
        self.step, self.run = version, self.run + 1

    def _copy_of(self, rank: int, version: int, lost: set[int]) -> bytes:
        if rank not in lost and (info := self.machines[rank].slots.find(version)):
            return bytes(self.machines[rank].slots.read(info.version))
        for peer in self.placement.holders[rank][1:]:
            if peer not in lost:
                for copy in self.machines[peer].store.inventory():
                    if copy.rank == rank and copy.version == version and copy.complete:
                        return bytes(self.machines[peer].store.get(rank, version)[1])
        raise AssertionError(f"no copy of rank {rank} version {version}")


ACTIONS = st.lists(st.tuples(st.sampled_from(["snapshot", "deliver", "cut", "lose"]),
                             st.integers(0, 1000)), min_size=5, max_size=80)


def play(model: Model, actions: list[tuple[str, int]]) -> None:
    for action, pick in actions:
        if action == "snapshot":
            model.snapshot()
        elif action == "deliver":
            model.deliver(pick, partial=False)
        elif action == "cut":
            model.deliver(pick, partial=True)
        else:
            model.lose_and_recover(pick)
        model.check()


@settings(max_examples=150, deadline=None)
@given(shape=st.sampled_from([(4, 2), (5, 2), (6, 3), (3, 1), (7, 3)]), actions=ACTIONS)
def test_a_common_version_survives_any_m_minus_1_losses_per_group(tmp_path_factory, shape,
                                                                  actions):
    model = Model(tmp_path_factory.mktemp("slots"), *shape)
    try:
        play(model, actions)
    finally:
        model.close()


def test_without_the_overwrite_rule_the_check_finds_a_loss(tmp_path):
    # Rank 0 and 1 are one group (m = 2): version 1 reaches the peers, then versions 2 and 3
    # are written but never sent; every own slot has {2, 3}, every peer holds only 1.
    model = Model(tmp_path, 4, 2, rule=False)
    try:
        model.snapshot()
        for _ in range(4):
            model.deliver(0, partial=False)
        model.check()
        model.snapshot()
        model.snapshot()
        try:
            model.check()
        except AssertionError:
            return
        raise AssertionError("overwriting without acknowledgements kept a common version")
    finally:
        model.close()
