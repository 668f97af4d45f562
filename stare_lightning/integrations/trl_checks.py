"""The TRL settings under which ``STAREGRPOTrainer`` would not apply STARE as this project does, refused at
construction with the reason (``check_grpo_config``, ``check_text_only``).

Each refusal names a case where the weights would not be what the metrics report or what this project applies:
- the controller moves once per generation batch, so a generation batch must be a whole number of optimizer steps
  (``steps_per_generation`` a multiple of ``gradient_accumulation_steps``); with several optimizer steps per batch
  the selector must not follow the policy (this project re-ranks by the updated policy before each);
- TRL's sequence-level ratio (``importance_sampling_level="sequence"``) carries each row's gradient through its mean
  log-prob, so a token's omega would be spread over its row as the row's mean omega; CISPO's ratio is detached, so
  its per-token gradient keeps omega;
- TRL's high-entropy mask (``top_entropy_quantile`` < 1), recomputed in each micro-batch, zeroes tokens STARE
  selected;
- scope ``micro_batch`` (TRL's micro-batches are a random split), scope ``group`` with groups cut across processes,
  the loss types without a counterpart here, and images (the scoring pass forwards text).
"""

from __future__ import annotations

from stare_lightning.algorithms.selectors import STARE_SELECTORS

__all__ = ["ACCEPTED_LOSSES", "check_grpo_config", "check_text_only"]

# TRL's losses whose per-token term is the advantage times a factor that depends on the advantage's sign only.
ACCEPTED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
IMAGE_COLUMNS = ("image", "images")


def check_grpo_config(config, settings) -> None:
    """Refuse the ``GRPOConfig`` settings under which this trainer would not apply ``settings`` (a
    ``STARESettings``) as this project does."""
    _check_steps(config, settings)
    if settings.scope == "micro_batch":
        raise ValueError(
            "STARESettings.scope='micro_batch' is refused: TRL's micro-batches are a random split of the generation "
            "batch, so the selection would depend on it; use scope 'step' (the default), 'sequence' or 'group'"
        )
    rows = config.per_device_train_batch_size * config.steps_per_generation
    if settings.scope == "group" and rows % config.num_generations:
        raise ValueError(
            f"STARESettings.scope='group' needs whole groups on each process: per_device_train_batch_size x "
            f"steps_per_generation = {rows} is not a multiple of num_generations={config.num_generations}"
        )
    if config.loss_type not in ACCEPTED_LOSSES:
        raise ValueError(
            f"loss_type={config.loss_type!r} is refused: STARE's weights are checked against this project's losses "
            f"only, whose counterparts in TRL are {list(ACCEPTED_LOSSES)}"
        )
    if getattr(config, "importance_sampling_level", "token") == "sequence" and config.loss_type != "cispo":
        raise ValueError(
            f"importance_sampling_level='sequence' with loss_type={config.loss_type!r} is refused: TRL's sequence "
            "ratio carries each row's gradient through its mean log-prob, so every token of a row would get the "
            "row's mean omega instead of its own (this project's GSPO keeps omega per token); use "
            "importance_sampling_level='token', or loss_type='cispo', whose clipped ratio is detached"
        )
    quantile = getattr(config, "top_entropy_quantile", 1.0)
    if quantile < 1.0:
        raise ValueError(
            f"top_entropy_quantile={quantile} is refused: TRL recomputes its high-entropy mask in each micro-batch "
            "and it zeroes tokens STARE selected, so the weights applied would not be the ones STARE reports; use "
            "top_entropy_quantile=1.0"
        )


def _check_steps(config, settings) -> None:
    """The controller moves once per generation batch: refuse a batch that is not a whole number of optimizer
    steps, and several optimizer steps per batch with a selector that follows the policy."""
    per_generation, accumulation = config.steps_per_generation, config.gradient_accumulation_steps
    if per_generation % accumulation:
        raise ValueError(
            f"steps_per_generation={per_generation} with gradient_accumulation_steps={accumulation} is refused: a "
            "generation batch is then not a whole number of optimizer steps, and STARE's gate, W and M move once "
            f"per generation batch, so they would move {accumulation / per_generation:.3g} times per optimizer step; "
            "use steps_per_generation equal to gradient_accumulation_steps (or a multiple of it)"
        )
    several = config.num_iterations > 1 or per_generation > accumulation
    if several and STARE_SELECTORS[settings.selector].follows_policy:
        raise ValueError(
            f"num_iterations={config.num_iterations}, steps_per_generation={per_generation} and "
            f"gradient_accumulation_steps={accumulation} give several optimizer steps per generation batch: this "
            "project re-ranks STARE's tokens by the updated policy before each, this trainer selects once per "
            "batch; use num_iterations=1 and steps_per_generation=gradient_accumulation_steps, or selector 'random'"
        )


def check_text_only(*datasets) -> None:
    """Refuse a dataset with images: the scoring pass forwards text only."""
    for dataset in datasets:
        for part in dataset.values() if isinstance(dataset, dict) else [dataset]:
            columns = getattr(part, "column_names", None) or []
            found = [name for name in IMAGE_COLUMNS if name in columns]
            if found:
                raise ValueError(
                    f"STAREGRPOTrainer does not take images (the dataset has a column {found[0]!r}): its scoring "
                    "pass forwards text only"
                )
