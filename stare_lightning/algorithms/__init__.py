"""Pure tensor functions of the policy loss: per-token statistics, advantages, surrogates, STARE, baselines.

Nothing here imports Lightning; every function works on plain tensors and is tested against slow
reference loops in tests/test_algorithms_*.py.
"""

from stare_lightning.lazy_exports import lazy_exports

_EXPORTS = {
    ".advantages": ("compute_advantages", "overlong_penalty", "zero_variance_groups"),
    ".config": ("AlgorithmConfig", "STAREConfig"),
    ".entropy_control": (
        "AdaptiveEntropyCoefficient",
        "clip_cov_mask",
        "kl_cov_penalty",
        "token_covariance",
        "top_entropy_mask",
    ),
    ".objective": ("LossSpec", "policy_loss"),
    ".sensitivity": ("entropy_sensitivity", "predicted_entropy_change"),
    ".stare": ("STARERule", "STAREStats", "stare_token_weights", "stare_weights_for_scope"),
    ".stare_controller": ("STAREController", "StepParams"),
    ".surrogates": (
        "LossNormalizer",
        "SurrogateStats",
        "aggregate_loss",
        "broadcast_advantages",
        "clipped_surrogate",
        "entropy_bonus",
        "kl_penalty",
    ),
    ".token_stats": ("TokenStats", "token_stats_from_hidden", "token_stats_from_logits"),
    ".token_weights": ("micro_batch_token_weights",),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
