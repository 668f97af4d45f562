"""One batch message to the verifier worker, watched from the trainer: item deadlines, progress, checked scores.

``MessageWatch.run`` sends ``items[pos:end]`` as one message, then waits in slices of at most ``poll_s``, reading the
worker's messages (``worker_protocol``, never blocking) and its progress in shared memory (``SharedScores``). Each
item has ``timeout_s`` from the end of the one before (``startup_timeout_s`` while the worker imports the message's
verifiers), and the message as a whole the call's deadline. A worker stuck on an item, dead, or out of budget is
stopped: what it finished is kept, the item it was on scores 0 (a timeout, or an error if it died), and the call
goes on from the next one. Anything a worker that keeps to the protocol never does (a malformed message, a progress
or status out of range, a score that is not a finite number in [0, 1], ``done`` too early, a frame left half-sent)
raises ``Compromised``, and the pool discards what the worker scored in this message.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stare_lightning.rewards import worker_protocol
from stare_lightning.rewards.worker_protocol import FAILED, SCORED, UNSCORED, MalformedMessage, TrainerEnd

__all__ = ["Compromised", "Message", "MessageWatch", "ScoreResult", "SharedScores"]

_MAX_MESSAGES = 20


@dataclass
class ScoreResult:
    """Scores in input order; ``timeouts`` and ``errors`` count the items that scored 0 for those reasons."""

    scores: list[float]
    timeouts: int = 0
    errors: int = 0
    messages: list[str] = field(default_factory=list)  # the first few timeouts / errors, for logs

    def note(self, text: str) -> None:
        """Keep ``text`` among ``messages`` unless there are enough already."""
        if len(self.messages) < _MAX_MESSAGES:
            self.messages.append(text)


class Compromised(Exception):
    """The worker broke the protocol (a malformed message, an impossible value in shared memory)."""


class SharedScores:
    """The shared memory a batch message is scored into (one counter, two arrays), read back checked."""

    def __init__(self, ctx, capacity: int) -> None:
        self.progress = ctx.RawValue("q", 0)  # items finished; -1 while the worker imports the message's verifiers
        self.scores = ctx.RawArray("d", capacity)
        self.status = ctx.RawArray("b", capacity)

    def reset(self, count: int) -> None:
        """Before a message of ``count`` items: nothing imported, nothing scored."""
        self.progress.value = -1
        self.status[:count] = [UNSCORED] * count

    def finished(self, count: int) -> int:
        """The worker's progress through a message of ``count`` items: -1 (importing verifiers) to ``count``."""
        done = self.progress.value
        if not -1 <= done <= count:
            raise Compromised(f"progress {done} outside [-1, {count}]")
        return done

    def read(self, count: int, first: int) -> list[float | None]:
        """The first ``count`` results of the message, a score or None for an item that failed; every value is
        checked before any is returned. ``first`` is the message's first item in the call, for the error text."""
        scores, status = self.scores[:count], self.status[:count]
        for k in range(count):
            if status[k] not in (SCORED, FAILED):
                raise Compromised(f"item {first + k} finished with an unknown status {status[k]}")
            if status[k] == SCORED and not worker_protocol.finite_unit(scores[k]):
                raise Compromised(f"item {first + k} scored {scores[k]!r}")
        return [scores[k] if status[k] == SCORED else None for k in range(count)]


@dataclass
class Message:
    """The items ``items[pos:end]`` of a ``score`` call, sent as one message, and where their results go."""

    items: list
    pos: int
    end: int
    result: ScoreResult
    deadline: float  # the call's, on the monotonic clock
    errors: dict[int, str] = field(default_factory=dict)  # index in the message -> the worker's error text

    @property
    def count(self) -> int:
        return self.end - self.pos


