"""The host memory allocator: where tcmalloc is, whether this process runs on it, and the hint when it does not.

glibc's malloc serves every block above its mmap threshold (32 MiB at most) with a fresh ``mmap`` and unmaps it on
free, so on a CPU each step's large tensors (``[tokens, vocab]`` logits, activations, the dense embedding gradient)
page-fault again, step after step. tcmalloc keeps freed pages for reuse. On the 2-core CPU of
docs/results/performance.md, a ``[454, 49152]`` float32 multiply takes 60 ms under glibc and 20 ms under tcmalloc,
and an RL step of SmolLM2 about 10% less time (TRL's too). An allocator cannot be swapped inside a running process:
it is preloaded at start (``LD_PRELOAD``), which the Makefile does when the library is installed (``make install``
installs it with apt where it can). ``python -m stare_lightning.allocator`` prints the ``LD_PRELOAD=...``
assignment, or nothing.
"""

from __future__ import annotations

import glob
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

# Debian/Ubuntu (libtcmalloc-minimal4, libgoogle-perftools4), Fedora/RHEL (gperftools-libs), conda environments.
_SEARCH = (
    "/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/*-linux-gnu/libtcmalloc.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc.so.4",
    f"{sys.prefix}/lib/libtcmalloc_minimal.so.4",
    f"{sys.prefix}/lib/libtcmalloc.so.4",
)


def find_tcmalloc() -> Path | None:
    """The first tcmalloc shared library found on this machine, or None."""
    for pattern in _SEARCH:
        found = sorted(glob.glob(pattern))
        if found:
            return Path(found[0])
    return None


def tcmalloc_loaded(maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether tcmalloc is mapped into this process (False where ``/proc`` cannot tell)."""
    try:
        return "libtcmalloc" in maps.read_text()
    except OSError:
        return False


def hint_if_page_faulting(on_cpu: bool) -> None:
    """On a CPU run under glibc's malloc, one log line saying how to start on tcmalloc."""
    if not on_cpu or not sys.platform.startswith("linux") or tcmalloc_loaded():
        return
    found = find_tcmalloc()
    how = f"start with LD_PRELOAD={found}" if found else "install libtcmalloc-minimal4 and start with LD_PRELOAD"
    logger.warning(
        "This CPU run uses glibc's malloc, which returns large blocks to the system and page-faults them again "
        "every step; %s (the Makefile does) for about 10%% shorter steps.",
        how,
    )


if __name__ == "__main__":
    library = find_tcmalloc()
    if library is not None:
        print(f"LD_PRELOAD={library}")
