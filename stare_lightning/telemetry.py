"""Per-step training telemetry and per-epoch validation telemetry, under the project's metric names.

Both are ``nn.Module``s holding torchmetrics objects, so their states follow the module's device and
every ``compute()`` reduces sums across ranks: a token mean is exact whatever the sharding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from stare_lightning.algorithms import predicted_entropy_change
from stare_lightning.config.schema import RunConfig
from stare_lightning.experience import Experience
from stare_lightning.metrics import (
    DEFAULT_REFLECTION_WORDS,
    AvgAtN,
    DistinctCorrect,
    EntropyForecast,
    FracZeroStdGroups,
    GateRate,
    PassAtK,
    QuadrantMass,
    ReflectionWords,
    ResponseLength,
    TokenEntropy,
)


def _global_sum(values: Tensor) -> Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values)
    return values


class TrainTelemetry(nn.Module):
    def __init__(self, cfg: RunConfig) -> None:
        super().__init__()
        self.eps = (cfg.algorithm.clip_eps_low, cfg.algorithm.clip_eps_high)
        words = cfg.validation.reflection_words or DEFAULT_REFLECTION_WORDS
        self.entropy = TokenEntropy()
        self.quadrants = QuadrantMass()
        self.forecast = EntropyForecast(window=20)
        self.reflection = ReflectionWords(words)
        self.distinct = DistinctCorrect()
        self.lengths = ResponseLength()
        self.zero_std = FracZeroStdGroups()
        self.gate_rate = GateRate()  # cumulative over the run: the gate on-rate so far
        self.gate_rate.persistent(True)  # so it survives a resume, like the forecast window

    def measure_entropy(self, experience: Experience) -> float:
        """H_k: token-mean entropy of the rollout policy over every valid response token of the step, all ranks."""
        self.entropy.reset()
        self.entropy.update(experience.entropy, experience.response_mask)
        return float(self.entropy.compute()["entropy"])

    def step(self, *, experience: Experience, collection, entropy: float, stare: dict, canary: dict,
             optimizer: dict, lr: float) -> dict[str, float]:
        mask = experience.response_mask
        out: dict[str, float] = {}
        per_step = (self.quadrants, self.reflection, self.distinct, self.lengths, self.zero_std)
        for metric in per_step:
            metric.reset()
        self.quadrants.update(experience.advantages, mask, experience.phi, experience.token_weights, experience.selected)
        self.reflection.update(collection.kept_texts)
        n = collection.kept_correct.shape[1]
        texts = collection.kept_texts
        self.distinct.update([texts[i : i + n] for i in range(0, len(texts), n)], collection.kept_correct > 0.5)
        self.lengths.update(mask.sum(-1))
        for rewards in collection.generated_rewards:  # before dynamic sampling dropped any group
            self.zero_std.update(rewards)
        for metric in per_step:
            out.update({k: float(v) for k, v in metric.compute().items()})

        # Sums over this rank's step, reduced once across ranks.
        stats = stare["stats"]
        # Rewards of every generated response, before dynamic sampling dropped any group.
        rewards = torch.cat([r.flatten() for r in collection.generated_rewards]).double().to(mask.device)
        sums = torch.tensor(
            [
                rewards.sum(), (rewards**2).sum(), rewards.numel(),
                float(stats.selected_pos), float(stats.num_pos), float(stats.selected_neg), float(stats.num_neg),
                optimizer.get("clip_low", 0.0), optimizer.get("clip_high", 0.0), optimizer.get("kl_sum", 0.0),
                optimizer.get("tokens", 0.0), collection.generated_tokens, collection.generation_batches,
                collection.verifier_timeouts, collection.verifier_errors, optimizer.get("loss", 0.0),
                optimizer.get("pg_loss", 0.0),
            ],
            dtype=torch.float64,
            device=mask.device,
        )
        (r_sum, r_sq, r_n, sel_pos, n_pos, sel_neg, n_neg, clip_low, clip_high, kl_sum, tokens, gen_tokens,
         gen_batches, timeouts, errors, loss, pg_loss) = _global_sum(sums).tolist()
        mean = r_sum / max(r_n, 1)
        out["reward/mean"] = mean
        out["reward/std"] = max(r_sq / max(r_n, 1) - mean**2, 0.0) ** 0.5
        out["entropy"] = entropy
        out["stare/selected_frac/pos"] = sel_pos / n_pos if n_pos else 0.0
        out["stare/selected_frac/neg"] = sel_neg / n_neg if n_neg else 0.0
        out["clip_ratio/low"] = clip_low / max(tokens, 1)
        out["clip_ratio/high"] = clip_high / max(tokens, 1)
        out["kl"] = kl_sum / max(tokens, 1)
        # Each rank holds its share of every optimizer step's loss (normalised by global counts): their sum is
        # the loss of the whole batch, averaged here over the optimizer steps of this rollout batch.
        optimizer_steps = max(optimizer.get("optimizer_steps", 1.0), 1.0)
        out["loss"] = loss / optimizer_steps
        out["pg_loss"] = pg_loss / optimizer_steps
        out["grad_norm"] = optimizer.get("grad_norm", float("nan"))
        out["lr"] = lr
        out["generation_batches"] = gen_batches / max(dist.get_world_size() if dist.is_initialized() else 1, 1)
        out["verifier/timeouts"] = timeouts
        out["verifier/errors"] = errors
        seconds = max(collection.generation_seconds, 1e-9)
        out["rollout/tokens_per_s"] = collection.generated_tokens / seconds
        out.update(canary)  # rollout/logprob_abs_diff/{mean,max}

        self.gate_rate.update(bool(stare["gate_on"]))
        out["stare/gate_on"] = float(stare["gate_on"])
        out["stare/gate_on_rate"] = float(self.gate_rate.compute()["stare/gate_on"])
        out["stare/w"], out["stare/m"] = float(stare["w"]), float(stare["m"])

        # First-order forecast of the next step's entropy change (section 2 of the method doc).
        # lr stands in for the logit step size: the forecast's scale is nominal, its sign and correlation are not.
        local = predicted_entropy_change(
            experience.phi, experience.advantages, experience.token_weights, mask, lr, num_tokens=1.0
        )
        totals = _global_sum(torch.stack([local.double(), mask.sum().double()]))
        predicted = float(totals[0] / totals[1].clamp(min=1))
        out.update({k: float(v) for k, v in self.forecast(entropy, predicted).items()})
        return {f"train/{k}": v for k, v in out.items()}


class ValidationTelemetry(nn.Module):
    def __init__(self, cfg: RunConfig) -> None:
        super().__init__()
        words = cfg.validation.reflection_words or DEFAULT_REFLECTION_WORDS
        self.avg = AvgAtN()
        self.pass_at = PassAtK(k=list(cfg.validation.pass_k))
        self.distinct = DistinctCorrect()
        self.reflection = ReflectionWords(words)
        self.lengths = ResponseLength()

    def update(self, rollouts, scores) -> None:
        n = rollouts.n
        correct = torch.tensor(scores.scores, dtype=torch.float32).view(-1, n) > 0.5
        num_correct = correct.sum(-1)
        self.avg.update(num_correct, n)
        self.pass_at.update(num_correct, n)
        texts = rollouts.texts
        self.distinct.update([texts[i : i + n] for i in range(0, len(texts), n)], correct)
        self.reflection.update(texts)
        self.lengths.update(torch.tensor([len(r) for r in rollouts.response_ids], dtype=torch.float32))

    def compute(self) -> dict[str, float]:
        out = {}
        for metric in (self.avg, self.pass_at, self.distinct, self.reflection, self.lengths):
            out.update({f"val/{k}": float(v) for k, v in metric.compute().items()})
        return out

    def reset(self) -> None:
        for metric in (self.avg, self.pass_at, self.distinct, self.reflection, self.lengths):
            metric.reset()
