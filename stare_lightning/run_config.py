"""The run's typed schema, assembled from every config group's, checked before anything expensive starts.

Hydra composes YAML from ``conf/``; ``to_run_config`` merges it onto these dataclasses, so an unknown key
or a wrongly typed value fails with the key's full name, and each ``__post_init__`` checks ranges and
choices (with the helpers of ``config/checks.py``). Each group's schema lives in its package
(``algorithms/config.py``, ``data/config.py``, ``metrics/config.py``, ``models/config.py``, ``rollout/config.py``,
``step/config.py``, ``tools/config.py``, ``trainer/config.py``); this module, at the top of the package next to
``train.py``, assembles them into ``RunConfig`` and checks what spans groups. Groups whose entries are plain
constructor calls (trainer, callbacks, logger) keep their ``_target_`` form and are checked by
``safe_instantiate``'s allow-list instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from stare_lightning.algorithms.config import AlgorithmConfig
from stare_lightning.config.checks import flag, number
from stare_lightning.config.targets import check_opt_ins, check_target_name, check_targets
from stare_lightning.data.config import DataConfig
from stare_lightning.metrics.config import TelemetryConfig, ValidationConfig
from stare_lightning.models.config import ModelConfig
from stare_lightning.rollout.backends import declared_backend
from stare_lightning.rollout.config import RolloutConfig
from stare_lightning.rollout.lora_sync import check_policy as check_lora_policy
from stare_lightning.step.config import ForwardConfig
from stare_lightning.tools.config import ToolsConfig
from stare_lightning.trainer.config import OptimConfig


# A key and its docstring per field, as in every group's schema: config_reference.py reads them as the key's help.
@dataclass
class RunConfig:
    """The whole run. ``trainer``, ``callbacks`` and ``logger`` are ``_target_`` mappings."""

    seed: int = 0
    """The run's seed (seed_everything); rollouts are seeded from it and each prompt's id, whatever the rank."""
    output_dir: str | None = None
    """Where logs, checkpoints, rollouts.jsonl and curves.png go; null: Hydra's run directory."""
    summary: bool = True
    """Print the start/end table and write curves.png when `fit` ends."""
    verbose: bool = False
    """Show third-party notices (vLLM, Lightning, warnings) on the terminal too; the log file has them always."""
    allowed_targets: list[str] = field(default_factory=list)
    """Extra `package.module.Name` classes or functions that `_target_` entries may construct."""
    ckpt_path: str | None = None
    """A checkpoint to resume `fit` from (`last`: the run's latest), or to evaluate (`validate`, `evaluate`)."""
    export_dir: str | None = None
    """Where `export` writes the Hugging Face model directory."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model: which one, its dtype, LoRA, the tiny model's cold start."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where prompts come from (a built-in task, reasoning-gym, files) and how they are batched."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The policy loss: advantages, clipping, KL, entropy controls, dynamic sampling and STARE."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """How responses are sampled: engine, samples per prompt, lengths, temperatures, the canary."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer, learning-rate schedule and gradient clipping."""
    forward: ForwardConfig = field(default_factory=ForwardConfig)
    """How the policy's forwards over a step's rows are laid out (token budget, packing, fused head)."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """What validation reports: pass@k, reflection words, a validation before the first step."""
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    """Optional, costly training telemetry."""
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    """The tool a policy may call in multi-turn episodes, and the python tool's sandbox."""
    trainer: Any = None
    """Lightning Trainer arguments (`_target_` mapping; conf/trainer/)."""
    callbacks: Any = None
    """Lightning callbacks by name (`_target_` mappings; conf/callbacks/)."""
    logger: Any = None
    """Lightning loggers by name (`_target_` mappings; conf/logger/)."""

    def __post_init__(self) -> None:
        number("seed", self.seed, low=0, integer=True)
        flag("summary", self.summary)
        flag("verbose", self.verbose)
        self._check_targets()
        accelerator = (self.trainer or {}).get("accelerator", "auto")
        backend = declared_backend(self.rollout.backend)
        no_sleep = backend is not None and not backend.sleep_mode
        if self.rollout.enable_sleep_mode and (no_sleep or accelerator == "cpu"):
            raise ValueError(
                "rollout.enable_sleep_mode=true does nothing here: vLLM's sleep mode frees GPU memory between "
                f"rollouts (rollout.backend={self.rollout.backend}, trainer.accelerator={accelerator}); "
                "set it false, or run vLLM on GPUs"
            )
        check_lora_policy(self.rollout, self.model.lora)
        self._check_tool_settings()
        self._check_memory_levers(accelerator)
        self._check_precision(accelerator)
        # pass@k is reported for the k up to each benchmark's n; a k no benchmark can reach would do nothing.
        largest_n = max([self.rollout.val_n, *(v.n for v in self.data.val_sets if v.n is not None)])
        if max(self.validation.pass_k) > largest_n:
            raise ValueError(
                f"validation.pass_k={self.validation.pass_k} has k > every benchmark's samples per problem "
                f"(rollout.val_n={self.rollout.val_n}, data.val_sets n up to {largest_n})"
            )

    def _check_targets(self) -> None:
        """Everything the run will construct, against the allow-list (``config/targets.py``), before it starts."""
        check_opt_ins(self.allowed_targets)
        for group in ("trainer", "callbacks", "logger"):
            check_targets(getattr(self, group), self.allowed_targets, where=group)
        check_target_name(self.optim.optimizer, "optim.optimizer", self.allowed_targets)

    def _check_memory_levers(self, accelerator: str) -> None:
        """The fused LM head and FSDP2's CPU offload, refused where they would break or do nothing."""
        strategy = (self.trainer or {}).get("strategy")
        if self.forward.fused_lm_head and self.telemetry.same_batch_entropy:
            raise ValueError(
                "forward.fused_lm_head=true never forms the logits, but telemetry.same_batch_entropy=true compares "
                "the full logits before and after the update; set one of them false"
            )
        offload = isinstance(strategy, dict) and strategy.get("cpu_offload", False)
        if offload and accelerator == "cpu":
            raise ValueError(
                "trainer.strategy.cpu_offload=true does nothing here: it moves sharded weights, gradients and "
                "optimizer state from GPU memory to host memory, and trainer.accelerator=cpu keeps them there "
                "already; set it false, or run on GPUs"
            )
        backend = declared_backend(self.rollout.backend)
        if offload and backend is not None and not backend.holds_weight_copy:
            raise ValueError(
                f"trainer.strategy.cpu_offload=true needs rollout.backend=vllm (an engine with its own weights): "
                f"rollout.backend={backend.name} generates with the trainer's module, putting prompts and samplers on "
                "the parameters' device, which offload makes the host, while FSDP2 computes on the GPU; use "
                "rollout=vllm, or set it false"
            )

    def _check_precision(self, accelerator: str) -> None:
        """fp16 only as FSDP2's compute dtype (with the loss scale that comes with it) and only on GPUs."""
        precision = str((self.trainer or {}).get("precision", "32-true"))
        if precision.startswith("16"):
            raise ValueError(
                f"trainer.precision={precision} is not supported: Lightning's fp16 grad scaler steps through "
                "LightningOptimizer, which this project's manual update loop does not use, so gradients would stay "
                "scaled; for fp16 use trainer=fsdp_fp16 (FSDP2 computing in float16 with a dynamic loss scale, on "
                "one GPU or many), or bf16-mixed"
            )
        strategy = (self.trainer or {}).get("strategy")
        if isinstance(strategy, dict) and strategy.get("param_dtype") == "float16" and accelerator == "cpu":
            raise ValueError(
                "trainer.strategy.param_dtype=float16 needs GPUs: vLLM's CPU backend has no float16 kernels and the "
                "rollout engine computes in the trainer's dtype; on a CPU use bfloat16 or null (fp32)"
            )

    def _check_tool_settings(self) -> None:
        """Settings that only mean something in tool-using episodes are refused without a tool, and a tool with a
        backend that cannot run tool episodes."""
        backend = declared_backend(self.rollout.backend)
        if self.tools.name != "none":
            if backend is not None and not backend.tool_episodes:
                raise ValueError(
                    f"tools={self.tools.name} needs a rollout backend that runs tool episodes; "
                    f"rollout.backend={backend.name} does not (use rollout=vllm, hf or server)"
                )
            return
        if self.rollout.max_turns is not None:
            raise ValueError(
                f"rollout.max_turns={self.rollout.max_turns} does nothing with tools=none (no episode calls a "
                "tool): remove it, or choose a tool, e.g. tools=calculator or tools=python"
            )
        cold = self.model.cold_start
        if cold is not None and cold.tool_traces:
            raise ValueError(
                "model.cold_start.tool_traces=true needs a tool to write traces for, but tools=none: "
                "set it false, or choose a tool, e.g. tools=calculator"
            )


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Merge a composed config onto the schema and build the validated dataclasses.

    Hydra's own keys are dropped; anything else unknown is an error naming the key.
    """
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
    return OmegaConf.to_object(merged)


SCHEMA_NAME = "stare_lightning_schema"


def register_schema() -> None:
    """Make ``RunConfig`` the base of ``conf/config.yaml`` (its first default), so composition knows every key."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)
