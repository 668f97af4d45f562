"""Multi-turn episodes: the policy calls a tool, reads its output, and goes on, on top of any rollout engine.

An episode is a prompt's response built turn by turn. The engine samples until the policy closes a tool call
(the call format's stop strings), ends its answer (EOS) or spends the episode's token budget; a closed call
runs in the tool, the tool's reply is tokenised (what the tool wrote as plain text, even where it spells a special
token: ``encode_reply``) and appended, and generation resumes from the whole context, for every live episode of
the batch at once. ``max_new_tokens`` bounds the episode after the prompt, tool
replies included (a reply that would overflow it is cut and the episode ends); at most ``max_turns`` calls are
answered (a further call ends the episode). Token ids travel end to end: the policy's own tokens are never
re-tokenised, so the trainer scores exactly the tokens that were sampled.

Seeding: the first turn of sample ``j`` of a prompt is seeded ``seed + j`` as a single-turn sample is (an
episode that never calls the tool is the single-turn sample), later turns ``turn_seed(seed + j, turn)``; an
episode therefore does not depend on the other episodes of its batch or on the rank that runs it.

What the policy did not sample is marked in ``Rollouts.policy_masks`` (False on tool replies, log-prob 0);
the loss, STARE's selection, the entropy gate, the telemetry and the canary all read that mask. A call the
format cannot parse is answered with an error message and counted; a tool that fails or times out answers
with its error text (``ToolResult.ok`` False). The run goes on either way.

Departure from ReTool/verl: the interpreter's state across calls is kept by replaying the episode's earlier
successful calls (``history``) in a fresh sandbox, rather than by a long-lived kernel per episode.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from stare_lightning.rollout.base import EpisodeStats, RolloutEngine, Rollouts, SamplingParams, request_seeds
from stare_lightning.tools import CallFormat, ParsedCall, Tool, ToolResult, run_calls
from stare_lightning.tools.formats import encode_reply


def turn_seed(episode_seed: int, turn: int) -> int:
    """The seed of an episode's ``turn`` (>= 1): a hash, so turns and episodes never share a stream."""
    digest = hashlib.blake2b(f"{episode_seed}/turn{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


@dataclass
class _Episode:
    """One episode while it is being built (finished into a row of ``Rollouts``)."""

    prompt: list[int]
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_mask: list[bool] = field(default_factory=list)
    history: list[str] = field(default_factory=list)  # payloads of the calls that succeeded, oldest first
    stats: EpisodeStats = field(default_factory=EpisodeStats)
    pending: ParsedCall | None = None  # the call its last turn closed, until it is answered
    finish: str | None = None  # set when the episode is over

    def add(self, tokens: Sequence[int], logprobs: Sequence[float] | None, text: str) -> None:
        """Append the policy's tokens (with their log-probs) or, with ``logprobs`` None, a tool reply."""
        self.tokens += tokens
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)
        self.policy_mask += [logprobs is not None] * len(tokens)
        segment = ("policy" if logprobs is not None else "tool", text)
        self.stats = replace(self.stats, segments=(*self.stats.segments, segment))


