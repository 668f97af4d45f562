"""One training step, top to bottom: collect, score, build the experience, and the micro-batch loss.

``collect`` rolls out, verifies, computes group advantages and filters groups (dynamic sampling) into a
``Collection`` whose ``batch`` holds the padded tokens; ``score_batch`` runs the rollout policy once
without gradient and returns its ``TokenScores``; ``Experience.build`` joins the batch with every
per-token input of the loss; ``micro_batch_loss`` computes one micro-batch's loss. The order of these
calls and the optimizer steps live in ``runner.py``, STARE's gate and token selection in ``selection.py``, and
what the step does, resolved once from the config, in ``plan.py``.
"""

from stare_lightning.step.batch import Experience, RolloutBatch, build_rollout_batch, micro_batches, mini_batch_rows
from stare_lightning.step.collect import Collection, CollectionStats, collect, score_rollouts, verify
from stare_lightning.step.loss import MicroBatchLoss, micro_batch_loss
from stare_lightning.step.normalizer import step_normalizer
from stare_lightning.step.scoring import TokenScores, response_token_stats, score_batch

__all__ = [
    "Collection",
    "CollectionStats",
    "Experience",
    "RolloutBatch",
    "TokenScores",
    "build_rollout_batch",
    "collect",
    "MicroBatchLoss",
    "micro_batch_loss",
    "micro_batches",
    "mini_batch_rows",
    "response_token_stats",
    "score_batch",
    "score_rollouts",
    "step_normalizer",
    "verify",
]
