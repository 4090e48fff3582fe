"""Counting fetches: a source's own records win over what a reader expected; nothing is counted twice."""

from __future__ import annotations

import threading

from otfload.accounting.meter import FetchMeter, current_meter, expected_fetch, fetching, metering


def test_nothing_is_counted_without_a_meter():
    assert current_meter() is None
    with fetching(100), expected_fetch(100):
        pass
    assert current_meter() is None


def test_a_child_meter_adds_to_its_parent():
    parent = FetchMeter()
    child = FetchMeter(parent=parent)
    child.add(10, 2)
    parent.add(5)
    assert (child.bytes, child.requests) == (10, 2)
    assert (parent.bytes, parent.requests) == (15, 3)


def test_a_fetch_inside_a_fetch_counts_once():
    meter = FetchMeter()
    with metering(meter):
        with fetching(100), fetching(40):  # a remote source reading its own local copy
            pass
        assert current_meter() is meter
    assert current_meter() is None
    assert (meter.bytes, meter.requests) == (100, 1)


def test_an_expected_fetch_counts_as_asked_unless_the_source_records_its_own():
    meter = FetchMeter()
    with metering(meter):
        with expected_fetch(100, 3):  # the source records nothing: as asked
            pass
        with expected_fetch(100, 3):  # the source records its coalesced runs: those count
            with fetching(120):
                pass
            with fetching(10):
                pass
    assert (meter.bytes, meter.requests) == (100 + 130, 3 + 2)


def test_metering_is_per_thread():
    meter, seen = FetchMeter(), []
    with metering(meter):
        thread = threading.Thread(target=lambda: seen.append(current_meter()))
        thread.start()
        thread.join()
    assert seen == [None]
