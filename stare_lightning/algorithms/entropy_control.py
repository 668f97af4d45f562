"""Entropy-control baselines that STARE is compared against, as token masks and penalties.

What it implements:
- Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
  Reasoning Language Models"). Per valid token, the centred covariance
  cov = (log pi(o) - mean log pi(o)) * (A - mean A), means over the valid tokens given.
  Clip-Cov detaches the gradient of n = max(1, floor(clip_ratio * N)) tokens drawn uniformly at
  random among those with lb < cov < ub (fewer if fewer qualify); tokens whose PPO clip is already
  active can be excluded from the draw. KL-Cov adds coef * |log pi - log pi_old| to the loss of the
  k = max(1, floor(kl_cov_ratio * N)) tokens of highest covariance.
- The 80/20 rule (Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive
  Effective RL for LLM Reasoning"): the policy gradient flows only through the top fraction of valid
  tokens by entropy, selected over the batch given.
- An adaptive entropy-bonus coefficient steered toward a target entropy, in the manner of
  Skywork-OR1 (He et al. 2025): coef <- clip(coef + lr * sign(H_tgt - H), min_coef, max_coef).

The first three are token controls and the coefficient a step controller (``entropy_controller.py`` says what each
reads, returns and keeps). Entry ``pi`` of the registry is the PI controller (``entropy_pi.py``), a step controller
whose per-micro-batch part is empty.

Departures: the 80/20 selection takes exactly k = ceil(fraction * N) tokens (ties broken by
position) where the paper thresholds at the batch's entropy percentile (which keeps all ties); the
covariance statistics are computed over the tokens given (a micro-batch, as in the reference code),
and the KL-Cov ranking breaks ties by position.

Scalar settings (ratios, bounds, coefficients, the adaptive coefficient's target and rates) are
range-checked once, by their settings in ``algorithms/config.py`` (``algorithm.entropy_control.clip_cov``,
``.kl_cov``, ``.top_entropy``, ``algorithm.entropy_bonus``); the functions here check tensor shapes only.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from stare_lightning.algorithms.entropy_controller import ControlTerms, TokenControl, finite_entropy, missing_state
from stare_lightning.algorithms.registry import Registry
from stare_lightning.algorithms.surrogates import LOG_RATIO_CLAMP, broadcast_advantages, clip_masks

__all__ = [
    "ENTROPY_CONTROLS",
    "AdaptiveEntropyCoefficient",
    "ControlTerms",
    "clip_cov_mask",
    "kl_cov_penalty",
    "token_covariance",
    "top_entropy_mask",
]


def token_covariance(logprobs: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """Centred per-token covariance (log pi - mean log pi)(A - mean A), means over valid tokens; 0 elsewhere."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs has shape {tuple(logprobs.shape)}; expected [B, T]")
    if mask.shape != logprobs.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}; expected {tuple(logprobs.shape)}")
    valid = mask.to(torch.bool)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    lp = logprobs.detach().to(dtype)
    adv = broadcast_advantages(advantages, logprobs).detach().to(dtype)
    zero = torch.zeros((), dtype=dtype, device=lp.device)
    n = valid.sum().clamp(min=1)
    mean_lp = torch.where(valid, lp, zero).sum() / n
    mean_adv = torch.where(valid, adv, zero).sum() / n
    return torch.where(valid, (lp - mean_lp) * (adv - mean_adv), zero)


