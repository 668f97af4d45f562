"""Algorithm config schemas: defaults, validation, OmegaConf structured use, derived methods."""

import dataclasses
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from stare_lightning.algorithms import AlgorithmConfig, STAREConfig, STAREController
from stare_lightning.config.moved_keys import MOVED_KEYS, REGROUPED_KEYS

CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "algorithm"


def test_defaults_follow_the_method_doc():
    s = STAREConfig()
    assert (s.enabled, s.variant, s.top_ratio, s.w, s.m, s.target_entropy) == (False, "O1", 0.1, 1.1, 0.9, 0.3)
    assert (s.selector, s.scope, s.surprisal_source, s.adaptive, s.timing) == (
        "surprisal",
        "step",
        "current",
        False,
        "next_step",
    )
    a = AlgorithmConfig()
    assert a.policy_loss.clip_eps_low == 0.2 and a.update.loss_agg == "token-mean" and a.kl.estimator == "k3"
    assert isinstance(a.stare, STAREConfig)


@pytest.mark.parametrize(
    "key, value",
    [
        ("variant", "O3"),
        ("top_ratio", 1.5),
        ("top_ratio", -0.1),
        ("w", 0.0),
        ("m", -1.0),
        ("target_entropy", -0.1),
        ("selector", "likelihood"),
        ("scope", "batch"),
        ("surprisal_source", "ref"),
        ("alpha", -0.1),
        ("w_max", 0.5),
        ("m_min", 0.0),
        ("m_min", 1.5),
        ("timing", "now"),
        ("enabled", "yes"),
        ("w", float("nan")),
    ],
)
def test_stare_config_rejects(key, value):
    with pytest.raises(ValueError, match=f"stare.{key}={value!r}"):
        STAREConfig(**{key: value})


def test_stare_adaptive_bounds():
    with pytest.raises(ValueError, match="stare.w"):
        STAREConfig(adaptive=True, w=1.6, w_max=1.5)
    with pytest.raises(ValueError, match="stare.m"):
        STAREConfig(adaptive=True, m=0.4, m_min=0.5)
    STAREConfig(adaptive=True, w=1.5, m=0.5)


@pytest.mark.parametrize(
    "key, value",
    [
        ("name", ""),
        ("advantage", "ppo"),
        ("adv_eps", -1.0),
        ("clip_eps_low", 1.5),
        ("clip_eps_high", -0.1),
        ("dual_clip_c", 1.0),
        ("loss_agg", "sum"),
        ("kl_coef", -0.1),
        ("kl_estimator", "k4"),
        ("entropy_coef", -1.0),
        ("entropy_target", -0.5),
        ("entropy_coef_lr", -1.0),
        ("entropy_control", "cov"),
        ("clip_cov_ratio", 0.0),
        ("kl_cov_ratio", 2.0),
        ("kl_cov_coef", -1.0),
        ("top_entropy_fraction", 0.0),
        ("max_generation_batches", 0),
        ("overlong_buffer", -1),
        ("overlong_buffer", 2.5),
        ("overlong_penalty_factor", -1.0),
        ("ppo_epochs", 0),
        ("mini_batches", 0),
        ("dynamic_sampling", 1),
        ("ppo_epochs", True),
        ("clip_eps_low", float("nan")),
        ("clip_eps_high", float("inf")),
        ("dual_clip_c", float("inf")),
        ("clip_cov_lb", float("-inf")),
        ("clip_cov_ub", float("inf")),
        ("kl_cov_coef", float("inf")),
        ("top_entropy_fraction", 1.5),
        ("entropy_coef_max", -0.1),
        ("mismatch_correction", "geometric"),
        ("mismatch_mode", "clip"),
        ("mismatch_cap", 0.0),
        ("mismatch_cap", float("nan")),
    ],
)
def test_algorithm_config_rejects(key, value):
    """Each flat key of the former schema, at its place in the sub-groups (``config/moved_keys.py``)."""
    full = MOVED_KEYS.get(f"algorithm.{key}", f"algorithm.{key}")
    full += ".name" if full in REGROUPED_KEYS else ""
    with pytest.raises(ValueError, match=re.escape(f"{full}={value!r}")):
        AlgorithmConfig(**nested(full, value))


def nested(full_key: str, value, into: dict | None = None) -> dict:
    """``algorithm.a.b=value`` as the keyword arguments ``{"a": {"b": value}}`` (merged into ``into``)."""
    *groups, leaf = full_key.split(".")[1:]
    kwargs = into if into is not None else {}
    node = kwargs
    for group in groups:
        node = node.setdefault(group, {})
    node[leaf] = value
    return kwargs


def test_messages_name_the_full_key_and_what_is_allowed():
    with pytest.raises(
        ValueError,
        match=r"^algorithm\.stare\.top_ratio=1\.5 is out of range: must be a number in "
        r"\[0\.0, 1\.0\]$",
    ):
        STAREConfig(top_ratio=1.5)
    with pytest.raises(
        ValueError,
        match=r"^algorithm\.mismatch\.mode='clip' is not allowed: choose one of "
        r"\['truncate', 'mask'\]$",
    ):
        AlgorithmConfig(mismatch={"mode": "clip"})
    with pytest.raises(ValueError, match=r"^algorithm\.mismatch\.cap=0\.0 is out of range: must be a number > 0\.0$"):
        AlgorithmConfig(mismatch={"cap": 0.0})