class ToolEpisodes:
    """A rollout engine whose responses are tool-using episodes; ``engine`` samples every turn.

    Args:
        engine: the single-turn engine (vLLM or HF) holding the policy.
        tool: what a call runs in.
        call_format: how calls are written and replies rendered.
        tokenizer: the policy's tokenizer (decodes turns, encodes tool replies).
        max_turns: tool calls answered per episode.
        max_workers: tool calls run at once.
    """

    def __init__(
        self, engine: RolloutEngine, tool: Tool, call_format: CallFormat, tokenizer, *, max_turns: int, max_workers: int
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"rollout.max_turns={max_turns} is out of range: a tool episode answers >= 1 call")
        self.engine, self.tool, self.format, self.tokenizer = engine, tool, call_format, tokenizer
        self.max_turns, self.max_workers = max_turns, max_workers
        self.holds_weight_copy = getattr(engine, "holds_weight_copy", True)

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> Rollouts:
        started = time.perf_counter()
        prompt_seeds = request_seeds(params, len(prompt_ids), seeds)
        if any(s is None for s in prompt_seeds):
            raise ValueError("tool episodes need seeds: pass one per prompt or set SamplingParams.seed")
        episodes = [_Episode(list(p), s + j) for p, s in zip(prompt_ids, prompt_seeds) for j in range(params.n)]
        turn_params = replace(params, stop=tuple(self.format.stop_strings))
        first = self.engine.generate(prompt_ids, turn_params, seeds=prompt_seeds)
        live = self._read_turn(episodes, first, params.max_new_tokens)
        tool_seconds = 0.0
        while live:
            tool_seconds += self._answer_calls(live, params.max_new_tokens)
            live = [e for e in live if e.finish is None]
            if not live:
                break
            turns = self.engine.generate(
                [e.prompt + e.tokens for e in live],
                replace(turn_params, n=1),
                seeds=[turn_seed(e.seed, e.stats.turns) for e in live],
                max_new_tokens=[params.max_new_tokens - len(e.tokens) for e in live],
            )
            for e in live:
                e.stats = replace(e.stats, turns=e.stats.turns + 1)
            live = self._read_turn(live, turns, params.max_new_tokens)
        seconds = time.perf_counter() - started
        return Rollouts(
            prompt_ids=[e.prompt for e in episodes],
            response_ids=[e.tokens for e in episodes],
            response_logprobs=[e.logprobs for e in episodes],
            texts=[self.tokenizer.decode(e.tokens, skip_special_tokens=True) for e in episodes],
            finish_reasons=[e.finish for e in episodes],
            n=params.n,
            generation_seconds=seconds - tool_seconds,
            tool_seconds=tool_seconds,
            policy_masks=[e.policy_mask for e in episodes],
            episodes=[e.stats for e in episodes],
        )

    def _read_turn(self, episodes: list[_Episode], turn: Rollouts, budget: int) -> list[_Episode]:
        """Append each episode's new turn; end those that answered or ran out of budget. Returns the episodes
        whose turn closed a tool call (each then holds its parsed call in ``pending``)."""
        calling = []
        for episode, ids, logprobs, reason in zip(
            episodes, turn.response_ids, turn.response_logprobs, turn.finish_reasons
        ):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            episode.add(ids, logprobs, text)
            call = self.format.parse(text) if reason == "stop" else None
            if call is None:  # EOS, a stop without a call, or the budget
                episode.finish = "length" if len(episode.tokens) >= budget else "stop"
                episode.stats = replace(episode.stats, ended_by="tokens" if episode.finish == "length" else "answer")
            elif episode.stats.tool_calls >= self.max_turns:
                episode.finish = "turns"
                episode.stats = replace(episode.stats, ended_by="turns")
            elif len(episode.tokens) >= budget:  # a call with no room left for its reply
                episode.finish = "length"
                episode.stats = replace(episode.stats, ended_by="tokens")
            else:
                episode.pending = call
                calling.append(episode)
        return calling

    def _answer_calls(self, calling: list[_Episode], budget: int) -> float:
        """Run every well-formed pending call at once, append each reply; returns the tools' wall time."""
        runnable = [e for e in calling if e.pending.payload is not None]
        started = time.perf_counter()
        results = run_calls(self.tool, [(e.pending.payload, tuple(e.history)) for e in runnable], self.max_workers)
        seconds = time.perf_counter() - started
        by_episode = dict(zip(map(id, runnable), results))
        for episode in calling:
            call, result = episode.pending, by_episode.get(id(episode))
            episode.pending = None
            if result is None:  # malformed: answered with the format's error message
                reply = self.format.error_parts(call.error)
            else:
                reply = self.format.reply_parts(result)
                if result.ok:
                    episode.history.append(call.payload)
            episode.stats = _count_call(episode.stats, result)
            # What the tool says stays text: special-token text in its output is never a real special token.
            reply_ids = encode_reply(self.tokenizer, reply)
            room = budget - len(episode.tokens)
            episode.add(reply_ids[:room], None, self.tokenizer.decode(reply_ids[:room], skip_special_tokens=True))
            if len(reply_ids) >= room:  # no token left for the policy after this reply
                episode.finish = "length"
                episode.stats = replace(episode.stats, ended_by="tokens")
        return seconds


def _count_call(stats: EpisodeStats, result: ToolResult | None) -> EpisodeStats:
    """``stats`` with one more call: malformed (``result`` None), or run with ``result``."""
    if result is None:
        return replace(
            stats,
            tool_calls=stats.tool_calls + 1,
            tool_errors=stats.tool_errors + 1,
            malformed_calls=stats.malformed_calls + 1,
        )
    return replace(
        stats,
        tool_calls=stats.tool_calls + 1,
        tool_errors=stats.tool_errors + (not result.ok),
        tool_timeouts=stats.tool_timeouts + result.timed_out,
        tool_seconds=stats.tool_seconds + result.seconds,
    )
