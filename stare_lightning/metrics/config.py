"""Typed ``validation`` and ``telemetry`` groups: what is measured, on the validation sets and in training."""

from __future__ import annotations

from dataclasses import dataclass, field

from stare_lightning.config.checks import flag, number


@dataclass
class ValidationConfig:
    pass_k: list[int] = field(default_factory=lambda: [1, 4])
    """The k of each reported pass@k (up to each benchmark's samples per problem)."""
    reflection_words: list[str] | None = None
    """Words and phrases counted per response; null: the default list."""
    before_fit: bool = True
    """Validate the starting policy, so the summary shows the gain."""

    def __post_init__(self) -> None:
        if not self.pass_k:
            raise ValueError("validation.pass_k=[] is not allowed: list at least one k >= 1")
        for i, k in enumerate(self.pass_k):
            number(f"validation.pass_k[{i}]", k, low=1, integer=True)
        flag("validation.before_fit", self.before_fit)


@dataclass
class TelemetryConfig:
    same_batch_entropy: bool = False
    """After each update, measure its entropy change on the step's own tokens, realised and to first order (two extra
    forwards; the step's response logits are kept meanwhile)."""

    def __post_init__(self) -> None:
        flag("telemetry.same_batch_entropy", self.same_batch_entropy)
