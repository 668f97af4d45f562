"""Pure tensor functions of the policy loss: per-token statistics, advantages, surrogates, STARE, baselines.

Nothing here imports Lightning; every function works on plain tensors and is tested against slow
reference loops in tests/test_algorithms_*.py.
"""

from stare_lightning.algorithms.advantages import compute_advantages, overlong_penalty, zero_variance_groups
from stare_lightning.algorithms.config import AlgorithmConfig, STAREConfig
from stare_lightning.algorithms.entropy_control import (
    AdaptiveEntropyCoefficient,
    clip_cov_mask,
    kl_cov_penalty,
    token_covariance,
    top_entropy_mask,
)
from stare_lightning.algorithms.objective import policy_loss
from stare_lightning.algorithms.sensitivity import entropy_sensitivity, predicted_entropy_change
from stare_lightning.algorithms.stare import STAREStats, stare_token_weights, stare_weights_for_scope
from stare_lightning.algorithms.stare_controller import STAREController, StepParams
from stare_lightning.algorithms.surrogates import (
    LossNormalizer,
    SurrogateStats,
    aggregate_loss,
    broadcast_advantages,
    clipped_surrogate,
    entropy_bonus,
    kl_penalty,
)
from stare_lightning.algorithms.token_stats import TokenStats, token_stats_from_hidden, token_stats_from_logits
from stare_lightning.algorithms.token_weights import micro_batch_token_weights

__all__ = [
    "AdaptiveEntropyCoefficient",
    "AlgorithmConfig",
    "LossNormalizer",
    "STAREController",
    "STAREConfig",
    "STAREStats",
    "StepParams",
    "SurrogateStats",
    "TokenStats",
    "aggregate_loss",
    "broadcast_advantages",
    "clip_cov_mask",
    "clipped_surrogate",
    "compute_advantages",
    "entropy_bonus",
    "entropy_sensitivity",
    "kl_cov_penalty",
    "kl_penalty",
    "micro_batch_token_weights",
    "overlong_penalty",
    "policy_loss",
    "predicted_entropy_change",
    "stare_token_weights",
    "stare_weights_for_scope",
    "token_covariance",
    "token_stats_from_hidden",
    "token_stats_from_logits",
    "top_entropy_mask",
    "zero_variance_groups",
]
