"""The run's own entries in a Lightning checkpoint: each stateful part's state under ``"stare_lightning"`` (the
STARE controller, the entropy coefficient, the optimizer-step bookkeeping), and the policy's weights without the
frozen base a LoRA run would otherwise write every time (``frozen_base.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from stare_lightning.trainer.frozen_base import POLICY_PREFIX, RUN_STATE, omit_frozen_base, restore_frozen_base


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def save_run_state(
    checkpoint: dict, parts: dict[str, Stateful | None], policy: torch.nn.Module, model_dir: str
) -> None:
    """Write the parts' states (None for a part this run does not have) and drop the policy's frozen base."""
    checkpoint[RUN_STATE] = {name: part.state_dict() if part is not None else None for name, part in parts.items()}
    omit_frozen_base(checkpoint, policy, POLICY_PREFIX, model_dir)


def load_run_state(
    checkpoint: dict,
    parts: dict[str, Stateful | None],
    policy: torch.nn.Module,
    model_dir: str,
    path: str | Path | None,
) -> None:
    """Put the frozen base back (after checking it is the one trained on) and restore each part that has a state."""
    restore_frozen_base(checkpoint, policy, POLICY_PREFIX, model_dir, path)
    state = checkpoint.get(RUN_STATE, {})
    for name, part in parts.items():
        if part is not None and state.get(name) is not None:
            part.load_state_dict(state[name])
