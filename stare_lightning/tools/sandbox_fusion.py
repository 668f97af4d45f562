"""The ``python`` tool on a SandboxFusion service (``tools.isolation=sandbox_fusion``): calls are POSTed over HTTP.

Request ``POST {url}/run_code`` with ``{"code", "language": "python", "run_timeout", "memory_limit_MB"}``; the
answer's ``status`` is ``Success``, ``Failed`` or ``SandboxError`` and its ``run_result`` holds ``status``
(``Finished``, ``TimeLimitExceeded``, ``Error``), ``stdout``, ``stderr``, ``return_code`` and ``execution_time``
(the fields of bytedance/SandboxFusion's ``RunCodeResponse``). The code sent is the same replay program as the local
sandbox's (``sandbox_program.replay_program``), so state across calls works the same way. The model reads stdout,
then stderr (the service returns them apart, so their interleaving is lost).

Only the standard library (``urllib``), with a time-out of ``timeout_seconds`` plus ``HTTP_SLACK_SECONDS``;
connections go direct (proxy variables are ignored: the service is expected next to the trainer). Nothing is
raised: an unreachable service, an HTTP error or an unreadable answer is a failed result saying so.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from stare_lightning.tools.base import ToolResult, compose_text
from stare_lightning.tools.sandbox_program import PythonToolSpec, replay_program

__all__ = ["HTTP_SLACK_SECONDS", "SandboxFusion"]

HTTP_SLACK_SECONDS = 10.0  # the service's own start-up and queueing, on top of the run time-out
MAX_ANSWER_BYTES = 8 * 1024 * 1024


class SandboxFusion(PythonToolSpec):
    """The ``python`` tool answered by a SandboxFusion-compatible service at ``url``."""

    def __init__(
        self,
        url: str,
        *,
        persist_state: bool = True,
        timeout_seconds: float = 5.0,
        memory_mb: int = 1024,
        max_output_chars: int = 1024,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"sandbox_fusion_url={url!r} is not allowed: must be an http:// or https:// URL")
        self.url, self.persist_state = url.rstrip("/"), persist_state
        self.timeout_seconds, self.memory_mb = float(timeout_seconds), memory_mb
        self.max_output_chars = max_output_chars
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def run(self, call: str, *, history: Sequence[str] = ()) -> ToolResult:
        started = time.perf_counter()
        body = {
            "code": replay_program(call, history if self.persist_state else ()),
            "language": "python",
            "run_timeout": self.timeout_seconds,
            "memory_limit_MB": self.memory_mb,
        }
        answer, failure = self._post(body)
        seconds = time.perf_counter() - started
        if failure is not None:
            return ToolResult(text=compose_text("", failure, self.max_output_chars), ok=False, seconds=seconds)
        return self._result(answer, seconds)

    def _post(self, body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """The service's JSON answer, or a message saying why there is none."""
        request = urllib.request.Request(
            f"{self.url}/run_code",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        try:
            with self._opener.open(request, timeout=self.timeout_seconds + HTTP_SLACK_SECONDS) as response:
                raw = response.read(MAX_ANSWER_BYTES + 1)
        except urllib.error.HTTPError as err:
            return {}, f"SandboxError: the sandbox service answered HTTP {err.code} {err.reason}"
        except (urllib.error.URLError, OSError, ValueError) as err:  # refused, unreachable, timed out, bad URL
            reason = getattr(err, "reason", None) or err
            return {}, f"SandboxError: the sandbox service at {self.url} could not be reached ({reason})"
        if len(raw) > MAX_ANSWER_BYTES:
            return {}, f"SandboxError: the sandbox service's answer is over {MAX_ANSWER_BYTES} bytes"
        try:
            answer = json.loads(raw)
        except ValueError:
            return {}, "SandboxError: the sandbox service's answer is not JSON"
        if not isinstance(answer, dict):
            return {}, "SandboxError: the sandbox service's answer is not a JSON object"
        return answer, None

    def _result(self, answer: dict[str, Any], seconds: float) -> ToolResult:
        run = answer.get("run_result") if isinstance(answer.get("run_result"), dict) else None
        if answer.get("status") == "SandboxError" or run is None:
            message = answer.get("message") or "no run result"
            return ToolResult(
                text=compose_text("", f"SandboxError: {message}", self.max_output_chars), ok=False, seconds=seconds
            )
        output = f"{run.get('stdout') or ''}{run.get('stderr') or ''}"
        timed_out = run.get("status") == "TimeLimitExceeded"
        note = None
        if timed_out:
            note = f"TimeoutError: the call exceeded {self.timeout_seconds:g} s and was stopped"
        elif run.get("status") not in (None, "Finished"):
            note = f"SandboxError: the run ended with status {run.get('status')}"
        ok = answer.get("status") == "Success" and run.get("return_code") == 0 and note is None
        if not ok and note is None and not output.strip():
            note = f"the process exited with status {run.get('return_code')}"
        text = compose_text(output, note, self.max_output_chars)
        return ToolResult(text=text, ok=ok, seconds=seconds, timed_out=timed_out)

    def close(self) -> None:
        pass
