"""HeldSetting: on once for the first holder, off once after the last, whatever the nesting, the
threads or an error in between; what turn_on returned is what turn_off gets."""

import threading

import pytest

from otfload.held import HeldSetting


def counting():
    calls = []
    setting = HeldSetting(lambda: calls.append("on") or len(calls), lambda saved: calls.append(("off", saved)))
    return setting, calls


def test_nested_holders_turn_it_on_and_off_once():
    setting, calls = counting()
    with setting.held():
        with setting.held():
            assert calls == ["on"]
        assert calls == ["on"]
    assert calls == ["on", ("off", 1)]
    with setting.held():
        pass
    assert calls == ["on", ("off", 1), "on", ("off", 3)]


def test_an_error_still_turns_it_off():
    setting, calls = counting()
    with pytest.raises(KeyError), setting.held():
        raise KeyError("x")
    assert calls == ["on", ("off", 1)]


def test_overlapping_threads_share_one_switch():
    setting, calls = counting()
    inside, leave = threading.Event(), threading.Event()

    def other():
        with setting.held():
            inside.set()
            leave.wait(5)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(5)
    with setting.held():
        pass
    assert calls == ["on"]  # the other thread still holds it
    leave.set()
    thread.join()
    assert calls == ["on", ("off", 1)]
