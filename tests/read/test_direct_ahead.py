"""Cold O_DIRECT runs read ahead of the builders into a bounded ring (otfload.read.direct_ahead):
the same values and the same counted bytes as the builders' own reads, every run read once, room
bounded by the ring, and a failed read ahead read again by the builder, which reports the error."""

import threading

import numpy as np
import pytest

from otfload.accounting.meter import FetchMeter, metering
from otfload.errors import SourceError
from otfload.index.checkpoint import open_index
from otfload.plan.boxes import box_to_slices
from otfload.read.arena import Arena
from otfload.read.direct_ahead import DirectAhead, _Ring, direct_runs
from otfload.read.reader import TensorReader
from otfload.sources import LocalSource
from otfload.sources.local import DIRECT_ALIGN
from tests.helpers import evict
from tests.synthetic import write_checkpoint


def drop_pages(directory):
    for path in directory.glob("*.safetensors"):
        evict(path)


def test_ring_hands_out_room_in_order_and_reuses_it_once_the_oldest_is_back():
    ring = _Ring(100)
    assert (ring.take(40), ring.take(40), ring.take(40)) == (0, 40, None)
    ring.give_back(40)  # given back before the older one: its room waits for that one
    assert ring.take(30) is None
    ring.give_back(0)
    assert (ring.take(30), ring.take(30), ring.take(50), ring.take(20)) == (0, 30, None, 60)
    ring.give_back(0)
    ring.give_back(30)
    assert ring.take(50) == 0  # [60, 80) still out: 50 bytes do not fit after it, they do before it
    assert ring.take(30) is None  # wrapped: [50, 60) and [80, 100) are free but too small
    ring.give_back(60)
    assert ring.take(50) == 50
    ring.give_back(0)
    ring.give_back(50)
    assert ring.take(100) == 0
    assert _Ring(10).take(11) is None  # larger than the ring: never


@pytest.fixture
def cold(tmp_path, closing):
    rng = np.random.default_rng(0)
    tensors = {f"l.{i}.w": rng.standard_normal((256, 1000 + i), dtype=np.float32) for i in range(6)}
    directory = write_checkpoint(tmp_path / "c", tensors, files=2)
    source = closing(LocalSource(directory))
    index = open_index(source, require_config=False)
    reader = TensorReader(source)
    assert reader.use_direct(source.list_files())
    drop_pages(directory)
    return source, index, reader, tensors


