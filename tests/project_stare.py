"""This project's STARE on one batch, the way its step runs it (scoring pass, gate, step-wide selection,
``micro_batch_loss``): the reference the integrations (stare_lightning/integrations/) are checked against."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from stare_lightning.algorithms import AlgorithmConfig
from stare_lightning.algorithms.stare_controller import StepParams
from stare_lightning.step import Experience, LossPlan, micro_batch_loss
from stare_lightning.step.normalizer import step_normalizer
from stare_lightning.step.scoring import TokenScores, score_batch
from stare_lightning.step.selection import Gate, TokenSelection


def project_algorithm(*, loss_agg: str = "token-mean", policy_loss: str = "ppo", **stare) -> AlgorithmConfig:
    """STARE on, with ``stare`` settings, the clipped ``policy_loss`` surrogate (eps 0.2 / 0.28), no KL, no entropy
    bonus, one on-policy optimizer step per batch whose old log-probs are the update forward's own (ratio exactly
    1)."""
    base = AlgorithmConfig()
    return dataclasses.replace(
        base,
        policy_loss=dataclasses.replace(base.policy_loss, name=policy_loss, clip_eps_low=0.2, clip_eps_high=0.28),
        update=dataclasses.replace(base.update, loss_agg=loss_agg, on_policy_old_logprobs="forward"),
        stare=dataclasses.replace(base.stare, enabled=True, **stare),
    )


@dataclass
class ProjectStep:
    """One step's result: the scoring pass, this step's parameters, the weights the loss applied, the loss and the
    policy's gradients."""

    scores: TokenScores
    params: StepParams
    omega: torch.Tensor  # [rows, width]: all ones when the gate is closed
    selected: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


class ProjectSTARE:
    """The project's gate and selection across steps for ``algorithm``, with ``group_size`` rows per group."""

    def __init__(self, algorithm: AlgorithmConfig, *, group_size: int, temperature: float = 1.0) -> None:
        self.algorithm = algorithm
        self.temperature = temperature
        self.gate = Gate("token-mean", algorithm.stare.make_controller(), None, 0, torch.device("cpu"))
        self.selection = TokenSelection.resolve(algorithm.stare, group_size=group_size)

    def score(self, policy, batch: Experience) -> TokenScores:
        return score_batch(policy, batch, temperature=self.temperature, chunk_size=64, micro_batch_tokens=1 << 20)

    def step(
        self, policy, batch: Experience, scores: TokenScores | None = None, *, max_response_length: int | None = None
    ) -> ProjectStep:
        """Gate, selection and the loss (one micro-batch: the whole batch) with its gradients on ``policy``;
        ``max_response_length``: the constant length of ``seq-mean-token-sum-norm`` (default: the batch's width)."""
        scores = scores if scores is not None else self.score(policy, batch)
        params = self.gate.advance(self.gate.measure(scores, batch))
        chosen = self.selection.over_step(scores, batch, params)
        part = Experience.build(
            batch, old_logprobs=scores.logprobs, phi=scores.phi, stare_weights=chosen.omega,
            stare_selected=chosen.selected,
        )  # fmt: skip
        width = max_response_length or batch.response_width
        normalizer = step_normalizer(part, max_response_length=width, device=torch.device("cpu"))
        policy.zero_grad(set_to_none=True)
        result = micro_batch_loss(
            policy, None, part, normalizer, LossPlan.resolve(self.algorithm), params=params, entropy_coef=0.0,
            temperature=self.temperature, chunk_size=64, selection=self.selection,
        )  # fmt: skip
        result.loss.backward()
        grads = {name: p.grad.detach().clone() for name, p in policy.named_parameters() if p.grad is not None}
        omega = chosen.omega if chosen.omega is not None else torch.ones(batch.response_mask.shape)
        return ProjectStep(scores, params, omega, chosen.selected, result.loss.detach(), grads)