class MessageWatch:
    """Sends messages to the live worker and watches them (see the module docstring); ``stop`` kills the worker."""

    def __init__(
        self, shared: SharedScores, stop: Callable[[], None], timeout_s: float, startup_timeout_s: float, poll_s: float
    ) -> None:
        self.shared, self._stop = shared, stop
        self.timeout_s, self.startup_timeout_s, self.poll_s = timeout_s, startup_timeout_s, poll_s

    def run(self, channel: TrainerEnd, message: Message) -> int:
        """Score ``message``; return the index the call goes on from (``message.end`` once every item is settled;
        earlier when the call's budget ran out, and the caller scores the rest as timeouts)."""
        if not channel.send(message.items[message.pos : message.end], self._send_deadline(message)):
            if time.monotonic() >= message.deadline:
                self._stop()
                return message.pos
            raise Compromised("it did not take its batch")
        seen, since = -1, time.monotonic()
        while True:
            frames, dead = self._receive(channel, message.deadline)
            if self._read(frames, message):
                self._collect(message, message.count)
                return message.end
            done, now = self.shared.finished(message.count), time.monotonic()
            if done != seen:
                seen, since = done, now
            limit = self.startup_timeout_s if done < 0 else self.timeout_s
            if dead or now - since > limit or now >= message.deadline:
                return self._cut(channel, message, dead=dead, over_budget=not dead and now >= message.deadline)

    def _send_deadline(self, message: Message) -> float:
        return min(message.deadline, time.monotonic() + self.startup_timeout_s)

    def _receive(self, channel: TrainerEnd, deadline: float) -> tuple[list[bytes], bool]:
        """The frames that arrived within one slice, and whether the worker's end is closed."""
        try:
            return channel.receive(max(0.0, min(self.poll_s, deadline - time.monotonic()))), False
        except EOFError:
            return [], True
        except MalformedMessage as exc:
            raise Compromised(str(exc)) from None

    def _read(self, frames: list[bytes], message: Message) -> bool:
        """Note the errors the frames report; whether they end with ``done`` (checked against the progress)."""
        for k, frame in enumerate(frames):
            try:
                decoded = worker_protocol.decode(frame, {"error", "done"}, items=message.count)
            except MalformedMessage as exc:
                raise Compromised(str(exc)) from None
            if decoded["kind"] == "error":
                message.errors[decoded["index"]] = decoded["text"]
                continue
            if self.shared.finished(message.count) != message.count or k != len(frames) - 1:
                done = self.shared.progress.value
                raise Compromised(f"'done' after {done} of {message.count} items, or followed by more")
            return True
        return False

    def _collect(self, message: Message, count: int) -> None:
        """Copy the first ``count`` results of ``message`` into its call's result."""
        result = message.result
        for k, score in enumerate(self.shared.read(count, message.pos)):
            index = message.pos + k
            if score is not None:
                result.scores[index] = score
            else:
                result.errors += 1
                detail = message.errors.get(k, "error (details lost with the worker)")
                result.note(f"item {index} ({message.items[index][0]}): {detail}")

    def _cut(self, channel: TrainerEnd, message: Message, *, dead: bool, over_budget: bool) -> int:
        """The worker is stuck on an item, died on it, or the budget ran out: stop it, keep what it finished, and
        settle the item it was on; return the index to go on from."""
        self._stop()
        if channel.partial:  # a frame begun and never finished: a worker that kept its word sends whole ones
            raise Compromised("it stopped in the middle of a message")
        done, result = self.shared.finished(message.count), message.result
        if done < 0:
            if over_budget:
                return message.pos
            result.errors += message.count
            result.note(f"items {message.pos}..{message.end - 1}: the worker could not load their verifiers in time")
            return message.end
        self._collect(message, done)
        index = message.pos + done
        if index >= message.end or over_budget:  # after the last item, stopped before reporting: nothing is lost
            return index
        name = message.items[index][0]
        if dead:
            result.errors += 1
            result.note(f"item {index} ({name}): the worker process died")
        else:
            result.timeouts += 1
            result.note(f"item {index} ({name}): no answer within {self.timeout_s:g} s")
        return index + 1
