"""The "close it on error only" idiom hands a source over intact: ``enter_context(owned(src, given))``
then ``pop_all()`` once the call succeeded must leave ``src`` open for the caller — dropping the popped
stack closes nothing (a ``@contextmanager`` generator would, when collected). Observed on a real
:class:`LocalSource` that counts its ``close()`` calls."""

from __future__ import annotations

import gc
import shutil
from contextlib import ExitStack

import pytest

from otfload.sources.base import read_bytes
from otfload.sources.owned import owned, owned_source
from tests.sources.test_owned import CountingSource, checkpoint_fds


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    return tiny_checkpoints("llama")[0]


def test_a_popped_owned_source_stays_open_for_the_caller(llama):
    opened = CountingSource(llama)
    with ExitStack() as on_error:
        src = on_error.enter_context(owned(opened, str(llama)))  # opened here: closed on error
        on_error.pop_all()  # success: the caller owns it now
    gc.collect()
    assert opened.closes == 0
    assert read_bytes(src, "config.json") == (llama / "config.json").read_bytes()
    with owned(src, str(llama)):  # the caller closes it in the end
        pass
    assert opened.closes == 1


def test_owned_still_closes_on_error_inside_an_exit_stack(llama):
    opened = CountingSource(llama)
    with pytest.raises(RuntimeError), ExitStack() as on_error:
        on_error.enter_context(owned(opened, str(llama)))
        raise RuntimeError("planning failed")
    assert opened.closes == 1


def test_owned_source_opens_at_the_call_and_closes_at_exit(tmp_path, llama):
    copy = shutil.copytree(llama, tmp_path / "llama")
    manager = owned_source(copy)
    with manager as src:
        src.size("config.json")
        assert checkpoint_fds(copy)
    assert not checkpoint_fds(copy)
