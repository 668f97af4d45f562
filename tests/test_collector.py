"""What a run freezes after setting up stays out of the cycle collector's way until the job thaws it: a cycle made
before the freeze survives a full collection while frozen and goes at the thaw; a cycle made after it goes at once.
A process that exits frozen, whatever ends it, is thawed before the interpreter's last collection."""

from __future__ import annotations

import gc
import subprocess
import sys
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


# Exits from inside the run, still frozen: the cycle's finalizer must run at the interpreter's last collection.
_EXITS_FROZEN = """
import sys
from stare_lightning import collector


class Cycle:
    def __init__(self):
        self.me = self

    def __del__(self):
        print("collected", flush=True)


cycle = Cycle()
collector.freeze_setup()
del cycle
sys.exit(2)
"""


def test_a_process_that_exits_frozen_is_thawed_before_its_last_collection():
    proc = subprocess.run([sys.executable, "-c", _EXITS_FROZEN], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout.splitlines() == ["collected"], proc.stdout + proc.stderr
