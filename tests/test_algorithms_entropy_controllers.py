"""The entropy-controller interface, STARE's target schedules and the PI controller, against slow references and
properties that could fail (sign of the response, steady state at the target, the windup bound, resume)."""

from __future__ import annotations

import json
import math
import random
import warnings

import pytest
import torch

from stare_lightning.algorithms import AdaptiveEntropyCoefficient, AlgorithmConfig, STAREConfig, STAREController
from stare_lightning.algorithms.config_controllers import PIControlSettings
from stare_lightning.algorithms.config_groups import MismatchConfig
from stare_lightning.algorithms.entropy_controller import SignWeights, StepController, finite_entropy
from stare_lightning.algorithms.entropy_pi import EntropyPIController
from stare_lightning.algorithms.stare_controller import scheduled_target
from stare_lightning.algorithms.token_weights import micro_batch_token_weights, sign_token_weights


# ------------------------------------------------------------------------------------------- interface
def test_every_step_controller_implements_the_interface():
    controllers = [
        STAREController(),
        AdaptiveEntropyCoefficient(target=0.3, init_coef=0.0, lr=0.01, max_coef=0.1),
        PIControlSettings().make_controller(),
    ]
    for controller in controllers:
        assert isinstance(controller, StepController), type(controller).__name__
        controller.update(0.25)
        state = json.loads(json.dumps(controller.state_dict()))  # plain Python values
        controller.load_state_dict(state)
        assert controller.state_dict() == state
        assert all(math.isfinite(v) for v in controller.metrics().values())
        with pytest.raises(ValueError, match="missing keys"):
            controller.load_state_dict({})
    assert set(controllers[0].metrics()) == {"stare/target"}
    assert set(controllers[1].metrics()) == {"entropy_bonus/coef"}
    assert set(controllers[2].metrics()) == {"pi/signal", "pi/error", "pi/integral", "pi/weight_pos", "pi/weight_neg"}


def test_one_non_finite_guard_for_every_controller():
    assert finite_entropy(torch.tensor(0.25), "X", "keeping") == 0.25
    with pytest.warns(RuntimeWarning, match=r"^Y.update got a non-finite entropy \(nan\); keeping it$"):
        assert finite_entropy(float("nan"), "Y", "keeping it") is None
    pi = EntropyPIController(target=0.3, kp=1.0, ki=0.5, integral_limit=10.0, max_signal=0.9)
    first = pi.update(0.1)
    before = pi.state_dict()
    for bad in (float("nan"), float("-inf"), torch.tensor(float("inf"))):
        with pytest.warns(RuntimeWarning, match="EntropyPIController.update got a non-finite"):
            assert pi.update(bad) == first
        assert pi.state_dict() == before
    coefficient = AdaptiveEntropyCoefficient(target=0.3, init_coef=0.02, lr=0.01, max_coef=0.1)
    with pytest.warns(RuntimeWarning, match="AdaptiveEntropyCoefficient.update got a non-finite.*keeping coef=0.02"):
        assert coefficient.update(float("nan")) == 0.02
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pi.update(0.2)


# -------------------------------------------------------------------------------------- target schedules
def reference_target(kind, start, end, horizon, k):
    """The schedules written out independently: piecewise, in exact fractions of the horizon."""
    if kind == "constant" or k >= horizon and kind != "constant":
        return start if kind == "constant" else end
    p = k / horizon
    if kind == "linear":
        return (1 - p) * start + p * end
    return (start + end) / 2 + (start - end) / 2 * math.cos(math.pi * p)


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_schedules_match_their_formulas(kind):
    for k in range(0, 40):
        want = reference_target(kind, 0.35, 0.2, 25, k)
        assert scheduled_target(kind, 0.35, 0.2, 25, k) == pytest.approx(want, abs=1e-12)
    if kind != "constant":
        assert scheduled_target(kind, 0.35, 0.2, 25, 0) == pytest.approx(0.35)
        assert scheduled_target(kind, 0.35, 0.2, 25, 25) == pytest.approx(0.2)
        assert scheduled_target(kind, 0.35, 0.2, 25, 1000) == pytest.approx(0.2)
        halfway = scheduled_target(kind, 0.35, 0.2, 24, 12)
        assert halfway == pytest.approx(0.275)  # both pass the mean at half the horizon
        values = [scheduled_target(kind, 0.35, 0.2, 25, k) for k in range(30)]
        assert all(a >= b for a, b in zip(values, values[1:]))  # monotone toward the end
    with pytest.raises(ValueError, match="not allowed"):
        scheduled_target("step", 0.3, 0.2, 10, 1)


def test_gate_follows_the_scheduled_target():
    """Entropy held at 0.25, target linear from 0.3 to 0.2 over 10 steps: the targets are 0.30, 0.29, ..., so the
    strict gate is open while the target exceeds 0.25 (steps 0-4) and closed from step 5 (target 0.25) on."""
    c = STAREController(target_entropy=0.3, w=3.0, target_schedule="linear", target_end=0.2, target_horizon=10)
    gates, targets = [], []
    for _ in range(12):
        gates.append(c.update(0.25).gate_on)
        targets.append(c.metrics()["stare/target"])
    assert gates == [True] * 5 + [False] * 7
    assert targets == pytest.approx([0.3 - 0.01 * k for k in range(11)] + [0.2])
    constant = STAREController(target_entropy=0.3)
    assert constant.metrics() == {"stare/target": 0.3}
    assert all(constant.update(h).gate_on == (h < 0.3) for h in (0.1, 0.3, 0.29, 0.5))