def test_cross_field_checks():
    with pytest.raises(ValueError, match="clip_cov.ub"):
        AlgorithmConfig(entropy_control={"clip_cov": {"lb": 5.0, "ub": 1.0}})
    with pytest.raises(ValueError, match="entropy_bonus.coef"):
        AlgorithmConfig(entropy_bonus={"target": 0.3, "coef": 0.5, "coef_max": 0.1})


def test_nested_mapping_and_derived_methods():
    a = AlgorithmConfig(stare={"enabled": True, "selector": "sensitivity"})
    assert isinstance(a.stare, STAREConfig)
    assert a.needs_scoring_pass() and a.stare.needs_sensitivity()
    with pytest.raises(ValueError, match="stare.variant"):
        AlgorithmConfig(stare={"variant": "X"})
    plain = AlgorithmConfig()
    assert not plain.uses_reference() and plain.update.on_policy and not plain.needs_scoring_pass()
    assert not plain.needs_entropy() and plain.collection.overlong_buffer == 0
    assert AlgorithmConfig(kl={"coef": 0.1}).uses_reference()
    assert AlgorithmConfig(update={"ppo_epochs": 2}).needs_scoring_pass()
    assert AlgorithmConfig(update={"mini_batches": 4}).needs_scoring_pass()
    assert AlgorithmConfig(entropy_control={"name": "top_entropy"}).needs_entropy()
    assert AlgorithmConfig(entropy_bonus={"target": 0.3}).entropy_bonus.adaptive
    assert not plain.mismatch.enabled
    assert AlgorithmConfig(mismatch={"correction": "sequence", "mode": "mask"}).mismatch.enabled
    ctrl = STAREConfig(adaptive=True, alpha=0.02, timing="same_step").make_controller()
    assert isinstance(ctrl, STAREController) and ctrl.alpha == 0.02 and ctrl.timing == "same_step"


def test_omegaconf_structured_round_trip_validates():
    base = OmegaConf.structured(AlgorithmConfig)
    merged = OmegaConf.merge(
        base, {"policy_loss": {"clip_eps_high": 0.28}, "stare": {"enabled": True, "variant": "C2"}}
    )
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, AlgorithmConfig) and obj.stare.variant == "C2" and obj.policy_loss.clip_eps_high == 0.28
    bad = OmegaConf.merge(base, {"update": {"loss_agg": "nope"}})
    with pytest.raises(ValueError, match="loss_agg"):
        OmegaConf.to_object(bad)
    # only OmegaConf-friendly field types
    for cls in (AlgorithmConfig, STAREConfig):
        for f in dataclasses.fields(cls):
            assert "Literal" not in str(f.type) and "Union" not in str(f.type)


def test_shipped_algorithm_configs_validate():
    # The files inherit from each other through Hydra defaults lists, so compose them as Hydra does.
    from hydra import compose, initialize_config_dir

    files = sorted(CONF_DIR.glob("*.yaml"))
    assert files
    with initialize_config_dir(config_dir=str(CONF_DIR.parent), version_base="1.3"):
        for path in files:
            composed = compose(f"algorithm/{path.stem}")
            cfg = OmegaConf.merge(OmegaConf.structured(AlgorithmConfig), composed.algorithm)
            obj = OmegaConf.to_object(cfg)
            assert isinstance(obj, AlgorithmConfig) and obj.name == path.stem, path


def test_each_semantics_switch_is_checked_and_refused_where_it_changes_nothing():
    for key in ("dynamic_sampling_metric", "budget_exhausted", "gate_aggregation", "loss_normalizer",
                "on_policy_old_logprobs"):  # fmt: skip
        full = MOVED_KEYS[f"algorithm.{key}"]
        with pytest.raises(ValueError, match=f"{full}='exact'.*allowed"):
            AlgorithmConfig(**nested(full, "exact", {"collection": {"dynamic_sampling": True}}))
    with pytest.raises(ValueError, match="budget_exhausted='stop' does nothing without dynamic sampling"):
        AlgorithmConfig(collection={"budget_exhausted": "stop"})
    AlgorithmConfig(collection={"budget_exhausted": "stop", "dynamic_sampling": True})
    with pytest.raises(ValueError, match="loss_normalizer=micro_batch is not offered with .*seq-mean-token-sum-norm"):
        AlgorithmConfig(update={"loss_normalizer": "micro_batch", "loss_agg": "seq-mean-token-sum-norm"})
    with pytest.raises(ValueError, match="on_policy_old_logprobs=forward applies to on-policy steps only"):
        AlgorithmConfig(update={"on_policy_old_logprobs": "forward", "mini_batches": 2})
    group_scope = STAREConfig(enabled=True, scope="group")
    with pytest.raises(ValueError, match="stare.scope=group is not offered with .*micro_batch_partition=balanced"):
        AlgorithmConfig(stare=group_scope, update={"micro_batch_partition": "balanced"})
    AlgorithmConfig(stare=group_scope)  # consecutive rows keep each group on one rank
    with pytest.raises(ValueError, match="generation_batch_multiplier=3 does nothing without dynamic sampling"):
        AlgorithmConfig(collection={"generation_batch_multiplier": 3})
    like_loss = AlgorithmConfig(stare={"gate_aggregation": "like_loss"}, update={"loss_agg": "seq-mean-token-mean"})
    assert like_loss.gate_loss_agg() == "seq-mean-token-mean"
    assert AlgorithmConfig(update={"loss_agg": "seq-mean-token-mean"}).gate_loss_agg() == "token-mean"
