"""Keys that moved when the ``algorithm`` group split into one sub-group per part (advantage, policy_loss, kl,
entropy_bonus, entropy_control, collection, update, mismatch, stare). An override or a config file that still
uses an old key gets one line naming its new place, not Hydra's "Key ... is not in struct"."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["MOVED_KEYS", "REGROUPED_KEYS", "check_override_keys", "moved_key_error"]

_A = "algorithm."
MOVED_KEYS = {
    _A + old: _A + new
    for old, new in {
        "adv_eps": "advantage.eps",
        "clip_eps_low": "policy_loss.clip_eps_low",
        "clip_eps_high": "policy_loss.clip_eps_high",
        "dual_clip_c": "policy_loss.dual_clip_c",
        "loss_agg": "update.loss_agg",
        "kl_coef": "kl.coef",
        "kl_estimator": "kl.estimator",
        "entropy_coef": "entropy_bonus.coef",
        "entropy_target": "entropy_bonus.target",
        "entropy_coef_lr": "entropy_bonus.coef_lr",
        "entropy_coef_max": "entropy_bonus.coef_max",
        "clip_cov_ratio": "entropy_control.clip_cov.ratio",
        "clip_cov_lb": "entropy_control.clip_cov.lb",
        "clip_cov_ub": "entropy_control.clip_cov.ub",
        "kl_cov_ratio": "entropy_control.kl_cov.ratio",
        "kl_cov_coef": "entropy_control.kl_cov.coef",
        "top_entropy_fraction": "entropy_control.top_entropy.fraction",
        "dynamic_sampling": "collection.dynamic_sampling",
        "max_generation_batches": "collection.max_generation_batches",
        "generation_batch_multiplier": "collection.generation_batch_multiplier",
        "dynamic_sampling_metric": "collection.dynamic_sampling_metric",
        "budget_exhausted": "collection.budget_exhausted",
        "overlong_buffer": "collection.overlong_buffer",
        "overlong_penalty_factor": "collection.overlong_penalty_factor",
        "gate_aggregation": "stare.gate_aggregation",
        "loss_normalizer": "update.loss_normalizer",
        "on_policy_old_logprobs": "update.on_policy_old_logprobs",
        "micro_batch_partition": "update.micro_batch_partition",
        "ppo_epochs": "update.ppo_epochs",
        "mini_batches": "update.mini_batches",
        "mismatch_correction": "mismatch.correction",
        "mismatch_mode": "mismatch.mode",
        "mismatch_cap": "mismatch.cap",
    }.items()
}
# Keys that held an entry's name and now hold a group of settings: the name is their ``name``.
REGROUPED_KEYS = ("algorithm.advantage", "algorithm.policy_loss", "algorithm.entropy_control")


def _moved(key: str, value: str | None, where: str) -> str | None:
    if key in MOVED_KEYS:
        return f"{key} has moved ({where}): it is {MOVED_KEYS[key]} now"
    if key in REGROUPED_KEYS and value is not None and not value.lstrip().startswith("{"):
        return (
            f"{key}={value} is not allowed ({where}): {key} is a group of settings now; the entry it uses is "
            f"{key}.name={value}"
        )
    return None


def check_override_keys(overrides: Iterable[str]) -> None:
    """Refuse a command-line override of a moved key, naming the key it moved to."""
    for override in overrides:
        key, sep, value = override.partition("=")
        key = key.lstrip("+~")
        problem = _moved(key, value if sep else None, f"override {override!r}")
        if problem:
            raise ValueError(problem)


def moved_key_error(error: BaseException) -> ValueError | None:
    """The one-line error for a composition that failed on a moved key (an experiment file still using one), or
    None when ``error`` is about something else."""
    seen = error
    while seen is not None:
        full_key = getattr(seen, "full_key", None)
        if full_key and full_key in MOVED_KEYS:
            return ValueError(f"{full_key} has moved (in a config file): it is {MOVED_KEYS[full_key]} now")
        seen = seen.__cause__ or seen.__context__
    return None
