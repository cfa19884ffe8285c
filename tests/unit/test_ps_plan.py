"""Parameter-server plans and rules without communication: roles, key placement, the
consistency rules of a shard, optimizer specs and server checkpoints."""
from __future__ import annotations

import random

import pytest
import torch

from psrt.config import config_from_env
from psrt.errors import ArgumentTypeError, InvalidArgumentError, ParameterServerError
from psrt.ps import checkpoint
from psrt.ps import pushes as pushes_module
from psrt.ps.placement import Placement
from psrt.ps.pushes import PostedPushes
from psrt.ps.protocol import Mode, RequestKind
from psrt.ps.roles import assign_roles
from psrt.ps.store import Store
from psrt.ps.shard import ChunkMeta, Consistency, OptimizerSpec, Shard, optimizer_spec
from psrt.ps.stalls import holds, waits

MiB = 1 << 20


# -- roles ---------------------------------------------------------------------------------
def test_servers_are_spread_over_hosts_and_take_their_highest_ranks():
    roles = assign_roles(["a"] * 4 + ["b"] * 4, 2)
    assert roles.servers == (3, 7)
    assert roles.workers == (0, 1, 2, 4, 5, 6)
    assert roles.worker_index(4) == 3 and roles.server_index(7) == 1


def test_one_host_gives_the_last_ranks_to_servers():
    assert assign_roles([0, 0, 0], 1).servers == (2,)
    assert assign_roles([0, 0, 0, 0], 2).servers == (2, 3)


def test_more_servers_than_hosts_go_round_robin():
    roles = assign_roles(["a", "a", "a", "b", "b", "b"], 3)
    assert roles.servers == (1, 2, 5)


@pytest.mark.parametrize("servers", [0, 3, 5])
def test_a_job_needs_a_server_and_a_worker(servers):
    with pytest.raises(InvalidArgumentError, match="at least one server and one worker"):
        assign_roles([0, 0, 0], servers)


def test_num_servers_comes_from_the_environment():
    config = config_from_env({"PSRT_NUM_SERVERS": "2", "PSRT_PS_CHUNK_BYTES": "1024"})
    assert (config.num_servers, config.ps_chunk_bytes) == (2, 1024)
    with pytest.raises(InvalidArgumentError, match="PSRT_PS_CHUNK_BYTES"):
        config_from_env({"PSRT_PS_CHUNK_BYTES": "0"})


@pytest.mark.parametrize("value", ["1", "255"])
def test_a_chunk_size_below_the_floor_is_refused_naming_the_variable_and_the_floor(value):
    """Each chunk is a message of its own: 1-byte chunks made a 64 KiB push take 32 s."""
    with pytest.raises(InvalidArgumentError, match=f"PSRT_PS_CHUNK_BYTES='{value}' is out of range: it must be "
                                                   "between 256 and"):
        config_from_env({"PSRT_PS_CHUNK_BYTES": value})
    assert config_from_env({"PSRT_PS_CHUNK_BYTES": "256"}).ps_chunk_bytes == 256


