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
    "Experience": "stare_lightning.step.batch",
    "RolloutBatch": "stare_lightning.step.batch",
    "build_rollout_batch": "stare_lightning.step.batch",
    "micro_batches": "stare_lightning.step.batch",
    "mini_batch_rows": "stare_lightning.step.batch",
    "Collection": "stare_lightning.step.collect",
    "CollectionStats": "stare_lightning.step.collect",
    "score_rollouts": "stare_lightning.step.collect",
    "verify": "stare_lightning.step.collect",
    "MicroBatchLoss": "stare_lightning.step.loss",
    "micro_batch_loss": "stare_lightning.step.loss",
    "step_normalizer": "stare_lightning.step.normalizer",
    "LossPlan": "stare_lightning.step.plan",
    "StepPlan": "stare_lightning.step.plan",
    "TokenScores": "stare_lightning.step.scoring",
    "response_token_stats": "stare_lightning.step.scoring",
    "score_batch": "stare_lightning.step.scoring",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