def test_adaptive_weights_read_the_scheduled_target():
    """Adaptive W moves by the sign of (this step's target - H): with H = 0.25 it rises while the target is
    above and falls once it is below, exactly as the schedule crosses."""
    c = STAREController(
        target_entropy=0.3, w=1.1, adaptive=True, alpha=0.1, timing="same_step",
        target_schedule="linear", target_end=0.2, target_horizon=10,
    )  # fmt: skip
    ws = [c.update(0.25).w for _ in range(10)]
    assert ws == pytest.approx([1.2, 1.3, 1.4, 1.5, 1.5, 1.5, 1.4, 1.3, 1.2, 1.1])


def test_schedule_state_resumes():
    kwargs = dict(target_entropy=0.4, target_schedule="cosine", target_end=0.1, target_horizon=7)
    a = STAREController(**kwargs)
    for h in (0.5, 0.3, 0.2):
        a.update(h)
    b = STAREController(**kwargs)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for h in (0.35, 0.15, 0.3, 0.2, 0.1, 0.05):
        assert a.update(h) == b.update(h) and a.metrics() == b.metrics()


def test_schedule_settings_are_checked():
    p = "algorithm.stare."
    ok = STAREConfig(enabled=True, target_schedule="linear", target_end=0.2, target_horizon=300)
    controller = ok.make_controller()
    controller.update(1.0)
    assert controller.metrics()["stare/target"] == 0.3
    assert STAREConfig(enabled=True).target_schedule == "constant"
    refusals = [
        (dict(target_schedule="ramp"), f"{p}target_schedule='ramp' is not allowed"),
        (dict(target_end=0.2), f"{p}target_end=0.2 does nothing with {p}target_schedule=constant"),
        (dict(target_horizon=10), f"{p}target_horizon=10 does nothing with {p}target_schedule=constant"),
        (dict(target_schedule="linear", target_horizon=10), f"{p}target_end is required"),
        (dict(target_schedule="cosine", target_end=0.2), f"{p}target_horizon is required"),
        (dict(target_schedule="linear", target_end=-0.1, target_horizon=10), f"{p}target_end=-0.1"),
        (dict(target_schedule="linear", target_end=0.1, target_horizon=0), f"{p}target_horizon=0"),
        (dict(target_schedule="linear", target_end=0.1, target_horizon=2.5), f"{p}target_horizon=2.5"),
    ]
    for settings, message in refusals:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            STAREConfig(enabled=True, **settings)


# ------------------------------------------------------------------------------------------ PI controller
def reference_pi(entropies, target, kp, ki, limit, max_signal):
    """The PI law by explicit running sums: the integral re-clipped after every step, the signal clipped."""
    integral, signals = 0.0, []
    for h in entropies:
        error = target - h
        integral = max(-limit, min(limit, integral + error))
        signals.append(max(-max_signal, min(max_signal, kp * error + ki * integral)))
    return signals


def test_pi_matches_the_reference_law():
    rng = random.Random(0)
    entropies = [0.3 + rng.uniform(-0.2, 0.2) for _ in range(200)]
    pi = EntropyPIController(target=0.3, kp=1.5, ki=0.2, integral_limit=0.7, max_signal=0.4)
    want = reference_pi(entropies, 0.3, 1.5, 0.2, 0.7, 0.4)
    for h, u in zip(entropies, want):
        weights = pi.update(h)
        assert pi.signal == pytest.approx(u, abs=1e-12)
        assert weights == SignWeights(positive=1 - pi.signal, negative=1 + pi.signal)
    assert any(abs(u) == 0.4 for u in want) and any(abs(u) < 0.4 for u in want)  # both regimes exercised


def test_pi_responds_in_the_direction_that_restores_the_target():
    below = EntropyPIController(target=0.3, kp=1.0, ki=0.1, integral_limit=5.0, max_signal=0.5)
    weights = below.update(0.2)  # entropy under target: negative samples (which raise it) count more
    assert weights.positive < 1 < weights.negative
    above = EntropyPIController(target=0.3, kp=1.0, ki=0.1, integral_limit=5.0, max_signal=0.5)
    weights = above.update(0.4)
    assert weights.negative < 1 < weights.positive
    at = EntropyPIController(target=0.3, kp=1.0, ki=0.1, integral_limit=5.0, max_signal=0.5)
    for _ in range(20):
        assert at.update(0.3) == SignWeights(1.0, 1.0)


