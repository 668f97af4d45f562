"""A tripwire for rollouts sampled from the wrong weights.

Every step the trainer recomputes the log-probs of the sampled tokens; the rollout engine reported its own.
With weights in sync the two differ only by kernel and precision noise (about 1e-6 in fp32, around 1e-2
with a bf16 engine). A mean absolute difference that stays large means the engine samples from stale
weights (a missed ``sync_weights``, or a sleep mode that reloaded the checkpoint over synced weights) or
from a differently processed distribution (top-p/top-k truncation). ``LogprobCanary`` reports the
difference for the metrics ``rollout/logprob_abs_diff/mean|max`` and raises once it has stayed above the
threshold for ``patience`` consecutive steps. Under ``torch.distributed`` the statistics are reduced over
all ranks first, so every rank sees the same numbers and raises at the same step. A batch sampled from an older
policy on purpose (``rollout.max_staleness``) is measured but not judged: there the difference is the off-policy
gap the correction works against, not a fault. A non-finite log-prob on either side (NaN or inf: weights that
overflowed, or a server sampling from broken weights) is never noise and never staleness: it stops the run at once,
whatever the step's staleness, saying how many tokens were non-finite on which side.
"""

from __future__ import annotations

import torch

from stare_lightning.distributed import all_reduce

MEAN_KEY = "rollout/logprob_abs_diff/mean"
MAX_KEY = "rollout/logprob_abs_diff/max"


class NonFiniteLogprobs(ValueError):
    """The engine's or the trainer's log-probs hold NaN or inf: the run stops with this one line (a ``ValueError``,
    which ``user_errors`` reports as such), not a traceback."""


class LogprobCanary:
    """Track ``|engine_logprobs - trainer_logprobs|`` over response tokens and fail loudly when it stays high.

    Args:
        threshold: largest tolerated token-mean absolute difference (nats).
        patience: consecutive steps above ``threshold`` before raising; 0 never raises.
        sync_dist: reduce over all ranks when ``torch.distributed`` is initialised.
    """

    def __init__(self, threshold: float = 0.1, patience: int = 3, *, sync_dist: bool = True) -> None:
        if threshold <= 0:
            raise ValueError(f"threshold must be > 0, got {threshold}")
        if patience < 0:
            raise ValueError(f"patience must be >= 0, got {patience}")
        self.threshold = float(threshold)
        self.patience = int(patience)
        self.sync_dist = sync_dist
        self.strikes = 0

    def update(
        self,
        engine_logprobs: torch.Tensor,
        trainer_logprobs: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        judge: bool = True,
    ) -> dict[str, float]:
        """Record one step; return the metrics, or raise ``RuntimeError`` when patience runs out (and
        ``NonFiniteLogprobs`` at once on NaN or inf). With ``judge=False`` the step is measured only: it neither
        counts as a strike nor clears the strikes."""
        if engine_logprobs.shape != trainer_logprobs.shape:
            raise ValueError(
                f"shapes differ: engine {tuple(engine_logprobs.shape)}, trainer {tuple(trainer_logprobs.shape)}"
            )
        engine, trainer = engine_logprobs.detach().float(), trainer_logprobs.detach().float()
        diff = (engine - trainer).abs()
        if mask is None:
            mask = torch.ones_like(diff, dtype=torch.bool)
        mask = mask.to(device=diff.device, dtype=torch.bool)
        non_finite = [(~torch.isfinite(side[mask])).sum().to(diff.dtype) for side in (engine, trainer)]
        total = torch.stack([diff[mask].sum(), mask.sum().to(diff.dtype), *non_finite])
        worst = diff[mask].max() if mask.any() else diff.new_zeros(())
        if self.sync_dist:
            total = all_reduce(total)
            worst = all_reduce(worst, torch.distributed.ReduceOp.MAX)
        tokens = total[1].item()
        mean = total[0].item() / tokens if tokens else 0.0
        metrics = {MEAN_KEY: mean, MAX_KEY: worst.item()}
        engine_bad, trainer_bad = int(total[2].item()), int(total[3].item())
        if self.patience and (engine_bad or trainer_bad):
            # `mean > threshold` is False for NaN: a non-finite gap would otherwise count as no strike at all.
            raise NonFiniteLogprobs(
                f"Rollout engine and trainer log-probs are not finite: {engine_bad} of the engine's and {trainer_bad} "
                f"of the trainer's {int(tokens)} response-token log-probs are NaN or inf (mean |difference| {mean}). "
                + (
                    "The engine sampled from non-finite weights or returned broken log-probs; "
                    if engine_bad
                    else "The trainer's weights or activations overflowed; "
                )
                + "the run stops at once instead of training on them."
            )
        if not judge:
            return metrics
        if tokens and mean > self.threshold:
            self.strikes += 1
        else:
            self.strikes = 0
        if self.patience and self.strikes >= self.patience:
            raise RuntimeError(
                f"Rollout engine and trainer disagree: mean |logprob difference| {mean:.4g} "
                f"(max {metrics[MAX_KEY]:.4g}) "
                f"stayed above {self.threshold:g} for {self.strikes} consecutive steps. The engine is most likely "
                "sampling from stale weights: check that sync_weights runs after every optimizer step on every rank, "
                "and that vLLM sleep mode uses level 1 (level 2 reloads the checkpoint on wake). A bf16 engine "
                "against an fp32 trainer, or top-p/top-k truncation, also widens the gap: raise the threshold "
                "only if that is the cause."
            )
        return metrics

    __call__ = update

    def reset(self) -> None:
        self.strikes = 0