def clip_cov_mask(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_ratio: float = 2e-4,
    lb: float = 1.0,
    ub: float = 5.0,
    exclude: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Bool [B, T]: the tokens whose gradient Clip-Cov detaches (see module doc).

    exclude: bool [B, T] of tokens not eligible (e.g. those whose PPO clip is already active).
    generator: for the random draw (on the device of `logprobs`).
    """
    cov = token_covariance(logprobs, advantages, mask)
    valid = mask.to(torch.bool)
    eligible = valid & (cov > lb) & (cov < ub)
    if exclude is not None:
        if exclude.shape != logprobs.shape:
            raise ValueError(f"exclude has shape {tuple(exclude.shape)}; expected {tuple(logprobs.shape)}")
        eligible = eligible & ~exclude.to(torch.bool)
    out = torch.zeros_like(valid)
    n_valid = int(valid.sum().item())
    if n_valid == 0:
        return out
    n_clip = max(1, int(clip_ratio * n_valid))
    idx = eligible.flatten().nonzero().squeeze(1)
    if idx.numel() == 0:
        return out
    perm = torch.randperm(idx.numel(), generator=generator, device=idx.device)
    chosen = idx[perm[: min(n_clip, idx.numel())]]
    out.view(-1)[chosen] = True
    return out


def kl_cov_penalty(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    kl_cov_ratio: float = 2e-3,
    coef: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """(penalty [B, T], selected bool [B, T]): coef * |log pi - log pi_old| on the top-covariance tokens, 0 elsewhere.

    The penalty carries gradient to `logprobs`; it is ADDED to the per-token loss.
    """
    if old_logprobs.shape != logprobs.shape:
        raise ValueError(f"old_logprobs has shape {tuple(old_logprobs.shape)}; expected {tuple(logprobs.shape)}")
    cov = token_covariance(logprobs, advantages, mask)
    valid = mask.to(torch.bool)
    selected = torch.zeros_like(valid)
    n_valid = int(valid.sum().item())
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    if n_valid > 0:
        k = max(1, int(kl_cov_ratio * n_valid))
        idx = valid.flatten().nonzero().squeeze(1)
        order = torch.sort(cov.flatten()[idx], descending=True, stable=True).indices
        selected.view(-1)[idx[order[:k]]] = True
    diff = (logprobs.to(dtype) - old_logprobs.to(dtype)).abs()
    penalty = torch.where(selected, coef * diff, torch.zeros((), dtype=dtype, device=diff.device))
    return penalty, selected


def top_entropy_mask(entropy: Tensor, mask: Tensor, top_fraction: float = 0.2) -> Tensor:
    """Bool [B, T]: the k = ceil(top_fraction * N) valid tokens of highest entropy (ties: earlier position first).

    These keep their policy gradient under the 80/20 rule; all other tokens are detached.
    """
    if mask.shape != entropy.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}; expected {tuple(entropy.shape)}")
    valid = mask.to(torch.bool)
    out = torch.zeros_like(valid)
    idx = valid.flatten().nonzero().squeeze(1)
    n_valid = idx.numel()
    if n_valid == 0:
        return out
    k = min(n_valid, max(1, math.ceil(top_fraction * n_valid - 1e-7)))
    scores = entropy.detach().flatten()[idx]
    order = torch.sort(scores, descending=True, stable=True).indices
    out.view(-1)[idx[order[:k]]] = True
    return out


# The token controls (``entropy_controller.TokenControl``), by ``algorithm.entropy_control.name``'s values.
ENTROPY_CONTROLS: Registry[TokenControl] = Registry("algorithm.entropy_control.name")


@ENTROPY_CONTROLS.register("none")
def no_entropy_control(settings, clip, logprobs, old_logprobs, adv, mask, entropy, generator) -> ControlTerms:
    return ControlTerms()


@ENTROPY_CONTROLS.register("clip_cov")
def clip_cov(settings, clip, logprobs, old_logprobs, adv, mask, entropy, generator) -> ControlTerms:
    """Clip-Cov: detach a random draw of high-covariance tokens whose PPO clip is not already active."""
    valid = mask.to(torch.bool)
    with torch.no_grad():
        ratio = torch.exp((logprobs.detach() - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        low, high = clip_masks(ratio, adv, valid, clip.low, clip.high)
        detach = clip_cov_mask(
            logprobs,
            adv,
            mask,
            clip_ratio=settings.ratio,
            lb=settings.lb,
            ub=settings.ub,
            exclude=low | high,
            generator=generator,
        )
    return ControlTerms(detach=detach)


@ENTROPY_CONTROLS.register("kl_cov")
def kl_cov(settings, clip, logprobs, old_logprobs, adv, mask, entropy, generator) -> ControlTerms:
    """KL-Cov: a |log-ratio| penalty on the top-covariance tokens, in place of the clip."""
    penalty, selected = kl_cov_penalty(
        logprobs, old_logprobs, adv, mask, kl_cov_ratio=settings.ratio, coef=settings.coef
    )
    return ControlTerms(penalty=penalty, controlled=selected, unclipped=True)


@ENTROPY_CONTROLS.register("top_entropy")
def top_entropy(settings, clip, logprobs, old_logprobs, adv, mask, entropy, generator) -> ControlTerms:
    """The 80/20 rule: only the top-entropy tokens keep their policy gradient."""
    if entropy is None:
        raise ValueError("entropy=None is not allowed with entropy_control='top_entropy': pass per-token entropy")
    return ControlTerms(detach=mask.to(torch.bool) & ~top_entropy_mask(entropy, mask, settings.fraction))


@ENTROPY_CONTROLS.register("pi")
def pi_control(settings, clip, logprobs, old_logprobs, adv, mask, entropy, generator) -> ControlTerms:
    """The PI controller (``entropy_pi.py``) acts through the step's token weights by advantage sign, set once per
    step from the batch entropy; nothing per micro-batch."""
    return ControlTerms()


class AdaptiveEntropyCoefficient:
    """Entropy-bonus coefficient steered toward a target entropy (see module doc); a ``StepController``.

    update(H) moves the coefficient by lr toward more bonus when H < target and less when H > target
    (unchanged at equality), clips to [min_coef, max_coef], and returns the value to use in this
    same step. A non-finite H warns and leaves the coefficient unchanged. Expects target, lr >= 0 and
    min_coef <= init_coef <= max_coef (algorithm.entropy_bonus.target, coef_lr, coef, coef_max).
    """

    def __init__(
        self, target: float, init_coef: float, lr: float, min_coef: float = 0.0, max_coef: float = math.inf
    ) -> None:
        self.target = float(target)
        self.lr = float(lr)
        self.min_coef = float(min_coef)
        self.max_coef = float(max_coef)
        self.coef = float(init_coef)
        self.last_entropy: float | None = None

    def update(self, entropy: float | Tensor) -> float:
        value = finite_entropy(entropy, "AdaptiveEntropyCoefficient", f"keeping coef={self.coef}")
        if value is None:
            return self.coef
        direction = float((self.target > value) - (self.target < value))
        self.coef = min(max(self.coef + self.lr * direction, self.min_coef), self.max_coef)
        self.last_entropy = value
        return self.coef

    def metrics(self) -> dict[str, float]:
        """``entropy_bonus/coef``: the coefficient this step's loss applies."""
        return {"entropy_bonus/coef": self.coef}

    def state_dict(self) -> dict[str, float | None]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        missing_state("AdaptiveEntropyCoefficient", state, {"coef", "last_entropy"})
        self.coef = float(state["coef"])
        last = state["last_entropy"]
        self.last_entropy = None if last is None else float(last)
