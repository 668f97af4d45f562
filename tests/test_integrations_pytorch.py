"""The plain-PyTorch STARE (stare_lightning/integrations/pytorch.py) against this project's own step path: the same
gate, W, M, weights and loss on the same batch over several steps with the gate opening and closing; its state
across a save and load; its settings those of ``algorithm.stare``; and no Lightning, Hydra or omegaconf imported."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from stare_lightning.algorithms import LossSpec, policy_loss
from stare_lightning.algorithms.config import STAREConfig
from stare_lightning.integrations.pytorch import _LOOP_OWNED, STARE, STARESettings
from stare_lightning.step.normalizer import step_normalizer
from tests.experiences import on_policy_experience
from tests.project_stare import ProjectSTARE, project_algorithm

TEMPERATURE = 0.9
GROUP = 4


@pytest.fixture(scope="module")
def policy(tiny_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)


def batch_of(vocab: int, seed: int = 7):
    """Two groups of four: prompts of 5 and 8 tokens, responses of 3 to 30 tokens, advantages of both signs and 0."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (5, 8)]
    prompts = [prompts[0]] * GROUP + [prompts[1]] * GROUP
    responses = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (9, 30, 3, 17, 12, 5, 22, 8)]
    advantages = torch.tensor([1.2, -0.6, 0.3, -0.9, 0.0, 0.8, -1.1, 0.4])
    return on_policy_experience(prompts, responses, advantages, n=GROUP)


def response_logits(policy, batch) -> torch.Tensor:
    """The logits that score each response token, as a caller's own loop computes them."""
    out = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids())
    return out.logits[:, batch.prompt_width - 1 : -1]


SETTINGS = dict(variant="C2", top_ratio=0.2, w=1.3, m=0.8, adaptive=True, alpha=0.05, scope="group")


def run_both(policy, settings: dict, other: dict | None = None, steps: int = 4):
    """Both paths over ``steps`` SGD steps (the project's gradients move the policy); the gate's target is set
    each step just above (even steps) or below (odd) the measured entropy, so it opens and closes."""
    batch = batch_of(policy.config.vocab_size)
    project = ProjectSTARE(project_algorithm(**settings), group_size=GROUP, temperature=TEMPERATURE)
    plain = STARE(STARESettings(**(other or settings)), group_size=GROUP)
    spec = LossSpec.of(project.algorithm)
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    rows = []
    try:
        for k in range(steps):
            scores = project.score(policy, batch)
            entropy = float(scores.entropy[batch.response_mask].double().mean())
            target = entropy + (0.05 if k % 2 == 0 else -0.05)
            project.gate.controller.target_entropy = plain.controller.target_entropy = target
            logits = response_logits(policy, batch)
            mine = plain.step(batch.advantages, batch.response_mask, logits=logits, tokens=batch.response_ids,
                              temperature=TEMPERATURE)  # fmt: skip
            stats_lp = torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(-1, batch.response_ids[..., None])[
                ..., 0
            ]
            normalizer = step_normalizer(batch, max_response_length=batch.response_width, device=torch.device("cpu"))
            loss, _ = policy_loss(stats_lp, stats_lp.detach(), batch.advantages, batch.response_mask, spec, normalizer,
                                  token_weights=mine.weights)  # fmt: skip
            theirs = project.step(policy, batch, scores)
            rows.append((mine, loss.detach(), theirs))
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    p -= 2.0 * theirs.grads[name]
    finally:
        policy.load_state_dict(state)
    return rows


def test_weights_gate_and_loss_equal_the_projects_over_steps(policy):
    rows = run_both(policy, SETTINGS)
    assert [mine.gate_on for mine, _, _ in rows] == [True, False, True, False]
    for mine, loss, theirs in rows:
        assert (mine.params.gate_on, mine.params.w, mine.params.m) == (
            theirs.params.gate_on,
            theirs.params.w,
            theirs.params.m,
        )
        assert mine.entropy == pytest.approx(theirs.params.gate_entropy, abs=1e-6)
        assert torch.equal(mine.selected, theirs.selected) and mine.selected.any()
        assert torch.equal(mine.weights, theirs.omega)
        torch.testing.assert_close(loss, theirs.loss, atol=1e-6, rtol=1e-5)
    # The adaptive schedule moved W and M (applied from the step after each measurement).
    assert rows[1][0].params.w == pytest.approx(1.35) and rows[2][0].params.w == pytest.approx(1.3)
    assert {"stare/selected_frac/pos", "quadrant/exact/pos_high/dH", "stare/gate_on"} <= set(rows[0][0].metrics)