def runs_of(index, names):
    out = []
    for name in names:
        info = index.tensors[name]
        out.append((info.file, info.offset // DIRECT_ALIGN * DIRECT_ALIGN,
                    -(-(info.offset + info.nbytes) // DIRECT_ALIGN) * DIRECT_ALIGN))
    return out


def read_all(reader, index, tensors, names, arena):
    meter = FetchMeter()
    with metering(meter):
        for name in names:
            info = index.tensors[name]
            box = tuple((0, n) for n in info.shape)
            got = reader.read_box(info, box, arena)
            np.testing.assert_array_equal(got, tensors[name][box_to_slices(box)])
            arena.reset()
    return meter


def test_runs_read_ahead_equal_the_builders_own_reads_and_count_the_same(cold):
    source, index, reader, tensors = cold
    names = sorted(tensors)
    reader_alone = TensorReader(source)
    reader_alone.use_direct(source.list_files())
    alone = read_all(reader_alone, index, tensors, names, Arena())
    with DirectAhead(source, runs_of(index, names), ring_bytes=3 << 20) as ahead:
        reader.ahead = ahead
        meter = read_all(reader, index, tensors, names, Arena())
        assert ahead.unclaimed == 0
    assert (meter.bytes, meter.requests) == (alone.bytes, alone.requests)
    assert meter.bytes >= sum(t.nbytes for t in tensors.values())
    # every run read once: by the threads, or (where they had not reached it yet) by the reader
    assert 0 < ahead.read_ahead <= meter.bytes


def test_a_run_claimed_before_the_walker_reaches_it_is_read_by_the_claimer_and_skipped(cold):
    source, index, reader, tensors = cold
    names = sorted(tensors)
    gate = threading.Event()

    def slow_runs():
        gate.wait(10)  # the walker starts only once the reader has read the first two itself
        yield from runs_of(index, names)

    with DirectAhead(source, slow_runs(), ring_bytes=8 << 20) as ahead:
        reader.ahead = ahead
        read_all(reader, index, tensors, names[:2], Arena())
        gate.set()
        read_all(reader, index, tensors, names[2:], Arena())
        ahead.close()
        assert ahead.unclaimed == 0
        first_two = sum(end - start for _, start, end in runs_of(index, names[:2]))
        assert ahead.read_ahead <= sum(end - start for _, start, end in runs_of(index, names)) - first_two


def test_room_stays_within_the_ring_and_comes_back_when_the_arena_resets(cold):
    source, index, reader, tensors = cold
    names = sorted(tensors)
    size = max(end - start for _, start, end in runs_of(index, names))
    with DirectAhead(source, runs_of(index, names), ring_bytes=2 * size) as ahead:
        reader.ahead = ahead
        arena = Arena()
        for name in names:  # without resets only two runs ever fit: the rest are read into the arena
            info = index.tensors[name]
            box = tuple((0, n) for n in info.shape)
            np.testing.assert_array_equal(reader.read_box(info, box, arena), tensors[name])
        assert ahead.claimed <= 2 * size
        arena.reset()  # the room comes back
        ahead.close()
        assert ahead.unclaimed == 0
        assert ahead._ring.take(2 * size) == 0  # all of it free again


class FailingSource(LocalSource):
    """Reads with O_DIRECT fail once the checkpoint is 'unplugged'."""

    unplugged = False

    def read_direct_into(self, file, offset, out):
        if self.unplugged:
            raise SourceError(f"{file}: cannot read: unplugged")
        return super().read_direct_into(file, offset, out)


def test_a_failed_read_ahead_is_read_again_by_the_builder_which_reports_the_error(tmp_path, closing):
    rng = np.random.default_rng(1)
    tensors = {"a": rng.standard_normal((64, 512), dtype=np.float32)}
    directory = write_checkpoint(tmp_path / "f", tensors, files=1)
    source = closing(FailingSource(directory))
    index = open_index(source, require_config=False)
    reader = TensorReader(source)
    reader.use_direct(source.list_files())
    source.unplugged = True
    with DirectAhead(source, runs_of(index, ["a"]), ring_bytes=4 << 20) as ahead:
        reader.ahead = ahead
        with pytest.raises(SourceError, match="unplugged"):
            reader.read_box(index.tensors["a"], ((0, 64), (0, 512)), Arena())
        source.unplugged = False
        np.testing.assert_array_equal(reader.read_box(index.tensors["a"], ((0, 64), (0, 512)), Arena()), tensors["a"])


def test_close_releases_a_claim_waiting_on_a_run_never_read(cold):
    source, index, reader, _ = cold
    run = runs_of(index, ["l.0.w"])[0]
    started, release = threading.Event(), threading.Event()

    class Stalled(DirectAhead):
        def _read(self):  # one reader that never reads: the run stays queued
            started.set()
            release.wait(10)

    ahead = Stalled(source, [run], ring_bytes=4 << 20, depth=1).start()
    started.wait(10)
    while not ahead.unclaimed:  # the walker has queued the run
        threading.Event().wait(0.01)
    result = []
    waiter = threading.Thread(target=lambda: result.append(ahead.claim(*run)))
    waiter.start()
    waiter.join(0.2)
    release.set()
    ahead.close()
    waiter.join(10)
    assert result == [None]  # the caller reads it itself


def test_direct_runs_interleave_the_leaves_as_the_builders_take_them(tmp_path, closing, mesh_2x4):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from otfload.plan.abstract import abstract_from_pytree
    from otfload.plan.mapping import MappingTable, Rule
    from otfload.plan.planner import build_plan

    rng = np.random.default_rng(3)
    tensors = {f"{k}.{i}.w": rng.standard_normal((64, 64), dtype=np.float32) for k in "abc" for i in range(3)}
    directory = write_checkpoint(tmp_path / "o", tensors, files=1)
    source = closing(LocalSource(directory))
    index = open_index(source, require_config=False)
    sharding = NamedSharding(mesh_2x4, P(None, "fsdp", "tp"))
    abstract = {k: {"w": jax.ShapeDtypeStruct((3, 64, 64), np.float32, sharding=sharding)} for k in "abc"}
    leaves, _ = abstract_from_pytree(abstract)
    rules = tuple(Rule(f"{k}.{{layer}}.w", f"{k}.{{layer}}.w") for k in "abc")
    plan = build_plan(index, leaves, MappingTable(rules))
    reader = TensorReader(source)
    reader.use_direct(source.list_files())

    def name(start, end):  # the tensor holding the run's middle byte
        return next(n for n, i in index.tensors.items() if i.offset <= (start + end) // 2 < i.offset + i.nbytes)

    def order(builders):
        return [name(start, end) for _, start, end in direct_runs(plan, reader, ["a.w", "b.w", "c.w"], {}, builders,
                                                                DIRECT_ALIGN)]

    assert order(1) == [f"{k}.{i}.w" for k in "abc" for i in range(3)]
    # two builders: a and b side by side, c after whichever ends first
    assert order(2) == ["a.0.w", "b.0.w", "a.1.w", "b.1.w", "a.2.w", "b.2.w", "c.0.w", "c.1.w", "c.2.w"]


def test_a_cold_load_reads_ahead_and_counts_what_it_counts_without(tmp_path, closing, mesh_2x4, monkeypatch):
    """A whole load from cold O_DIRECT files (stacked layers, sharded, an unstacked leaf) with and
    without the read-ahead: the same leaves as numpy's, the same bytes and requests reported, and the
    runs taken from the ring, all of them claimed."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from otfload.place import loader
    from otfload.plan.abstract import abstract_from_pytree
    from otfload.plan.mapping import MappingTable, Rule
    from otfload.plan.planner import build_plan

    rng = np.random.default_rng(4)
    tensors = {f"l.{i}.w": rng.standard_normal((512, 768), dtype=np.float32) for i in range(6)}
    tensors["emb"] = rng.standard_normal((1000, 256), dtype=np.float32)
    directory = write_checkpoint(tmp_path / "load", tensors, files=2)
    source = closing(LocalSource(directory))
    index = open_index(source, require_config=False)
    abstract = {
        "layers": {"w": jax.ShapeDtypeStruct((6, 512, 768), np.float32,
                                             sharding=NamedSharding(mesh_2x4, P(None, "fsdp", "tp")))},
        "emb": jax.ShapeDtypeStruct((1000, 256), np.float32, sharding=NamedSharding(mesh_2x4, P("tp", None))),
    }
    leaves, _ = abstract_from_pytree(abstract)
    plan = build_plan(index, leaves, MappingTable((Rule("layers.{layer}.w", "l.{layer}.w"), Rule("emb", "emb"))))
    started = []

    def recorded(*args, **kwargs):
        ahead = loader_start(*args, **kwargs)
        started.append(ahead)
        return ahead

    loader_start = loader.start_direct_ahead
    monkeypatch.setattr(loader, "start_direct_ahead", recorded)
    reports = {}
    for ahead in (False, True):
        drop_pages(directory)
        arrays, reports[ahead] = loader.execute_plan(plan, source, read_ahead=ahead, host_memory_budget=4 << 20)
        want = {"layers.w": np.stack([tensors[f"l.{i}.w"] for i in range(6)]), "emb": tensors["emb"]}
        for path, value in want.items():
            for shard in arrays[path].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])
    (used,) = started  # read_ahead=False starts none
    assert used is not None and used.claimed > 0 and used.unclaimed == 0
    assert (reports[True].bytes_read, reports[True].requests) == (reports[False].bytes_read, reports[False].requests)
    assert reports[True].bytes_read >= sum(t.nbytes for t in tensors.values())


def test_the_ring_is_set_aside_from_the_builders_share_of_the_budget():
    from otfload.place.builder import ByteBudget

    budget = ByteBudget(1000, workers=2)
    budget.set_aside(500)  # a ring of half the budget: each builder keeps a quarter between chunks
    assert (budget.limit, budget.share) == (1000, 250)
    budget.acquire(1000)  # chunks are still admitted against the whole limit
    budget.release(1000)
