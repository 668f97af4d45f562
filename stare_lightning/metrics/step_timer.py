"""Where a training step's wall time goes: laps named by phase, which with ``other`` add up to the step.

``lap(name)`` charges the time since the previous lap (or the start) to ``name``; a phase may be charged by
several laps. Rollout generation, tool calls and verification run inside the collection phase and are timed
there (``CollectionStats``); ``metrics`` moves their seconds out of it, and what is left of it goes to ``other``.
On a GPU each lap first waits for the queued kernels, so a phase is charged with its own work.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

PHASES = ("rollout", "tool", "verify", "score", "update", "sync", "telemetry", "other")


class StepTimer:
    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> None:
        self.device, self.clock = device, clock  # clock: seconds, monotonic (a test drives it by hand)
        self.started = self.last = clock()
        self.seconds: dict[str, float] = {}

    def lap(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = self.clock()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now

    def metrics(
        self, *, rollout_seconds: float, verify_seconds: float, tokens: int, tool_seconds: float = 0.0
    ) -> dict[str, float]:
        """``time/<phase>`` for every phase of ``PHASES`` and every other lap's name, ``time/step_s`` and
        ``throughput/tokens_per_s`` (``tokens``: every prompt and response token the trainer processed this step,
        over the step's time)."""
        self.lap("other")
        total = self.last - self.started
        seconds = dict(self.seconds)
        collect = seconds.pop("collect", 0.0)
        seconds["rollout"], seconds["tool"], seconds["verify"] = rollout_seconds, tool_seconds, verify_seconds
        inside = rollout_seconds + tool_seconds + verify_seconds
        seconds["other"] = seconds.get("other", 0.0) + max(collect - inside, 0.0)
        out = {f"time/{phase}": seconds.get(phase, 0.0) for phase in PHASES}
        # Phases some steps have (the wait for an asynchronous producer's batch: trainer_idle).
        out.update({f"time/{phase}": value for phase, value in seconds.items() if phase not in PHASES})
        out["time/step_s"] = total
        out["throughput/tokens_per_s"] = tokens / total if total > 0 else 0.0
        return out
