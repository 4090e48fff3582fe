"""The scratch arena: reserve makes one buffer for a whole chunk, which its takes then share."""

from otfload.read.arena import ALIGNMENT, Arena


def test_reserve_grows_once_for_the_whole_chunk():
    """After reserve, the chunk's takes all come from one buffer (no doubling series of fresh
    mappings); a reserve while takes are outstanding, or smaller than the buffer, changes nothing."""
    arena = Arena()
    arena.reserve(3 * 1000, takes=3)
    buffer = arena.capacity
    assert buffer >= 3 * 1000 + 3 * ALIGNMENT
    first = arena.take(1000)
    pieces = [first, arena.take(1000), arena.take(1000)]
    assert arena.capacity == buffer  # no growth: all three fit
    starts = [p.ctypes.data for p in pieces]
    assert starts == sorted(starts) and starts[-1] + 1000 - starts[0] <= buffer  # one buffer, in order
    arena.reserve(10**6)  # takes outstanding: nothing may move under them
    assert arena.capacity == buffer
    arena.reset()
    arena.reserve(100)
    assert arena.capacity == buffer


def test_without_reserve_takes_grow_by_doubling():
    arena = Arena()
    arena.take(1000)
    arena.take(1000)
    assert arena.capacity >= 2 * 1000 and arena.capacity != 1000