def test_pi_windup_bound():
    """After 1000 steps 0.2 nats below target the integral sits at its limit, not at 200 nat-steps: once the
    entropy overshoots by 0.1 the signal turns within ceil(limit / 0.1) + 1 steps. Unclipped, it would take
    about 2000 steps."""
    pi = EntropyPIController(target=0.3, kp=0.5, ki=0.1, integral_limit=2.0, max_signal=0.5)
    for _ in range(1000):
        pi.update(0.1)
    assert pi.integral == 2.0 and pi.signal == pytest.approx(0.5 * 0.2 + 0.1 * 2.0)  # kp e + ki limit
    steps = 0
    while pi.signal > 0:
        pi.update(0.4)
        steps += 1
    assert steps <= math.ceil(2.0 / 0.1) + 1
    unclipped = reference_pi([0.1] * 1000 + [0.4] * 21, 0.3, 0.5, 0.1, math.inf, 0.5)
    assert unclipped[-1] > 0  # the same history without the bound is still pushing the wrong way


def simulate(controller, steps, drift=-0.004, gain=0.02, seed=0):
    """A toy plant: each step the entropy drifts down by ``drift`` and the control signal u pushes it by gain u,
    plus noise. A constant drift is the case that needs the integral: a P controller settles off target."""
    rng = random.Random(seed)
    h, trace = 0.45, []
    for _ in range(steps):
        u = controller.update(h).negative - 1.0
        h += drift + gain * u + rng.gauss(0.0, 0.003)
        trace.append(h)
    return trace


def test_pi_settles_at_the_target_where_p_alone_does_not():
    pi = simulate(EntropyPIController(target=0.3, kp=2.0, ki=0.1, integral_limit=5.0, max_signal=0.5), 600)
    p_only = simulate(EntropyPIController(target=0.3, kp=2.0, ki=0.0, integral_limit=5.0, max_signal=0.5), 600)
    pi_tail, p_tail = sum(pi[-200:]) / 200, sum(p_only[-200:]) / 200
    assert abs(pi_tail - 0.3) < 0.01  # over 30 noise seeds the largest miss is 0.004
    # P alone balances the drift with a standing error: drift + gain kp e = 0, e = 0.004 / 0.04 = 0.1 nats.
    assert p_tail == pytest.approx(0.2, abs=0.02)


def test_pi_state_resumes_exactly():
    settings = PIControlSettings(target=0.3, kp=2.0, ki=0.1, integral_limit=5.0, max_signal=0.5)
    a = settings.make_controller()
    for h in (0.45, 0.4, 0.33, 0.28, 0.26):
        a.update(h)
    b = settings.make_controller()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict() and b.integral != 0
    for h in (0.25, 0.31, 0.29, 0.2):
        assert a.update(h) == b.update(h) and a.metrics() == b.metrics()


def test_pi_settings_are_checked():
    p = "algorithm.entropy_control.pi."
    assert PIControlSettings().make_controller().max_signal == 0.5
    for settings, message in [
        (dict(target=-0.1), f"{p}target=-0.1"),
        (dict(kp=-1.0), f"{p}kp=-1.0"),
        (dict(integral_limit=0.0), f"{p}integral_limit=0.0"),
        (dict(max_signal=1.0), f"{p}max_signal=1.0"),
        (dict(kp=0.0, ki=0.0), f"{p}kp=0 and {p}ki=0 leave every weight at 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            PIControlSettings(**settings)
    pi = AlgorithmConfig(entropy_control={"name": "pi", "pi": {"kp": 1.0}})
    assert pi.needs_scoring_pass() and pi.entropy_control.make_step_controller().kp == 1.0
    assert AlgorithmConfig(entropy_control={"name": "clip_cov"}).entropy_control.make_step_controller() is None
    assert not AlgorithmConfig().needs_scoring_pass()


# ------------------------------------------------------------------------------------------ sign weights
def test_sign_token_weights_match_a_loop():
    advantages = torch.tensor([0.5, -1.0, 0.0, 2.0])
    like = torch.zeros(4, 3)
    got = sign_token_weights(advantages, like, SignWeights(positive=0.7, negative=1.3))
    for i, a in enumerate(advantages.tolist()):
        want = 0.7 if a > 0 else 1.3 if a < 0 else 1.0
        assert got[i].tolist() == pytest.approx([want] * 3)
    per_token = torch.tensor([[1.0, -1.0, 0.0]])
    assert sign_token_weights(per_token, per_token, SignWeights(0.5, 2.0)).tolist() == [[0.5, 2.0, 1.0]]


def test_token_weights_compose_and_neutral_signs_change_nothing():
    mask = torch.ones(2, 3, dtype=torch.bool)
    old = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    omega = torch.tensor([[3.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    off = MismatchConfig()
    kwargs = dict(mask=mask, old_logprobs=old, rollout_logprobs=old, advantages=adv)
    assert micro_batch_token_weights(off, stare_omega=omega, **kwargs) is omega  # as before: the same tensor
    assert micro_batch_token_weights(off, stare_omega=None, **kwargs) is None
    got = micro_batch_token_weights(off, stare_omega=omega, signs=SignWeights(0.8, 1.2), **kwargs)
    torch.testing.assert_close(got, torch.tensor([[2.4, 0.8, 0.8], [1.2, 1.2, 1.2]]))
