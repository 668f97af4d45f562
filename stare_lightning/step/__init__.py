"""One training step, top to bottom: collect, score, build the experience, and the micro-batch loss.

``collect`` rolls out, verifies, computes group advantages and filters groups (dynamic sampling) into a
``Collection`` whose ``batch`` holds the padded tokens; ``score_batch`` runs the rollout policy once
without gradient and returns its ``TokenScores``; ``Experience.build`` joins the batch with every
per-token input of the loss; ``micro_batch_loss`` computes one micro-batch's loss. The order of these
calls and the optimizer steps live in ``runner.py``, STARE's gate and token selection in ``selection.py``, and
what the step does, resolved once from the config, in ``plan.py``.
"""

from stare_lightning.lazy_exports import lazy_exports

_EXPORTS = {
    ".batch": ("Experience", "RolloutBatch", "build_rollout_batch", "micro_batches", "mini_batch_rows"),
    ".collect": ("Collection", "CollectionStats", "score_rollouts", "verify"),
    ".loss": ("MicroBatchLoss", "micro_batch_loss"),
    ".normalizer": ("step_normalizer",),
    ".plan": ("LossPlan", "StepPlan"),
    ".scoring": ("TokenScores", "response_token_stats", "score_batch"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
