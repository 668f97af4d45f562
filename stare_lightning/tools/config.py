"""``ToolsConfig``: the typed ``tools`` config group (which tool the policy may call, and its sandbox), checked in
``__post_init__``; ``conf/tools/{none,python,calculator}.yaml`` choose the tool.

A setting that would do nothing is refused rather than ignored, naming the key and why: any setting but ``name``
with ``tools=none``, the sandbox's settings with ``tools=calculator``, the local sandbox's limits with
``isolation=sandbox_fusion`` (the service sets its own), and a ``sandbox_fusion_url`` without that isolation.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from stare_lightning.config.checks import choice, flag, number, text
from stare_lightning.tools.formats import FORMATS

__all__ = ["ISOLATIONS", "TOOL_NAMES", "ToolsConfig"]

TOOL_NAMES = ("none", "python", "calculator")
ISOLATIONS = ("bubblewrap", "rlimits_unsafe", "sandbox_fusion")
# The python tool's sandbox: meaningless with the calculator.
PYTHON_KEYS = (
    "isolation",
    "sandbox_fusion_url",
    "persist_state",
    "timeout_seconds",
    "cpu_seconds",
    "memory_mb",
    "file_size_mb",
    "max_processes",
)
LOCAL_SANDBOX_KEYS = ("cpu_seconds", "file_size_mb", "max_processes")  # not sent to a SandboxFusion service


@dataclass
class ToolsConfig:
    name: str = "none"
    """The tool the policy may call mid-rollout; `none`: single-turn."""
    format: str = "code_block"
    """Call format: `code_block` (`<code>`, ReTool's) or `json` (`<tool_call>`, Qwen2.5/Hermes)."""
    isolation: str = "bubblewrap"
    """The python tool's sandbox: bubblewrap, rlimits_unsafe (weaker) or a SandboxFusion service."""
    sandbox_fusion_url: str | None = None
    """The SandboxFusion service's address (with `isolation=sandbox_fusion`)."""
    persist_state: bool = True
    """python: each call first replays the episode's earlier successful calls."""
    timeout_seconds: float = 5.0
    """Wall time of one call."""
    cpu_seconds: int = 5
    """CPU seconds of each process of a call."""
    memory_mb: int = 1024
    """Address space per process, and the call's total where cgroups are writable."""
    file_size_mb: int = 16
    """Largest file a call writes (its scratch space is 4x this)."""
    max_processes: int = 16
    """Processes and threads of one call."""
    max_output_chars: int = 1024
    """What the model reads of one call's output."""
    max_workers: int = 4
    """Calls run at once."""

    def __post_init__(self) -> None:
        p = "tools."
        choice(f"{p}name", self.name, TOOL_NAMES)
        choice(f"{p}format", self.format, FORMATS)
        if self.isolation == "rlimits":
            raise ValueError(
                "tools.isolation=rlimits was renamed to tools.isolation=rlimits_unsafe: without bubblewrap the code "
                "can read the host's files outside the home directories and checkout (data and outputs included), "
                "and where the trainer is not root and user namespaces are refused it also reaches the network, the "
                "host's processes and /tmp; choose tools.isolation=rlimits_unsafe to accept that, or bubblewrap"
            )
        choice(f"{p}isolation", self.isolation, ISOLATIONS)
        if self.sandbox_fusion_url is not None:
            text(f"{p}sandbox_fusion_url", self.sandbox_fusion_url)
            if not self.sandbox_fusion_url.startswith(("http://", "https://")):
                raise ValueError(
                    f"{p}sandbox_fusion_url={self.sandbox_fusion_url!r} is not allowed: must be an http:// or "
                    "https:// URL, e.g. http://sandbox:8080"
                )
        flag(f"{p}persist_state", self.persist_state)
        number(f"{p}timeout_seconds", self.timeout_seconds, low=0.0, low_open=True)
        for key in ("cpu_seconds", "memory_mb", "file_size_mb", "max_processes", "max_output_chars", "max_workers"):
            number(f"{p}{key}", getattr(self, key), low=1, integer=True)
        self._refuse_settings_that_do_nothing()

    def _changed(self, keys: tuple[str, ...]) -> list[str]:
        defaults = {f.name: f.default for f in fields(self)}
        return [key for key in keys if getattr(self, key) != defaults[key]]

    def _refuse_settings_that_do_nothing(self) -> None:
        if self.name == "none":
            keys = tuple(f.name for f in fields(self) if f.name != "name")
            for key in self._changed(keys):
                raise ValueError(
                    f"tools.{key}={getattr(self, key)!r} does nothing with tools=none (no tool is called): remove "
                    "it, or choose a tool, e.g. tools=python or tools=calculator"
                )
        if self.name == "calculator":
            for key in self._changed(PYTHON_KEYS):
                raise ValueError(
                    f"tools.{key}={getattr(self, key)!r} does nothing with tools=calculator: it configures the "
                    "python tool's sandbox (the calculator runs in-process, bounded by construction); remove it"
                )
        if self.isolation == "sandbox_fusion":
            if self.sandbox_fusion_url is None:
                raise ValueError(
                    "tools.isolation=sandbox_fusion needs tools.sandbox_fusion_url, the service's address, "
                    "e.g. tools.sandbox_fusion_url=http://sandbox:8080"
                )
            for key in self._changed(LOCAL_SANDBOX_KEYS):
                raise ValueError(
                    f"tools.{key}={getattr(self, key)!r} does nothing with tools.isolation=sandbox_fusion: the "
                    "service applies its own limits (only timeout_seconds and memory_mb are sent); remove it"
                )
        elif self.sandbox_fusion_url is not None:
            raise ValueError(
                f"tools.sandbox_fusion_url={self.sandbox_fusion_url!r} does nothing with "
                f"tools.isolation={self.isolation}: set tools.isolation=sandbox_fusion to use the service, or remove it"
            )

    def tool_options(self) -> dict[str, object]:
        """The keyword arguments of ``build_tool(self.name, ...)``: the settings that apply to this tool."""
        if self.name == "calculator":
            return {"max_output_chars": self.max_output_chars}
        keys = ["isolation", "persist_state", "timeout_seconds", "memory_mb", "max_output_chars"]
        if self.isolation == "sandbox_fusion":
            keys.append("sandbox_fusion_url")
        else:
            keys += list(LOCAL_SANDBOX_KEYS)
        return {key: getattr(self, key) for key in keys}
