"""Per-step training telemetry and per-epoch validation telemetry, under the project's metric names.

Both are ``nn.Module``s of torchmetrics objects: their states follow the module's device, updates take
device tensors (no host sync inside the update loop), and each ``compute()`` reduces the sums across
ranks, so a token mean is exact whatever the sharding. Training metrics are computed once per step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from stare_lightning.metrics.accuracy import AvgAtN, DistinctCorrect, MajorityAtN, PassAtK
from stare_lightning.metrics.entropy import EntropyForecast, QuadrantMass, SameBatchEntropyChange, TokenEntropy
from stare_lightning.metrics.functional import DEFAULT_REFLECTION_WORDS, QUADRANTS
from stare_lightning.metrics.step_stats import (
    ClipFraction,
    FracZeroStdGroups,
    GateRate,
    GradNorm,
    ResponseLength,
    RewardStats,
    RolloutCounters,
    SelectedFraction,
    TruncatedFraction,
    UpdateLoss,
)
from stare_lightning.metrics.text import ReflectionWords
from stare_lightning.metrics.tool_use import ToolUse, after_tool_mask


def _grouped(texts: Sequence[str], n: int) -> list[list[str]]:
    return [list(texts[i : i + n]) for i in range(0, len(texts), n)]


class TrainTelemetry(nn.Module):
    """The ``train/`` metrics of one step.

    Per step: ``add_step`` with what the step runner returns (``step.runner.StepResult``), then ``compute`` once.
    With ``tool_use`` the step also reports its episodes' tool calls (``metrics.tool_use``) and the entropy of
    the policy tokens right after a tool's reply (``entropy/after_tool``) and of the other policy tokens
    (``entropy/elsewhere``).
    """

    def __init__(
        self,
        reflection_words: Sequence[str] | None = None,
        forecast_window: int = 20,
        same_batch: bool = False,
        tool_use: bool = False,
    ) -> None:
        super().__init__()
        self.tool = ToolUse() if tool_use else None
        self.entropy_after_tool = TokenEntropy() if tool_use else None
        self.entropy_elsewhere = TokenEntropy() if tool_use else None
        # The same-batch entropy change is measured only on request: it costs forwards.
        self.same_batch = SameBatchEntropyChange() if same_batch else None
        self.quadrants = QuadrantMass()
        self.forecast = EntropyForecast(window=forecast_window)  # across steps: never reset
        self.gate_rate = GateRate()  # cumulative over the run: the gate on-rate so far
        self.gate_rate.persistent(True)  # so it survives a resume, like the forecast window
        self.reflection = ReflectionWords(reflection_words or DEFAULT_REFLECTION_WORDS)
        self.distinct = DistinctCorrect()
        self.lengths = ResponseLength()
        self.truncated = TruncatedFraction()
        self.zero_std = FracZeroStdGroups()
        self.rewards = RewardStats()
        self.selection = SelectedFraction()
        self.clip = ClipFraction()
        self.loss = UpdateLoss()
        self.grad_norm = GradNorm()
        self.rollout = RolloutCounters()

    def _per_step(self) -> tuple:
        return (
            self.quadrants,
            self.reflection,
            self.distinct,
            self.lengths,
            self.truncated,
            self.zero_std,
            self.rewards,
            self.selection,
            self.clip,
            self.loss,
            self.grad_norm,
            self.rollout,
            *([self.same_batch] if self.same_batch is not None else []),
            *([self.tool] if self.tool is not None else []),
        )

    def add_step(self, result) -> None:
        """A ``StepResult``: every selection applied (per step, optimizer step or micro-batch; the quadrant and
        selected-fraction metrics are token-weighted means over them), every real micro-batch's loss sums,
        every optimizer step (its gradient norm, or a skip), the entropy change when measured."""
        batch, scores = result.batch, result.scores
        mask = batch.response_mask
        if self.tool is not None:
            after = after_tool_mask(mask)
            self.entropy_after_tool.update(scores.entropy, after)
            self.entropy_elsewhere.update(scores.entropy, mask.bool() & ~after)
        for chosen in result.selections:
            self.quadrants.update(chosen.advantages, chosen.mask, chosen.phi, chosen.omega, chosen.selected)
            self.selection.update(chosen.selected, chosen.advantages, chosen.mask)
        for sums in result.micro_batch_sums:
            self.clip.update(sums["clip_low"], sums["clip_high"], sums["tokens"])
            self.loss.update(sums["loss"], sums["pg_loss"], sums.get("kl_sum", 0.0), sums["tokens"])
        for grad_norm in result.grad_norms:
            self.loss.update(steps=1)
            if grad_norm is not None:
                self.grad_norm.update(grad_norm)
        if result.entropy_change is not None:
            realised, first_order = result.entropy_change
            self.same_batch.update(realised, first_order, batch.advantages, mask, scores.phi)

    def compute(self, result, collection, *, lr: float) -> dict[str, float]:
        """All ``train/`` metrics of the step; resets the per-step states.

        ``result``: the step runner's ``StepResult``; ``collection``: the step's ``Collection``.
        """
        self.add_step(result)
        batch, stare_params, entropy = result.batch, result.params, result.entropy
        mask = batch.response_mask
        stats = collection.stats
        n = collection.correct.shape[1]
        self.reflection.update(collection.texts)
        self.distinct.update(_grouped(collection.texts, n), collection.correct > 0.5)
        self.lengths.update(mask.sum(-1)[mask.any(-1)])  # a stand-in rank's rows sample nothing (step/collect.py)
        self.truncated.update(collection.truncated)
        self.zero_std.update(torch.cat(stats.zero_std_groups))  # before dynamic sampling dropped any group
        self.rewards.update(torch.cat([r.flatten() for r in stats.generated_rewards]).to(mask.device))
        self.rollout.update(
            tokens=stats.generated_tokens,
            seconds=stats.generation_seconds,
            timeouts=stats.verifier_timeouts,
            errors=stats.verifier_errors,
            batches=stats.generation_batches,
        )
        self.gate_rate.update(bool(stare_params.gate_on))
        if self.tool is not None:
            self.tool.update(collection.episodes)
        out: dict[str, float] = {}
        for metric in self._per_step():
            out.update({k: float(v) for k, v in metric.compute().items()})
            metric.reset()
        if self.tool is not None:
            for key, metric in (("after_tool", self.entropy_after_tool), ("elsewhere", self.entropy_elsewhere)):
                out[f"entropy/{key}"] = float(metric.compute()["entropy"])
                metric.reset()
        out["entropy"] = entropy
        out["lr"] = lr
        out["stare/gate_on"] = float(stare_params.gate_on)
        out["stare/gate_on_rate"] = float(self.gate_rate.compute()["stare/gate_on"])
        out["stare/w"], out["stare/m"] = float(stare_params.w), float(stare_params.m)
        if stare_params.gate_entropy is not None:  # differs from `entropy` when aggregated like the loss
            out["stare/gate_entropy"] = float(stare_params.gate_entropy)
        out.update(result.control)  # the step controllers' signals: the schedule's target, the PI controller's
        # First-order forecast of the next step's entropy change: the exact quadrants' dH add up to the token
        # mean of omega * A * Phi, and lr stands in for the logit step size (its scale is nominal; its sign
        # and its correlation with the realised change are what it tells).
        predicted = lr * sum(out[f"quadrant/exact/{q}/dH"] for q in QUADRANTS)
        out.update({k: float(v) for k, v in self.forecast(entropy, predicted).items()})
        return {f"train/{k}": v for k, v in out.items()}


class BenchmarkMetrics(nn.Module):
    """One validation benchmark's metrics, keyed the way the paper reports them: ``avg@<n>``, ``pass@<k>``
    for every k <= n of ``validation.pass_k``, ``maj@<n>``, ``response_length/mean``, ``truncated_frac``."""

    def __init__(self, n: int, pass_k: Sequence[int]) -> None:
        super().__init__()
        self.n = n
        self.avg = AvgAtN()
        self.pass_at = PassAtK(k=[k for k in pass_k if k <= n] or [1])
        self.majority = MajorityAtN()
        self.lengths = ResponseLength()
        self.truncated = TruncatedFraction()

    def update(self, num_correct: Tensor, majority: Tensor, lengths: Tensor, truncated: Tensor) -> None:
        self.avg.update(num_correct, self.n)
        self.pass_at.update(num_correct, self.n)
        self.majority.update(majority)
        self.lengths.update(lengths)
        self.truncated.update(truncated)

    def compute(self) -> dict[str, float]:
        lengths = self.lengths.compute()
        return {
            f"avg@{self.n}": float(self.avg.compute()["avg@n"]),
            **{key: float(value) for key, value in self.pass_at.compute().items()},
            f"maj@{self.n}": float(self.majority.compute()["maj@n"]),
            "response_length/mean": float(lengths["response_length/mean"]),
            "truncated_frac": float(self.truncated.compute()["response_length/truncated_frac"]),
        }

    def reset(self) -> None:
        for metric in (self.avg, self.pass_at, self.majority, self.lengths, self.truncated):
            metric.reset()


class ValidationTelemetry(nn.Module):
    """The ``val/`` metrics, accumulated over the validation batches of an epoch.

    Pooled over every benchmark: ``avg@n``, ``pass@<k>`` (k up to the smallest n), ``distinct_correct``,
    reflection words and response lengths. Per benchmark (``benchmarks``: name -> samples per prompt):
    ``val/<name>/...`` from ``BenchmarkMetrics``, and ``val/avg``, the mean of the benchmarks' avg@n (the
    paper's "Avg" column).
    """

    def __init__(
        self,
        pass_k: Sequence[int],
        reflection_words: Sequence[str] | None = None,
        benchmarks: dict[str, int] | None = None,
        tool_use: bool = False,
    ) -> None:
        super().__init__()
        self.benchmarks = dict(benchmarks or {})
        self.tool = ToolUse() if tool_use else None
        smallest_n = min(self.benchmarks.values(), default=max(pass_k))
        self.avg = AvgAtN()
        self.pass_at = PassAtK(k=[k for k in pass_k if k <= smallest_n] or [1])
        self.distinct = DistinctCorrect()
        self.reflection = ReflectionWords(reflection_words or DEFAULT_REFLECTION_WORDS)
        self.lengths = ResponseLength()
        self.truncated = TruncatedFraction()
        # ModuleDict keys may not contain dots; benchmark names (file stems) may.
        self.per_benchmark = nn.ModuleDict(
            {_module_key(name): BenchmarkMetrics(n, pass_k) for name, n in self.benchmarks.items()}
        )

    def _metrics(self) -> tuple:
        pooled = (self.avg, self.pass_at, self.distinct, self.reflection, self.lengths, self.truncated)
        return pooled + ((self.tool,) if self.tool is not None else ())

    def update(self, rollouts, scores: Sequence[float], benchmark: str | None = None, majority=None) -> None:
        """One batch of ``rollouts`` (``n`` samples per prompt), the verifier's score of each sample, the
        benchmark the batch belongs to and, per prompt, whether its majority vote is correct."""
        n = rollouts.n
        correct = torch.tensor(list(scores), dtype=torch.float32).view(-1, n) > 0.5
        num_correct = correct.sum(-1)
        # Tokens the policy sampled, as in training (a tool's replies are not the policy's length).
        lengths = torch.tensor([sum(m) for m in rollouts.policy_masks], dtype=torch.float32)
        truncated = torch.tensor([reason == "length" for reason in rollouts.finish_reasons])
        self.avg.update(num_correct, n)
        self.pass_at.update(num_correct, n)
        self.distinct.update(_grouped(rollouts.texts, n), correct)
        self.reflection.update(rollouts.texts)
        self.lengths.update(lengths)
        self.truncated.update(truncated)
        if self.tool is not None:
            self.tool.update(rollouts.episodes)
        if benchmark is not None and _module_key(benchmark) in self.per_benchmark:
            votes = torch.zeros(len(num_correct), dtype=torch.bool) if majority is None else torch.tensor(majority)
            self.per_benchmark[_module_key(benchmark)].update(num_correct, votes, lengths, truncated)

    def compute(self) -> dict[str, float]:
        out = {}
        for metric in self._metrics():
            out.update({f"val/{k}": float(v) for k, v in metric.compute().items()})
        for name in self.benchmarks:
            values = self.per_benchmark[_module_key(name)].compute()
            out.update({f"val/{name}/{key}": value for key, value in values.items()})
        if self.benchmarks:
            out["val/avg"] = sum(out[f"val/{name}/avg@{n}"] for name, n in self.benchmarks.items()) / len(
                self.benchmarks
            )
        return out

    def reset(self) -> None:
        for metric in (*self._metrics(), *self.per_benchmark.values()):
            metric.reset()


def _module_key(name: str) -> str:
    return name.replace(".", "_")


def async_metrics(taken) -> dict[str, float]:
    """``rollout=server``: how the step's batch came from the producer (a ``step.producer.Taken``): its staleness in
    policy versions (every sample of a batch has its batch's), the batches ready when the trainer asked, the
    producer's wait for the batch's version and the push of it, and the batch's generation seconds (the trainer's
    wait for the batch is the step timer's ``time/trainer_idle``)."""
    produced = taken.produced
    stats = produced.collection.stats
    return {
        "train/async/staleness/mean": float(taken.staleness),
        "train/async/staleness/max": float(taken.staleness),
        "train/async/queue_depth": float(taken.queue_depth),
        "train/async/rollout_s": stats.generation_seconds + stats.tool_seconds + stats.verify_seconds,
        "train/time/engine_idle": produced.engine_idle_seconds,
        "train/time/weight_push": produced.push_seconds,
    }


def step_costs(timer, stats, *, tokens: int) -> dict[str, float]:
    """``train/time/*``, throughput and memory of a step: its ``StepTimer`` (collection's inner phases from the
    ``CollectionStats``; ``tokens``: every token the trainer processed) and this process's memory after it."""
    times = timer.metrics(
        rollout_seconds=stats.generation_seconds,
        verify_seconds=stats.verify_seconds,
        tool_seconds=stats.tool_seconds,
        tokens=tokens,
    )
    out = {f"train/{key}": value for key, value in times.items()}
    device = timer.device
    out["train/memory/peak_gib"] = peak_memory_gib(device)
    out["train/memory/current_gib"] = current_memory_gib(device)  # after the step: growth shows here
    return out


def peak_memory_gib(device: torch.device) -> float:
    """Peak accelerator memory of this process, or its peak resident memory on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def current_memory_gib(device: torch.device) -> float:
    """Accelerator memory allocated now, or this process's resident memory now on a CPU (Linux)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except OSError:  # not Linux: no cheap reading of the current resident size
        return float("nan")
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**30