def test_the_comparison_sees_a_different_setting(policy):
    """Control: another P gives other weights than the project's, so the equality above is not vacuous."""
    rows = run_both(policy, SETTINGS, other={**SETTINGS, "top_ratio": 0.4}, steps=1)
    mine, _, theirs = rows[0]
    assert not torch.equal(mine.weights, theirs.omega)


def test_per_token_inputs_equal_the_logits_path(policy):
    batch = batch_of(policy.config.vocab_size)
    with torch.no_grad():
        logits = response_logits(policy, batch)
    a = STARE(STARESettings(target_entropy=100.0)).step(
        batch.advantages, batch.response_mask, logits=logits, tokens=batch.response_ids
    )
    logp = torch.log_softmax(logits, -1)
    b = STARE(STARESettings(target_entropy=100.0)).step(
        batch.advantages, batch.response_mask,
        logprobs=logp.gather(-1, batch.response_ids[..., None])[..., 0], entropy=-(logp.exp() * logp).sum(-1),
    )  # fmt: skip
    assert a.gate_on and b.gate_on and torch.equal(a.weights, b.weights) and (a.weights == 1.1).any()
    assert a.entropy == pytest.approx(b.entropy, abs=1e-5)


def test_state_dict_resumes_the_controller():
    g = torch.Generator().manual_seed(1)
    lp, mask = -torch.rand(6, 10, generator=g) * 3, torch.ones(6, 10, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    settings = STARESettings(adaptive=True, alpha=0.1, target_entropy=1.0)
    entropies = [0.5, 0.4, 2.0, 0.3]
    straight = STARE(settings)
    results = [straight.step(adv, mask, logprobs=lp, entropy=torch.full_like(lp, h)) for h in entropies]
    first = STARE(settings)
    for h in entropies[:2]:
        first.step(adv, mask, logprobs=lp, entropy=torch.full_like(lp, h))
    resumed = STARE(settings)
    resumed.load_state_dict(first.state_dict())
    assert (resumed.w, resumed.m, resumed.last_entropy) == (first.w, first.m, pytest.approx(0.4))
    tail = [resumed.step(adv, mask, logprobs=lp, entropy=torch.full_like(lp, h)) for h in entropies[2:]]
    for want, got in zip(results[2:], tail):
        assert (got.params, got.gate_on) == (want.params, want.gate_on) and torch.equal(got.weights, want.weights)
    fresh = STARE(settings).step(adv, mask, logprobs=lp, entropy=torch.full_like(lp, 2.0))
    assert fresh.params.w != tail[0].params.w  # control: without the state, W starts over


def test_settings_are_algorithm_stares():
    ours = {f.name: f.default for f in dataclasses.fields(STARESettings)}
    theirs = {f.name: f.default for f in dataclasses.fields(STAREConfig)}
    assert set(theirs) - set(ours) == set(_LOOP_OWNED)
    assert all(theirs[name] == default for name, default in ours.items())
    with pytest.raises(ValueError, match=r"STARESettings\.top_ratio=2"):
        STARESettings(top_ratio=2)
    with pytest.raises(ValueError, match="group_size"):
        STARE(STARESettings(scope="group"))


def test_imports_no_lightning_hydra_or_omegaconf():
    heavy = "{'lightning', 'pytorch_lightning', 'lightning_fabric', 'hydra', 'omegaconf', 'trl'}"
    seen = f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {heavy}))\n"
    code = (
        f"import sys, stare_lightning.integrations.pytorch\n{seen}"
        # Control, in the same interpreter: a callback of the trainer does import Lightning, so the check can see it.
        f"import stare_lightning.callbacks.entropy_guard\n{seen}"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    alone, control = out.strip().splitlines()[-2:]
    assert alone == "[]", out
    assert "lightning" in control, out
