"""``ModelConfig`` and ``ColdStartConfig``: the typed ``model`` config group, checked in ``__post_init__``."""

from __future__ import annotations

from dataclasses import dataclass

from stare_lightning.config.checks import choice, flag, number, text

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ColdStartConfig:
    """Supervised warm-up of the built-in tiny model on the built-in task (cached by its settings)."""

    steps: int = 400
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0
    # Warm up on tool-using traces of the task (calls, the tool's replies, then the answer) instead of bare
    # solutions: the analogue of the cold start on tool traces before RL with a tool (needs `tools`).
    tool_traces: bool = False

    def __post_init__(self) -> None:
        p = "model.cold_start."
        flag(f"{p}tool_traces", self.tool_traces)
        number(f"{p}steps", self.steps, low=0, integer=True)
        number(f"{p}batch_size", self.batch_size, low=1, integer=True)
        number(f"{p}lr", self.lr, low=0.0, low_open=True)
        number(f"{p}seed", self.seed, low=0, integer=True)


@dataclass
class ModelConfig:
    name_or_path: str = "tiny"
    dtype: str = "float32"  # the master weights' (and so the optimizer state's) dtype
    cold_start: ColdStartConfig | None = None
    gradient_checkpointing: bool = False
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        text("model.name_or_path", self.name_or_path)
        choice("model.dtype", self.dtype, DTYPES)
        flag("model.gradient_checkpointing", self.gradient_checkpointing)
        if self.cold_start is not None and self.name_or_path != "tiny":
            raise ValueError(
                f"model.cold_start is only for the built-in tiny model, but model.name_or_path={self.name_or_path!r}"
            )
