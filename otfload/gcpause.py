"""Pause Python's cyclic garbage collector while a large, long-lived structure is built.

Indexing a checkpoint and planning its leaves allocate a few hundred thousand objects (DeepSeek-V3:
92k tensor records, their dtypes, shapes, selections) that live as long as the index or plan. Each
of CPython's full collections walks every tracked object, so a build that allocates them one by
one triggers full collections whose work grows with what was built: 9 of them took 1.0 of the 5.3
seconds that planning DeepSeek-V3 on 256 devices cost. Nothing built there is cyclic garbage, so
collection is paused for the build and resumed (as it was) afterwards.
"""

from __future__ import annotations

import gc

from otfload.held import HeldSetting


def _pause() -> bool:
    was_enabled = gc.isenabled()
    gc.disable()
    return was_enabled


def _resume(was_enabled: bool) -> None:
    if was_enabled:
        gc.enable()


# Nested or concurrent pauses: the collector comes back (as it was) when the last one ends.
gc_paused = HeldSetting(_pause, _resume).held
