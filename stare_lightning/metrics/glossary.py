"""What every logged metric name means: the single source of the documentation's metrics reference.

``SECTIONS`` holds one entry per name or per pattern of names. A pattern's placeholders stand for one path
segment each: ``<split>`` is ``train`` or ``val``, ``<quadrant>`` one of ``QUADRANTS``, ``<kind>`` ``proxy`` or
``exact``, ``<phase>`` one of the step timer's ``PHASES``, ``<n>`` and ``<k>`` integers, ``<benchmark>`` and
``<word>`` any name. ``undocumented`` says which names of a run's log have no entry (the tests run it on the CSV
header of a real fit).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from stare_lightning.metrics.functional import QUADRANTS
from stare_lightning.metrics.step_timer import PHASES

__all__ = ["ENTRIES", "PLACEHOLDERS", "SECTIONS", "entry_for", "undocumented"]

PLACEHOLDERS = {
    "split": "train|val",
    "quadrant": "|".join(QUADRANTS),
    "kind": "proxy|exact",
    "phase": "|".join(PHASES),
    "n": r"\d+",
    "k": r"\d+",
    "benchmark": r"[^/]+",
    "word": r"[^/]+",
}

# (section title, {name or pattern: definition}); the order is the reference page's.
SECTIONS: list[tuple[str, dict[str, str]]] = [
    (
        "Entropy",
        {
            "train/entropy": "H_k: the token mean, over every response token of the kept batch, of the rollout "
            "policy's full-vocabulary entropy at the sampling temperature (nats).",
            "train/entropy/predicted_delta": "The first-order forecast made for the previous step's update, "
            "lr x token-mean(omega A Phi): its sign is meaningful, its scale nominal (lr stands in for the logit "
            "step).",
            "train/entropy/realized_delta": "H_k - H_(k-1): the change of `train/entropy` from the previous step, "
            "each measured on its own batch (so it carries batch-to-batch noise).",
            "train/entropy/forecast_corr": "Pearson correlation of `predicted_delta` and `realized_delta` over the "
            "last 20 steps.",
            "train/entropy/realized_delta_same_batch": "The update's entropy change measured on the step's own tokens: "
            "token-mean entropy after the update minus before it (`telemetry.same_batch_entropy`).",
            "train/entropy/first_order_delta": "The same change to first order in the update's logit change, on the "
            "same tokens (`telemetry.same_batch_entropy`).",
            "train/entropy/after_tool": "Token-mean entropy of the first 8 policy tokens after each tool reply "
            "(with a tool).",
            "train/entropy/elsewhere": "Token-mean entropy of the other policy tokens (with a tool).",
        },
    ),
    (
        "STARE's gate, weights and selection",
        {
            "train/stare/gate_on": "1 when the gate was open this step (`train/entropy` below "
            "`algorithm.stare.target_entropy`), else 0.",
            "train/stare/gate_on_rate": "The share of steps so far with the gate open (kept across a resume).",
            "train/stare/gate_entropy": "The entropy the gate compared to its target, where it differs from "
            "`train/entropy` (`algorithm.stare.gate_aggregation=like_loss`).",
            "train/stare/target": "The entropy target the gate compared with this step: "
            "`algorithm.stare.target_entropy`, or its value under `algorithm.stare.target_schedule` (linear or cosine "
            "toward `target_end`).",
            "train/stare/w": "The W applied to L+ tokens this step (moves under the adaptive schedule).",
            "train/stare/m": "The M applied to L- tokens this step (C2; moves under the adaptive schedule).",
            "train/stare/selected_frac/pos": "|L+| / |T+|: the share of positive-advantage tokens STARE selected "
            "(what it would select while the gate is closed or STARE is off).",
            "train/stare/selected_frac/neg": "|L-| / |T-|: the share of negative-advantage tokens STARE selected.",
        },
    ),
    (
        "Other entropy controllers",
        {
            "train/pi/signal": "The PI controller's signal u this step (`algorithm.entropy_control.name=pi`): "
            "positive-advantage tokens weigh 1 - u and negative-advantage tokens 1 + u.",
            "train/pi/error": "Its error: `algorithm.entropy_control.pi.target` minus `train/entropy`.",
            "train/pi/integral": "Its accumulated error (nat-steps), clipped to +-`pi.integral_limit`.",
            "train/pi/weight_pos": "The weight of positive-advantage tokens this step (1 - u).",
            "train/pi/weight_neg": "The weight of negative-advantage tokens this step (1 + u).",
            "train/entropy_bonus/coef": "The entropy-bonus coefficient this step applied, when it adapts toward "
            "`algorithm.entropy_bonus.target`.",
        },
    ),
    (
        "Quadrants",
        {
            "train/quadrant/<kind>/<quadrant>/tokens": "The quadrant's share of the tokens with A != 0. Quadrants "
            "cross the sign of A with high/low: high is 'selected into L+ or L-' for `proxy`, 'Phi > 0' for `exact`.",
            "train/quadrant/<kind>/<quadrant>/weight": "The quadrant's share of sum(omega |A|): how much of the update "
            "its tokens carry, STARE's weights included.",
            "train/quadrant/<kind>/<quadrant>/dH": "sum(omega A Phi) over the quadrant's tokens divided by all valid "
            "tokens: its first-order pull on the entropy; the four `exact` values add up to token-mean(omega A Phi).",
            "train/quadrant/first_order/<quadrant>": "The quadrant's part of `train/entropy/first_order_delta` (exact "
            "quadrants, `telemetry.same_batch_entropy`).",
        },
    ),
    (
        "Rewards, responses and diversity",
        {
            "train/reward/mean": "Mean reward over every generated response of the step, before dynamic sampling "
            "dropped any group.",
            "train/reward/std": "Standard deviation of those rewards.",
            "train/frac_zero_std_groups": "The share of the step's groups whose rewards all agree (no learning signal; "
            "dynamic sampling drops them).",
            "train/generation_batches": "Generation rounds the step took (more than 1 only with dynamic sampling).",
            "<split>/distinct_correct": "Distinct correct responses per prompt (texts compared with surrounding "
            "whitespace stripped).",
            "<split>/response_length/mean": "Mean response length in policy tokens (tool replies excluded).",
            "<split>/response_length/max": "Longest response in policy tokens.",
            "<split>/response_length/truncated_frac": "The share of responses cut at `rollout.max_new_tokens`.",
        },
    ),
    (
        "Loss and optimisation",
        {
            "train/loss": "The step's loss, averaged over its optimizer steps.",
            "train/pg_loss": "Its policy-gradient part (without the KL and entropy terms).",
            "train/kl": "Token mean of the KL estimate to the reference model (0 without `algorithm.kl.coef`).",
            "train/clip_ratio/low": "The share of tokens whose ratio is clipped from below (A < 0, r < 1 - eps_low).",
            "train/clip_ratio/high": "The share of tokens whose ratio is clipped from above (A > 0, r > 1 + eps_high).",
            "train/grad_norm": "Global gradient norm before clipping, averaged over the optimizer steps taken.",
            "train/lr": "The learning rate of the step.",
            "train/nonfinite_skipped": "Optimizer steps skipped so far because a rank saw a non-finite loss or "
            "gradient.",
            "train/loss_scale": "The dynamic fp16 loss scale (`trainer=fsdp_fp16` only).",
        },
    ),
    (
        "Rollout engine and verifiers",
        {
            "train/rollout/tokens_per_s": "Generated tokens per second of generation (summed over ranks: per "
            "rank-second).",
            "train/rollout/logprob_abs_diff/mean": "Token mean of |engine log-prob - trainer log-prob| of the sampled "
            "tokens: the canary that stops a run whose engine drifts from the trainer. On a batch up to "
            "`rollout.max_staleness` versions old it is the behaviour-to-current policy gap, measured but not judged.",
            "train/rollout/logprob_abs_diff/max": "The largest such difference.",
            "train/verifier/timeouts": "Verifier calls of the step that missed their deadline (scored 0).",
            "train/verifier/errors": "Verifier calls of the step that raised, were refused or returned no number in "
            "[0, 1] (scored 0).",
        },
    ),
    (
        "Time, throughput and memory",
        {
            "train/time/step_s": "Wall time of the step, the sum of the `train/time/<phase>` values.",
            "train/time/<phase>": "Wall time of one phase of the step: rollout (generation), tool (tool calls), "
            "verify, score (the scoring pass), update, sync (weights to the engine), telemetry, other.",
            "train/time/trainer_idle": "`rollout=server`: the trainer's wait for the step's batch from the rollout "
            "producer (in place of the rollout, tool and verify phases, which then run beside the step).",
            "train/time/engine_idle": "`rollout=server`: the producer's wait before it could start the step's batch "
            "(its policy version not yet published, or the batch not yet wanted).",
            "train/time/weight_push": "`rollout=server`: the push of the batch's policy version to the servers "
            "(0 when they held it already).",
            "train/throughput/tokens_per_s": "Tokens the trainer processed (prompts and responses) per second of "
            "the step.",
            "train/memory/peak_gib": "Peak accelerator memory of the process, or its peak resident memory on a CPU "
            "(GiB).",
            "train/memory/current_gib": "Accelerator memory allocated after the step, or resident memory on a CPU "
            "(GiB): growth from step to step shows here.",
        },
    ),
    (
        "Asynchronous rollouts",
        {
            "train/async/staleness/mean": "`rollout=server`: how many policy versions the step's samples lag behind "
            "the policy it trains (mean over its samples); at most `rollout.max_staleness`.",
            "train/async/staleness/max": "The largest such lag among the step's samples.",
            "train/async/queue_depth": "Batches the producer had ready when the trainer asked for the step's, "
            "the step's own included (0 when the trainer had to wait for it).",
            "train/async/rollout_s": "Generation, tool and verifier seconds of the step's batch, spent beside the "
            "trainer.",
        },
    ),
    (
        "Reflection words",
        {
            "<split>/reflection/per_response": "Mean count per response of all reflection words and phrases.",
            "<split>/reflection/<word>": "Mean count per response of one word or phrase (whole words, "
            "case-insensitive; spaces as underscores); `validation.reflection_words` replaces the default list.",
        },
    ),
    (
        "Tool use",
        {
            "<split>/tool/calls_per_episode": "Tool calls per episode.",
            "<split>/tool/used_frac": "The share of episodes that called the tool.",
            "<split>/tool/error_rate": "The share of calls that failed (their error text was the reply).",
            "<split>/tool/timeout_rate": "The share of calls that ran out of `tools.timeout_seconds`.",
            "<split>/tool/malformed_rate": "The share of calls that did not parse (answered with an error message).",
            "<split>/tool/seconds": "Mean wall time of a call.",
            "<split>/episode/turns": "Generation turns per episode.",
            "<split>/episode/ended_by_turns": "The share of episodes ended by `rollout.max_turns`.",
            "<split>/episode/ended_by_tokens": "The share of episodes ended by `rollout.max_new_tokens`.",
        },
    ),
    (
        "Validation accuracy",
        {
            "val/avg@n": "Pooled over every validation problem: the mean of c / n (c correct of n samples), i.e. "
            "pass@1 estimated from n samples.",
            "val/pass@<k>": "Pooled: the unbiased estimate 1 - C(n - c, k) / C(n, k), for each k of "
            "`validation.pass_k` up to the smallest n.",
            "val/avg": "The mean of the benchmarks' avg@n (the paper's 'Avg' column).",
            "val/<benchmark>/avg@<n>": "One benchmark's avg@n at its own n.",
            "val/<benchmark>/pass@<k>": "One benchmark's pass@k, for each k of `validation.pass_k` up to its n.",
            "val/<benchmark>/maj@<n>": "One benchmark's majority vote over its n samples: the share of problems whose "
            "most frequent final answer is correct.",
            "val/<benchmark>/response_length/mean": "One benchmark's mean response length in policy tokens.",
            "val/<benchmark>/truncated_frac": "One benchmark's share of responses cut at the length limit.",
        },
    ),
    (
        "Lightning's columns",
        {
            "epoch": "Lightning's epoch counter (the training prompt stream is endless: 0 throughout a fit).",
            "step": "The optimizer step the row belongs to (a validation row: the step it followed).",
        },
    ),
]

ENTRIES: dict[str, str] = {name: text for _, entries in SECTIONS for name, text in entries.items()}


def _compiled(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"<(\w+)>", pattern)
    regex = "".join(re.escape(p) if i % 2 == 0 else f"(?:{PLACEHOLDERS[p]})" for i, p in enumerate(parts))
    return re.compile(regex)


_EXACT = {name for name in ENTRIES if "<" not in name}
_PATTERNS = [(name, _compiled(name)) for name in ENTRIES if "<" in name]


def entry_for(name: str) -> str | None:
    """The glossary entry (name or pattern) that defines ``name``: an exact entry first, else the first pattern."""
    if name in _EXACT:
        return name
    for pattern, regex in _PATTERNS:
        if regex.fullmatch(name):
            return pattern
    return None


def undocumented(names: Iterable[str]) -> list[str]:
    """The names that no entry defines, sorted."""
    return sorted({name for name in names if entry_for(name) is None})
