"""Python's cycle collector around a run: what a run sets up once is frozen out of its scans, and thawed at the end.

A full collection walks every object the collector tracks. Once a run has imported its stack and built its models,
trainer and data, it holds about 460,000 of them (torch, transformers, Lightning, Hydra), and every automatic full
collection during the steps walked them all again, about 0.5 s each on the 2-core CPU of docs/results: a fifth of a
tiny-model fit's time (vLLM freezes its server's heap after start-up for the same reason). ``freeze_setup`` moves
everything alive into the collector's permanent generation; reference counting still frees those objects, only a
cycle among them waits for ``thaw``, which the entry calls when the job ends (a sweep's next job then starts from
a clean heap; after a single run, the interpreter's last collection frees them). Whatever else ends the process (an
error, an exit from inside the run), the objects are thawed at exit, before the interpreter's last collection:
extension types that count their live objects then (triton's nanobind bindings) would otherwise report the frozen
ones as leaked.
"""

from __future__ import annotations

import atexit
import gc

__all__ = ["freeze_setup", "thaw"]


def freeze_setup() -> None:
    """Collect what setting up left behind, then exempt everything alive now from later collections."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many runs froze
    atexit.register(gc.unfreeze)


def thaw(*, collect: bool = True) -> None:
    """Hand the frozen objects back to the collector and collect: what the finished run held goes now. A process
    about to exit passes ``collect=False``: the interpreter's own last collection follows, and a full one of a run's
    heap costs about 0.6 s."""
    gc.unfreeze()
    if collect:
        gc.collect()