# -- placement -----------------------------------------------------------------------------
def test_large_keys_are_split_into_contiguous_chunks_over_all_servers():
    placement = Placement(num_servers=4, chunk_bytes=1 * MiB)
    chunks = placement.add("embedding", 10 * MiB // 4 + 3, 4)
    assert sum(c.numel for c in chunks) == 10 * MiB // 4 + 3
    assert [c.offset for c in chunks] == [sum(c.numel for c in chunks[:i]) for i in range(len(chunks))]
    assert max(c.numel for c in chunks) * 4 <= 1 * MiB + 4
    assert {c.server for c in chunks} == {0, 1, 2, 3}


def test_small_keys_go_whole_to_the_least_loaded_server():
    placement = Placement(num_servers=2, chunk_bytes=1 * MiB)
    placement.add("big", 3 * MiB // 4, 4)   # three chunks: servers 0, 1, 0
    (bias,) = placement.add("bias", 10, 4)
    assert bias.server == 1 and bias.numel == 10


@pytest.mark.parametrize("servers", [1, 2, 3, 5])
def test_placement_balances_bytes_within_one_chunk_of_the_mean(servers):
    chunk_bytes = 4 * MiB
    rng = random.Random(servers)
    placement = Placement(servers, chunk_bytes)
    for i in range(60):
        placement.add(f"p{i}", rng.choice([10, 1000, 300_000, 2_000_000, 9_000_000]), 4)
    mean = sum(placement.loads) / servers
    assert max(placement.loads) - mean <= chunk_bytes
    assert sum(placement.loads) == sum(c.numel * 4 for c in placement.chunks)


def test_placement_is_the_same_for_the_same_keys_in_the_same_order():
    def plan():
        placement = Placement(3, 1 * MiB)
        for i, numel in enumerate([5, 700_000, 1, 3_000_000, 42]):
            placement.add(f"k{i}", numel, 4)
        return placement.chunks
    assert plan() == plan()


def test_a_key_is_placed_once():
    placement = Placement(1, 1024)
    placement.add("w", 10, 4)
    with pytest.raises(InvalidArgumentError, match="already placed"):
        placement.add("w", 10, 4)


# -- shard rules -----------------------------------------------------------------------------
def make_shard(mode: Mode, workers: int = 2, staleness: int = 0, scale: float = 1.0) -> Shard:
    meta = ChunkMeta(key="w", shape=(4,), dtype=torch.float64, offset=0, numel=4)
    shard = Shard(meta, workers, Consistency(mode, staleness, scale))
    shard.set_value(torch.zeros(4, dtype=torch.float64))
    return shard


def push(shard: Shard, worker: int, value: float) -> None:
    buffer = shard.expect_push(worker)
    buffer.fill_(value)
    shard.arrived(worker, buffer)


def test_sync_applies_one_mean_update_once_every_worker_pushed():
    shard = make_shard(Mode.SYNC, workers=2, scale=0.5)
    shard.set_optimizer(OptimizerSpec("SGD", {"lr": 1.0}))
    push(shard, 0, 2.0)
    shard.add_pull(0, tag=10)
    assert shard.apply_ready() == 0 and shard.ready_pulls([0, 1]) == []
    push(shard, 1, 4.0)
    assert shard.apply_ready() == 1
    assert [p.worker for p in shard.ready_pulls([0, 1])] == [0]
    assert torch.equal(shard.value, torch.full((4,), -3.0, dtype=torch.float64))
    assert shard.applied == [1, 1] and shard.pushes_applied == 2


def test_sync_pull_names_the_workers_it_waits_for():
    shard = make_shard(Mode.SYNC, workers=3)
    push(shard, 0, 1.0)
    shard.add_pull(0, tag=10)
    push(shard, 2, 1.0)
    assert shard.missing_for(shard.pulls[0], [0, 1, 2]) == [1]


def test_async_applies_every_push_on_arrival_exactly_once():
    shard = make_shard(Mode.ASYNC)
    for value in (1.0, 2.0, 3.0):
        push(shard, 0, value)
    assert shard.apply_ready() == 3
    assert shard.applied == [3, 0] and shard.updates == 3
    assert torch.equal(shard.value, torch.full((4,), 3.0, dtype=torch.float64))  # no optimizer: assign


def test_a_pull_waits_for_the_workers_own_pushes_before_it():
    shard = make_shard(Mode.ASYNC)
    buffer = shard.expect_push(0)   # announced, data still in flight
    shard.add_pull(0, tag=10)
    shard.apply_ready()
    assert shard.ready_pulls([0, 1]) == []
    shard.arrived(0, buffer)
    shard.apply_ready()
    assert len(shard.ready_pulls([0, 1])) == 1


def test_bounded_holds_a_worker_more_than_tau_steps_ahead():
    shard = make_shard(Mode.BOUNDED, staleness=1)
    push(shard, 0, 1.0)
    shard.apply_ready()
    shard.add_pull(0, tag=10)
    assert len(shard.ready_pulls([0, 1])) == 1          # one step ahead: allowed
    push(shard, 0, 1.0)
    assert shard.apply_ready() == 0                     # two ahead: held until worker 1 pushes
    shard.add_pull(0, tag=13)
    assert shard.ready_pulls([0, 1]) == []
    assert shard.missing_for(shard.pulls[0], [0, 1]) == [1]
    push(shard, 1, 1.0)
    assert shard.apply_ready() == 2
    assert len(shard.ready_pulls([0, 1])) == 1
    assert max(shard.staleness) <= 1


def test_bounded_with_tau_zero_applies_a_step_only_once_every_worker_pushed_it():
    shard = make_shard(Mode.BOUNDED, staleness=0)
    push(shard, 0, 1.0)
    assert shard.apply_ready() == 0
    push(shard, 1, 1.0)
    assert shard.apply_ready() == 2 and shard.applied == [1, 1]


def test_bounded_stops_waiting_for_a_worker_that_left():
    shard = make_shard(Mode.BOUNDED, staleness=0)
    push(shard, 0, 1.0)
    shard.apply_ready()
    shard.add_pull(0, tag=10)
    assert shard.ready_pulls([0, 1]) == []
    shard.apply_ready([0])
    assert len(shard.ready_pulls([0])) == 1


def test_bounded_with_tau_zero_computes_what_sync_does_for_sgd():
    sync = make_shard(Mode.SYNC, scale=0.5)
    bounded = make_shard(Mode.BOUNDED, staleness=0, scale=0.5)
    for shard in (sync, bounded):
        shard.set_optimizer(OptimizerSpec("SGD", {"lr": 0.1}))
        for step in range(3):
            push(shard, 0, 1.0 + step)
            push(shard, 1, -0.25 * step)
            shard.apply_ready()
    torch.testing.assert_close(sync.value, bounded.value)


def test_no_update_while_a_reply_is_still_reading_the_value():
    shard = make_shard(Mode.ASYNC)
    shard.sending = 1
    push(shard, 0, 1.0)
    assert shard.apply_ready() == 0
    shard.sending = 0
    assert shard.apply_ready() == 1


# -- optimizer specs and checkpoints ---------------------------------------------------------------
def test_optimizer_spec_accepts_classes_and_names_and_checks_options():
    assert optimizer_spec(torch.optim.Adam, {"lr": 0.1, "betas": (0.8, 0.9)}).hyperparameters["betas"] == [0.8, 0.9]
    assert optimizer_spec("sgd", {"lr": 0.1}).name == "SGD"
    with pytest.raises(InvalidArgumentError, match="unknown optimizer 'Sgdd'"):
        optimizer_spec("Sgdd", {})
    with pytest.raises(ArgumentTypeError):
        optimizer_spec(42, {})
    with pytest.raises(ValueError, match="momentum"):
        optimizer_spec("SGD", {"lr": 0.1, "momentum": -1.0})


def store_with_momentum(scale: float = 1.0) -> Store:
    store = Store((int(Mode.SYNC), 0, 0), Consistency(Mode.SYNC, 0, scale),
                   optimizer=OptimizerSpec("SGD", {"lr": 0.1, "momentum": 0.9}))
    store.shards[0] = make_shard(Mode.SYNC)
    store.shards[0].set_optimizer(store.optimizer)
    return store


def test_checkpoint_restores_value_momentum_and_clocks(tmp_path):
    store = store_with_momentum()
    for step in range(2):
        push(store.shards[0], 0, 1.0)
        push(store.shards[0], 1, 2.0)
        store.shards[0].apply_ready()
    checkpoint.save_server(str(tmp_path), 0, 1, {0: store}, "id")
    restored = store_with_momentum()
    assert checkpoint.load_server(str(tmp_path), 0, 1, {0: restored}, "id", restore=False) == {}
    assert restored.shards[0].applied == [0, 0], "checking restores nothing"
    assert checkpoint.load_server(str(tmp_path), 0, 1, {0: restored}, "id") == {"steps": {0: 2}}
    for shard in (store.shards[0], restored.shards[0]):   # one more step on both
        push(shard, 0, 1.0)
        push(shard, 1, 2.0)
        shard.apply_ready()
    assert torch.equal(store.shards[0].value, restored.shards[0].value)
    assert restored.shards[0].applied == [3, 3]


def test_checkpoint_of_another_layout_or_server_count_is_refused(tmp_path):
    store = store_with_momentum()
    checkpoint.save_server(str(tmp_path), 0, 1, {0: store}, "id")
    with pytest.raises(ParameterServerError, match="another number of servers"):
        checkpoint.load_server(str(tmp_path), 0, 2, {0: store}, "id")
    with pytest.raises(ParameterServerError, match="another save"):
        checkpoint.load_server(str(tmp_path), 0, 1, {0: store}, "other id")
    other = store_with_momentum()
    other.shards[0].meta = ChunkMeta(key="v", shape=(4,), dtype=torch.float64, offset=0, numel=4)
    with pytest.raises(ParameterServerError, match="different model"):
        checkpoint.load_server(str(tmp_path), 0, 1, {0: other}, "id")
    adam = store_with_momentum()
    adam.optimizer = OptimizerSpec("Adam", {"lr": 0.1})
    with pytest.raises(ParameterServerError, match="saved with optimizer SGD, this job set Adam"):
        checkpoint.load_server(str(tmp_path), 0, 1, {0: adam}, "id")


def test_a_manifest_says_which_save_finished(tmp_path):
    assert "manifest.json is missing" in checkpoint.read_manifest(str(tmp_path))
    checkpoint.write_manifest(str(tmp_path), "abc", 2)
    assert checkpoint.read_manifest(str(tmp_path))["save_id"] == "abc"
    (tmp_path / "manifest.json").write_text("{not json")
    assert "cannot read" in checkpoint.read_manifest(str(tmp_path))


def test_async_without_optimizer_stores_each_pushed_value_unscaled():
    shard = make_shard(Mode.ASYNC, scale=0.5)
    push(shard, 0, 8.0)
    shard.apply_ready()
    assert torch.equal(shard.value, torch.full((4,), 8.0, dtype=torch.float64))


# -- store rules and stall reports -----------------------------------------------------------------
def meta_of(shape) -> ChunkMeta:
    return ChunkMeta(key="w", shape=tuple(shape), dtype=torch.float32, offset=0, numel=4)


def test_worker_0s_init_defines_a_chunk_and_earlier_inits_wait_for_it():
    store = Store.create((int(Mode.SYNC), 0, 0), num_workers=3)
    assert store.register(1, 0, 10, meta_of((4,)), None, 3, worker_0_gone=False) == (None, [])
    assert store.register(2, 0, 13, meta_of((2, 2)), None, 3, worker_0_gone=False) == (None, [])
    created, answers = store.register(0, 0, 16, meta_of((4,)), torch.zeros(4), 3, worker_0_gone=False)
    assert created is store.shards[0]
    assert [(who, error is None) for who, _, error in answers] == [(1, True), (2, False), (0, True)]
    assert "[2, 2]" in answers[1][2] and "[4]" in answers[1][2]


def test_an_init_waiting_for_a_departed_worker_0_fails():
    store = Store.create((int(Mode.SYNC), 0, 0), num_workers=2)
    store.register(1, 0, 10, meta_of((4,)), None, 2, worker_0_gone=False)
    assert [who for who, _, _ in store.refuse_waiting_inits()] == [1]
    with pytest.raises(ParameterServerError, match="worker 0, whose value it waits for, has shut down"):
        store.register(1, 1, 13, meta_of((4,)), None, 2, worker_0_gone=True)


def test_stores_created_with_other_settings_are_refused():
    store = Store.create((int(Mode.BOUNDED), 2, 0), num_workers=2)
    with pytest.raises(ParameterServerError, match="mode='async'.*mode='bounded', max_staleness=2"):
        store.check_settings(1, 0, (int(Mode.ASYNC), 0, 0))


def test_stall_descriptions_name_the_missing_workers():
    store = Store.create((int(Mode.SYNC), 0, 0), num_workers=2)
    store.register(0, 0, 10, meta_of((4,)), torch.zeros(4), 2, worker_0_gone=False)
    push(store.shards[0], 0, 1.0)
    store.shards[0].add_pull(0, tag=13)
    gathering = {RequestKind.SAVE: {0: (16, {"path": "x"}, 50.0)}, RequestKind.LOAD: {}}
    held = list(waits({0: store}, gathering, [0, 1], job_rank=[0, 2]))
    assert "needs pushes from worker 1" in held[0].describe() and held[0].peer_ranks() == (2,)
    assert held[1].describe().startswith("save asked for by workers 0")
    assert "worker 1 did not ask" in held[1].describe() and held[1].peer_ranks() == (2,)


def held_store(mode: Mode, staleness: int = 0) -> Store:
    store = Store.create((int(mode), staleness, 0), num_workers=3)
    store.register(0, 0, 10, meta_of((4,)), torch.zeros(4), 3, worker_0_gone=False)
    return store


NO_GATHERING = {RequestKind.SAVE: {}, RequestKind.LOAD: {}}
JOB_RANK = [0, 1, 2]  # workers 0-2 are job ranks 0-2 (the server is rank 3)


def test_a_held_sync_pull_waits_for_the_workers_yet_to_push_its_step():
    store = held_store(Mode.SYNC)
    shard = store.shards[0]
    push(shard, 0, 1.0)
    shard.add_pull(0, tag=13)
    shard.expect_push(2)  # announced, data still arriving: worker 2 has done its part
    assert holds({0: store}, NO_GATHERING, [0, 1, 2], JOB_RANK) == [[0, 13, [1]]]


def test_an_async_pull_waits_for_no_other_worker():
    store = held_store(Mode.ASYNC)
    shard = store.shards[0]
    shard.expect_push(0)  # its own push, still arriving
    shard.add_pull(0, tag=13)
    assert shard.pulls and holds({0: store}, NO_GATHERING, [0, 1, 2], JOB_RANK) == []


def test_a_server_lists_its_oldest_held_requests_only(monkeypatch):
    monkeypatch.setattr("psrt.ps.stalls.MAX_HOLDS", 2)
    store = held_store(Mode.SYNC)
    shard = store.shards[0]
    push(shard, 0, 1.0)
    for tag in (13, 16, 19):
        shard.add_pull(0, tag=tag)
    shard.pulls[0].since += 10.0  # the first pull made is the youngest wait here
    assert holds({0: store}, NO_GATHERING, [0, 1, 2], JOB_RANK) == [[0, 16, [1, 2]], [0, 19, [1, 2]]]


def test_a_bounded_pull_ahead_of_the_slowest_waits_for_the_slowest_only():
    store = held_store(Mode.BOUNDED, staleness=1)
    shard = store.shards[0]
    for worker, steps in ((0, 3), (1, 2), (2, 1)):
        for _ in range(steps):
            push(shard, worker, 1.0)
    shard.apply_ready([0, 1, 2])
    shard.add_pull(0, tag=13)  # worker 0 is 2 steps ahead of worker 2, 1 of worker 1
    assert shard.ready_pulls([0, 1, 2]) == []
    assert holds({0: store}, NO_GATHERING, [0, 1, 2], JOB_RANK) == [[0, 13, [2]]]


def test_held_inits_wait_for_worker_0_and_saves_for_the_workers_that_did_not_ask():
    store = Store.create((int(Mode.SYNC), 0, 0), num_workers=3)
    store.register(1, 0, 21, meta_of((4,)), None, 3, worker_0_gone=False)
    gathering = {RequestKind.SAVE: {0: (16, {"path": "x"}, 50.0)}, RequestKind.LOAD: {}}
    store.init_waiting[0][0] = (*store.init_waiting[0][0][:3], 60.0)
    assert holds({0: store}, gathering, [0, 1, 2], [0, 2, 3]) == [[0, 16, [2, 3]], [2, 21, [0]]]
    gathering[RequestKind.SAVE][2] = (30, {"path": "x"}, 51.0)
    assert holds({}, gathering, [0, 2], [0, 2, 3]) == [], "worker 1 left: the save waits for no worker"


# -- posted push receives ----------------------------------------------------------------------------
class Wire:
    """Messages in flight to one server, by (source, tag), and the persistent receives it
    was asked to set up: a receive started completes once a message is there to copy in."""

    def __init__(self) -> None:
        self.messages: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.setups = self.starts = self.frees = 0

    def deliver(self, source: int, tag: int, data: torch.Tensor) -> None:
        self.messages.setdefault((source, tag), []).append(data)

    def persistent_recv(self, tensor: torch.Tensor, source: int, tag: int):
        wire = self
        wire.setups += 1

        class Receive:
            def start(self):
                wire.starts += 1
                return self

            def test(self) -> bool:
                queue = wire.messages.get((source, tag))
                if not queue:
                    return False
                data = queue.pop(0)
                tensor[:data.numel()].copy_(data)
                return True

            def free(self) -> None:
                wire.frees += 1

        return Receive()


def _push(wire: Wire, pushes: PostedPushes, shard: Shard, value: float) -> None:
    wire.deliver(5, 7, torch.full((4,), value))
    pushes.announce(0, shard, accepted=True)
    assert pushes.poll() == [shard]
    assert shard.apply_ready() == 1
    assert shard.value.tolist() == [value] * 4


def test_push_receives_are_set_up_once_per_buffer_and_started_per_push():
    wire, shard = Wire(), make_shard(Mode.ASYNC, workers=1)
    pushes = PostedPushes(wire, ranks=[5])
    pushes.open(0, shard, tag=7)
    for step in range(10):
        _push(wire, pushes, shard, float(step))
    # the value's buffer and two spares take turns: three set-ups, a start for each push and the next
    assert (wire.setups, wire.starts, wire.frees) == (3, 11, 0)
    pushes.close(0)
    wire.deliver(5, 7, torch.empty(0))  # the worker's closing empty message
    assert pushes.poll() == [] and not pushes.open_slots
    assert wire.frees == wire.setups


def test_a_slot_whose_buffers_keep_changing_releases_its_oldest_receives(monkeypatch):
    wire, shard = Wire(), make_shard(Mode.ASYNC, workers=1)
    monkeypatch.setattr(shard, "spare_buffer", lambda: torch.empty(4))  # never the same buffer twice
    pushes = PostedPushes(wire, ranks=[5])
    pushes.open(0, shard, tag=7)
    for step in range(12):
        _push(wire, pushes, shard, float(step))
    assert wire.setups == 13 and wire.frees == 13 - pushes_module._RECEIVES_PER_SLOT
    pushes.close(0)
    wire.deliver(5, 7, torch.empty(0))
    assert pushes.poll() == [] and wire.frees == wire.setups
