"""Taking a checked HTTP range answer's body: RangeSink.drain reads it with readinto, straight into
the caller's buffer."""

from __future__ import annotations

import random

import pytest

from otfload.errors import SourceProtocolError
from otfload.sources.range_answer import RangeAnswer, RangeSink
from otfload.sources.retry import TransientError


def _body_reader(body: bytes, largest: int):
    """``readinto`` over ``body`` that gives at most ``largest`` bytes per call (a socket's way)."""
    at = 0
    calls = []

    def readinto(out: memoryview) -> int:
        nonlocal at
        n = min(len(out), largest, len(body) - at)
        out[:n] = body[at : at + n]
        at += n
        calls.append(len(out))
        return n

    return readinto, calls


@pytest.mark.parametrize("largest", [1, 7, 1000])
@pytest.mark.parametrize("piece", [3, 64, 4096])
def test_drain_writes_a_206_body_in_place(largest, piece):
    body = bytes(random.Random(1).randbytes(500))
    out = memoryview(bytearray(520))
    sink = RangeSink(RangeAnswer(0, 500, 500, False), out, 20, "f")
    readinto, calls = _body_reader(body, largest)
    sink.drain(readinto, piece)
    sink.finish()
    assert bytes(out[20:]) == body and bytes(out[:20]) == bytes(20)
    assert sink.done == 520 and sink.seen == 500
    assert max(calls) <= piece


def test_drain_skips_a_200_head_and_stops_once_the_wanted_bytes_are_in():
    whole = bytes(range(256)) * 4
    out = memoryview(bytearray(100))
    sink = RangeSink(RangeAnswer(300, 100, len(whole), True), out, 0, "f")
    readinto, calls = _body_reader(whole, 1000)
    sink.drain(readinto, 64)
    sink.finish()
    assert bytes(out) == whole[300:400]
    assert sink.seen == 400  # the rest of the body was left unread


def test_drain_reads_a_200_without_length_to_its_end():
    whole = bytes(range(200))
    out = memoryview(bytearray(50))
    sink = RangeSink(RangeAnswer(10, 50, len(whole), False), out, 0, "f")
    sink.drain(_body_reader(whole, 1000)[0], 16)
    sink.finish()
    assert bytes(out) == whole[10:60] and sink.seen == 200


def test_drain_rejects_a_body_longer_than_announced():
    out = memoryview(bytearray(100))
    sink = RangeSink(RangeAnswer(0, 100, 100, False), out, 0, "file.safetensors")
    with pytest.raises(SourceProtocolError, match="file.safetensors: the body is longer than the 100 bytes"):
        sink.drain(_body_reader(bytes(101), 1000)[0], 64)


def test_drain_keeps_a_short_body_and_finish_asks_for_the_rest():
    out = memoryview(bytearray(100))
    sink = RangeSink(RangeAnswer(0, 100, 100, False), out, 0, "f")
    sink.drain(_body_reader(b"\x07" * 60, 1000)[0], 16)
    assert sink.done == 60 and bytes(out[:60]) == b"\x07" * 60
    with pytest.raises(TransientError, match="ended after 60 of 100 bytes"):
        sink.finish()
