"""Pure tensor functions of the policy loss: per-token statistics, advantages, surrogates, STARE, baselines.

Nothing here imports Lightning; every function works on plain tensors and is tested against slow
reference loops in tests/test_algorithms_*.py.
"""

from stare_lightning.lazy_exports import lazy_exports

_EXPORTS = {
    "compute_advantages": "stare_lightning.algorithms.advantages",
    "overlong_penalty": "stare_lightning.algorithms.advantages",
    "zero_variance_groups": "stare_lightning.algorithms.advantages",
    "AlgorithmConfig": "stare_lightning.algorithms.config",
    "STAREConfig": "stare_lightning.algorithms.config",
    "AdaptiveEntropyCoefficient": "stare_lightning.algorithms.entropy_control",
    "clip_cov_mask": "stare_lightning.algorithms.entropy_control",
    "kl_cov_penalty": "stare_lightning.algorithms.entropy_control",
    "token_covariance": "stare_lightning.algorithms.entropy_control",
    "top_entropy_mask": "stare_lightning.algorithms.entropy_control",
    "LossSpec": "stare_lightning.algorithms.objective",
    "policy_loss": "stare_lightning.algorithms.objective",
    "entropy_sensitivity": "stare_lightning.algorithms.sensitivity",
    "predicted_entropy_change": "stare_lightning.algorithms.sensitivity",
    "STARERule": "stare_lightning.algorithms.stare",
    "STAREStats": "stare_lightning.algorithms.stare",
    "stare_token_weights": "stare_lightning.algorithms.stare",
    "stare_weights_for_scope": "stare_lightning.algorithms.stare",
    "STAREController": "stare_lightning.algorithms.stare_controller",
    "StepParams": "stare_lightning.algorithms.stare_controller",
    "LossNormalizer": "stare_lightning.algorithms.surrogates",
    "SurrogateStats": "stare_lightning.algorithms.surrogates",
    "aggregate_loss": "stare_lightning.algorithms.surrogates",
    "broadcast_advantages": "stare_lightning.algorithms.surrogates",
    "clipped_surrogate": "stare_lightning.algorithms.surrogates",
    "entropy_bonus": "stare_lightning.algorithms.surrogates",
    "kl_penalty": "stare_lightning.algorithms.surrogates",
    "TokenStats": "stare_lightning.algorithms.token_stats",
    "token_stats_from_hidden": "stare_lightning.algorithms.token_stats",
    "token_stats_from_logits": "stare_lightning.algorithms.token_stats",
    "micro_batch_token_weights": "stare_lightning.algorithms.token_weights",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
