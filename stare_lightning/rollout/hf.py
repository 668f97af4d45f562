"""Rollouts with Hugging Face ``generate`` on the policy module itself.

The engine samples from the very module the trainer optimises, so its weights are always current and
``sync_weights`` has nothing to do for that module. Prompts are repeated ``n`` times, left-padded and
generated in batches. The log-probability stored for each sampled token is
``log_softmax(raw_logits / temperature)`` at that token: exactly what the trainer's forward pass under the
same temperature computes, so the two agree up to kernel noise. Under top-p/top-k the tokens are drawn
from the truncated, renormalised distribution while these log-probs are taken over the full vocabulary,
so importance ratios built on them carry the truncation bias (see ``SamplingParams.truncates_support``).

Stopping. A row ends at its first EOS, once its decoded text contains one of ``params.stop`` (the token that
completes the stop string is kept, as vLLM keeps it) or at its own token budget, whichever comes first; a
stopping criterion marks finished rows so that a batch ends when all its rows have.

Sampling. ``generate`` runs greedy search over logits that a processor has warped (temperature, top-k,
top-p, in transformers' order) and then perturbed: ``argmax(z - log E)`` with ``E ~ Exp(1)`` drawn
independently per vocabulary entry is an exact sample from ``softmax(z)`` (the exponential race, as in
vLLM's sampler). Each response row draws its noise from its own generator seeded ``seed + j``
(``rollout.base``), so a row's tokens do not depend on the other rows of the batch, on the batch size or on
the rank, which ``torch.multinomial`` over the batch could not give. The cost is one small random draw per
row and decoding step.

A module sharded with FSDP2 (``fully_shard``) works too: generation runs under ``no_grad`` and, when
several ranks take part, with ``synced_gpus`` so every rank keeps calling forward (and so joining the
all-gathers) until all ranks are done. Ranks may pass different numbers of prompts (the number of
``generate`` calls per rollout batch is agreed first), but every rank must call ``generate`` itself the same
number of times.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from stare_lightning.distributed import is_distributed
from stare_lightning.rollout.backends import EngineContext
from stare_lightning.rollout.base import Rollouts, SamplingParams, check_prompts, request_budgets, request_seeds
from stare_lightning.rollout.config import RolloutConfig

# Upper bound on the raw logits kept during one generate call ([rows, steps, vocab] fp32); larger
# rollout batches are generated in chunks of rows.
_DEFAULT_LOGITS_BUDGET_BYTES = 1 << 30


class HFRolloutEngine:
    """A ``RolloutEngine`` backed by ``model.generate``.

    Args:
        model: a causal LM with ``generate`` (the policy itself, possibly FSDP2-sharded).
        tokenizer: its tokenizer; supplies the EOS/pad ids and decodes the texts.
        max_batch_size: rows per ``generate`` call; by default as many as fit in ``logits_budget_bytes``.
        eos_token_ids: ids that end a response; by default the tokenizer's EOS plus the model's
            generation-config EOS ids.
    """

    # Generation runs on the trained module itself: there is no separate copy of the weights to sync.
    holds_weight_copy = False

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        max_batch_size: int | None = None,
        eos_token_ids: list[int] | None = None,
        logits_budget_bytes: int = _DEFAULT_LOGITS_BUDGET_BYTES,
    ) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.logits_budget_bytes = logits_budget_bytes
        self.eos_token_ids = sorted(set(eos_token_ids if eos_token_ids is not None else _eos_ids(model, tokenizer)))
        if not self.eos_token_ids:
            raise ValueError("No EOS token id: set one on the tokenizer or pass eos_token_ids")
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else self.eos_token_ids[0]

    # -- protocol -------------------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        max_new_tokens: Sequence[int] | None = None,
    ) -> Rollouts:
        check_prompts(prompt_ids)
        rows = [list(p) for p in prompt_ids for _ in range(params.n)]
        prompt_seeds = request_seeds(params, len(prompt_ids), seeds)
        # Unseeded prompts take their seed from torch's global generator, so torch.manual_seed still governs them.
        prompt_seeds = [int(torch.randint(2**31 - params.n, ())) if s is None else s for s in prompt_seeds]
        row_seeds = [s + j for s in prompt_seeds for j in range(params.n)]
        row_budgets = [b for b in request_budgets(params, len(prompt_ids), max_new_tokens) for _ in range(params.n)]
        start = time.perf_counter()
        response_ids: list[list[int]] = []
        logprobs: list[list[float]] = []
        finish: list[str] = []
        synced = _needs_synced_generation(self.model)
        with _eval_mode(self.model), torch.no_grad():
            chunk = self._rows_per_call(max(row_budgets, default=1), len(rows))
            chunks = [rows[lo : lo + chunk] for lo in range(0, len(rows), chunk)]
            chunk_seeds = [row_seeds[lo : lo + chunk] for lo in range(0, len(rows), chunk)]
            chunk_budgets = [row_budgets[lo : lo + chunk] for lo in range(0, len(rows), chunk)]
            calls = _max_over_ranks(len(chunks), self._device()) if synced else len(chunks)
            for call in range(calls):
                if call >= len(chunks):
                    # This rank is out of rows but the others are still generating: join their forward
                    # passes with a throwaway row so the all-gathers line up.
                    self._generate_rows(rows[:1] or [[self.pad_token_id]], [0], [1], params, synced)
                    continue
                ids, lps, reasons = self._generate_rows(
                    chunks[call], chunk_seeds[call], chunk_budgets[call], params, synced
                )
                response_ids += ids
                logprobs += lps
                finish += reasons
        seconds = time.perf_counter() - start
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in response_ids]
        return Rollouts(
            prompt_ids=rows,
            response_ids=response_ids,
            response_logprobs=logprobs,
            texts=texts,
            finish_reasons=finish,
            n=params.n,
            generation_seconds=seconds,
        )

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Generation runs on the policy module itself; a different module replaces it."""
        if model is not self.model:
            self.model = model

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass

    # -- internals ------------------------------------------------------------------------------------

    def _device(self) -> torch.device:
        param = next(self.model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def _rows_per_call(self, max_new_tokens: int, total_rows: int) -> int:
        if self.max_batch_size is not None:
            return self.max_batch_size
        vocab = self._vocab_size()
        per_row = max(1, max_new_tokens * vocab * 4)
        return max(1, min(total_rows, self.logits_budget_bytes // per_row))

    def _vocab_size(self) -> int:
        config = getattr(self.model, "config", None)
        vocab = getattr(config, "vocab_size", None)
        return int(vocab) if vocab else len(self.tokenizer)

    def _generation_config(self, params: SamplingParams, max_new_tokens: int):
        from transformers import GenerationConfig

        # Greedy search over the processors' perturbed logits (see the module docstring). Every knob that
        # would change the distribution is set explicitly, so the model's own generation_config (applied by
        # generate only where ours are None) cannot leak in.
        return GenerationConfig(
            do_sample=False,
            num_beams=1,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            typical_p=1.0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
            return_dict_in_generate=True,
            output_logits=True,
        )

    def _generate_rows(
        self, rows: list[list[int]], row_seeds: list[int], budgets: list[int], params: SamplingParams, synced: bool
    ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        device = self._device()
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, width - len(r) :] = 1
        ends = ResponseEnds(self.tokenizer, self.eos_token_ids, params.stop, budgets)
        out = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=self._generation_config(params, max(budgets)),
            logits_processor=_sampling_processors(params, row_seeds, device),
            stopping_criteria=StoppingCriteriaList([_RowsFinished(ends, width)]),
            synced_gpus=synced,
        )
        new_tokens = out.sequences[:, width:].cpu()
        steps = new_tokens.shape[1]
        token_logprobs = torch.empty(new_tokens.shape, dtype=torch.float32)
        for t, logits in enumerate(out.logits[:steps]):
            lp = F.log_softmax(logits.float() / params.temperature, dim=-1)
            token_logprobs[:, t] = lp.gather(-1, new_tokens[:, t : t + 1].to(lp.device)).squeeze(-1).cpu()
        ids_out, lps_out, reasons = [], [], []
        for i in range(len(rows)):
            end, reason = ends.end(i, new_tokens[i].tolist())
            ids_out.append(new_tokens[i, :end].tolist())
            lps_out.append(token_logprobs[i, :end].tolist())
            reasons.append(reason)
        return ids_out, lps_out, reasons


class ResponseEnds:
    """Where each row's response ends: its first EOS (kept), the token that completes a stop string (kept),
    or its token budget. Stop strings are looked for in the decoded text of the last few tokens, enough to
    hold the longest stop string."""

    def __init__(self, tokenizer, eos_token_ids: Sequence[int], stop: Sequence[str], budgets: Sequence[int]) -> None:
        self.tokenizer, self.eos, self.stop, self.budgets = tokenizer, set(eos_token_ids), tuple(stop), list(budgets)
        # A token decodes to at least one character, except pieces of a multi-byte character: some slack.
        self.window = max((len(s) for s in self.stop), default=0) + 4

    def finished(self, row: int, tokens: list[int]) -> bool:
        """Whether a row with these generated tokens is done (called after every decoding step)."""
        if not tokens:
            return False
        return len(tokens) >= self.budgets[row] or tokens[-1] in self.eos or self._stops_at(tokens, len(tokens))

    def end(self, row: int, tokens: list[int]) -> tuple[int, str]:
        """(number of tokens kept, finish reason) for a row's generated tokens (padding after its end ignored)."""
        for t, token in enumerate(tokens[: self.budgets[row]]):
            if token in self.eos or self._stops_at(tokens, t + 1):
                return t + 1, "stop"
        return min(len(tokens), self.budgets[row]), "length"

    def _stops_at(self, tokens: list[int], end: int) -> bool:
        """Whether the text of ``tokens[:end]`` contains a stop string that its last token completes."""
        if not self.stop:
            return False
        tail = self.tokenizer.decode(tokens[max(0, end - self.window) : end], skip_special_tokens=True)
        before = self.tokenizer.decode(tokens[max(0, end - self.window) : end - 1], skip_special_tokens=True)
        return any(s in tail and s not in before for s in self.stop)


class _RowsFinished(StoppingCriteria):
    """Tells ``generate`` which rows are done (so the batch stops when all are), from ``ResponseEnds``."""

    def __init__(self, ends: ResponseEnds, prompt_width: int) -> None:
        self.ends, self.prompt_width = ends, prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        generated = input_ids[:, self.prompt_width :].tolist()
        done = [self.ends.finished(row, tokens) for row, tokens in enumerate(generated)]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _eos_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    ids: list[int] = []
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        ids.append(int(tok_eos))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.append(gen_eos)
    elif gen_eos is not None:
        ids += [int(e) for e in gen_eos]
    return ids


def _needs_synced_generation(model: torch.nn.Module) -> bool:
    """True when the module is FSDP2-sharded across several ranks (forward passes must stay in lockstep)."""
    if not is_distributed():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _max_over_ranks(value: int, device: torch.device) -> int:
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return int(tensor.item())


@contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Put every submodule in eval mode, then restore each one's own flag (frozen parts stay as they were)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


class ExponentialRaceSampler(LogitsProcessor):
    """Perturbs each row's (warped) logits with ``-log E``, ``E ~ Exp(1)`` from that row's own generator.

    The argmax of the result is a sample from the row's softmax; masked entries (``-inf``) stay masked.
    """

    def __init__(self, row_seeds: Sequence[int], device: torch.device) -> None:
        self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in row_seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.shape[0] != len(self.generators):
            raise ValueError(f"{scores.shape[0]} rows of logits for {len(self.generators)} row generators")
        # float64: a draw of exactly 0 (an infinite boost for one token) has probability ~2**-53 per entry
        # instead of fp32's ~2**-24, which a large vocabulary would hit every few hundred steps.
        noise = torch.empty(scores.shape, dtype=torch.float64, device=scores.device)
        for row, generator in enumerate(self.generators):
            noise[row].exponential_(generator=generator)
        noise = noise.clamp_min_(torch.finfo(torch.float64).tiny).log_().float()
        return scores.float() - noise


def _sampling_processors(params: SamplingParams, row_seeds: Sequence[int], device: torch.device) -> LogitsProcessorList:
    warpers: list[LogitsProcessor] = []
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    return LogitsProcessorList([*warpers, ExponentialRaceSampler(row_seeds, device)])


def build_hf_engine(rollout: RolloutConfig, context: EngineContext) -> HFRolloutEngine:
    """``rollout.backend=hf``'s builder (``rollout/backends.py``): generation with the trainer's own policy module."""
    return HFRolloutEngine(context.policy, context.tokenizer)
