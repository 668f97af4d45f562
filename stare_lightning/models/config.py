"""``ModelConfig``, ``ColdStartConfig`` and ``LoraConfig``: the typed ``model`` config group, checked in
``__post_init__``."""

from __future__ import annotations

from dataclasses import dataclass, field

from stare_lightning.config.checks import choice, flag, number, text

DTYPES = ("float32", "bfloat16", "float16")
# The attention and MLP projections of Llama, Qwen2/3 and Mistral decoder layers.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The adapter settings of a LoRA group that is off (rank 0): any other value would do nothing.
_LORA_OFF = {"alpha": None, "dropout": 0.0, "target_modules": list(LORA_TARGETS)}


@dataclass
class ColdStartConfig:
    """Supervised warm-up of the built-in tiny model on the built-in task (cached by its settings)."""

    steps: int = 400
    """Supervised warm-up steps on the task's solutions (0: none)."""
    batch_size: int = 64
    """Examples per warm-up step."""
    lr: float = 3e-3
    """Learning rate of the warm-up."""
    seed: int = 0
    """Seed of the warm-up's initialisation and example order."""
    tool_traces: bool = False
    """Warm up on tool-using traces (calls, the tool's replies, then the answer) instead of bare solutions; needs a
    tool."""

    def __post_init__(self) -> None:
        p = "model.cold_start."
        flag(f"{p}tool_traces", self.tool_traces)
        number(f"{p}steps", self.steps, low=0, integer=True)
        number(f"{p}batch_size", self.batch_size, low=1, integer=True)
        number(f"{p}lr", self.lr, low=0.0, low_open=True)
        number(f"{p}seed", self.seed, low=0, integer=True)


@dataclass
class LoraConfig:
    """Low-rank adapters (peft) on the policy's linear layers: only the adapters train, the base stays frozen.

    Each targeted ``W`` computes as ``W + (alpha / rank) * B @ A``. ``alpha`` defaults to ``2 * rank``, a
    scale of 2 whatever the rank, so changing the rank does not rescale the update. ``rank: 0`` is "off"
    (``ModelConfig`` then holds ``lora=None``): the group always exists, so ``model.lora.rank=16`` can turn it
    on from the command line (OmegaConf cannot override a key below a ``null`` typed node). ``dropout`` > 0
    makes every training-mode forward stochastic, the scoring pass included: old log-probs, importance
    ratios and the log-prob canary then carry the dropout noise.
    """

    rank: int = 0
    """Rank of the adapters; 0 turns LoRA off (full fine-tuning)."""
    alpha: float | None = None
    """The adapters' update is scaled by `alpha / rank`; null: `2 * rank`, a scale of 2 for any rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input; above 0 every training forward is stochastic."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Names of the linear layers that get adapters."""

    def __post_init__(self) -> None:
        p = "model.lora."
        number(f"{p}rank", self.rank, low=0, integer=True)
        if self.alpha is not None:
            number(f"{p}alpha", self.alpha, low=0.0, low_open=True)
        number(f"{p}dropout", self.dropout, low=0.0, high=1.0, high_open=True)
        if not self.target_modules:
            raise ValueError(f"{p}target_modules=[] is not allowed: name at least one, e.g. {list(LORA_TARGETS)}")
        for i, name in enumerate(self.target_modules):
            text(f"{p}target_modules[{i}]", name)
        if self.rank == 0:  # off: a setting of the adapters would do nothing
            settings = {"alpha": self.alpha, "dropout": self.dropout, "target_modules": list(self.target_modules)}
            for key, value in settings.items():
                if value != _LORA_OFF[key]:
                    raise ValueError(
                        f"{p}{key}={value!r} does nothing with {p}rank=0 (LoRA off): set {p}rank > 0, e.g. {p}rank=16"
                    )

    @property
    def scaling(self) -> float:
        """The factor of ``B @ A`` in the merged weight: ``alpha / rank``."""
        return (2.0 * self.rank if self.alpha is None else float(self.alpha)) / self.rank


@dataclass
class ModelConfig:
    name_or_path: str = "tiny"
    """`tiny`, `smollm2-135m-instruct`, a local Hugging Face directory or a hub id."""
    dtype: str = "float32"
    """The master weights' (and so the optimizer state's) dtype."""
    cold_start: ColdStartConfig | None = None
    """Supervised warm-up of the built-in tiny model before RL (cached); null: none."""
    lora: LoraConfig | None = field(default_factory=LoraConfig)
    """Low-rank adapters instead of full fine-tuning (rank 0 or null: full fine-tuning)."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward: less memory, more compute."""
    cache_dir: str | None = None
    """Where built-in models and cold starts are kept; null: `$STARE_LIGHTNING_CACHE` or `~/.cache/stare_lightning`."""

    def __post_init__(self) -> None:
        text("model.name_or_path", self.name_or_path)
        choice("model.dtype", self.dtype, DTYPES)
        flag("model.gradient_checkpointing", self.gradient_checkpointing)
        if self.lora is not None and self.lora.rank == 0:  # off: the rest of the code asks `lora is None`
            self.lora = None
        if self.cold_start is not None and self.name_or_path != "tiny":
            raise ValueError(
                f"model.cold_start is only for the built-in tiny model, but model.name_or_path={self.name_or_path!r}"
            )
