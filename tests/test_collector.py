"""What a run freezes after setting up stays out of the cycle collector's way until the job thaws it: a cycle made
before the freeze survives a full collection while frozen and goes at the thaw; a cycle made after it goes at once."""

from __future__ import annotations

import gc
import weakref

from stare_lightning import collector


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cycle collector can free it


def test_a_frozen_cycle_waits_for_the_thaw_and_a_later_one_does_not():
    before = _Node()
    frozen = weakref.ref(before)
    try:
        collector.freeze_setup()
        assert gc.get_freeze_count() > 0
        del before
        after = _Node()
        later = weakref.ref(after)
        del after
        gc.collect()
        assert frozen() is not None  # frozen: the full collection did not scan it
        assert later() is None  # made after the freeze: collected as usual
    finally:
        collector.thaw()
    assert gc.get_freeze_count() == 0
    assert frozen() is None
