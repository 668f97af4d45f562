"""Building a tool by name (``build_tool``) or from the ``tools`` config group (``build_tool_from_config``)."""

from __future__ import annotations

from typing import Any

from stare_lightning.tools.base import Tool
from stare_lightning.tools.calculator import Calculator
from stare_lightning.tools.config import ToolsConfig
from stare_lightning.tools.python_sandbox import PythonSandbox
from stare_lightning.tools.sandbox_fusion import SandboxFusion

__all__ = ["TOOLS", "build_tool", "build_tool_from_config"]

TOOLS = ("python", "calculator")


def build_tool(name: str, **options: Any) -> Tool:
    """The tool ``name`` with ``options`` (its constructor's keyword arguments).

    ``python`` runs in the local sandbox (``isolation`` bubblewrap or rlimits_unsafe) or, with
    ``isolation="sandbox_fusion"`` and ``sandbox_fusion_url``, on a SandboxFusion service. Building the local
    sandbox runs a trivial call, so a missing or broken bubblewrap fails here with how to fix it."""
    if name == "none":
        raise ValueError("tools=none means no tool: there is nothing to build (build_tool_from_config returns None)")
    if name == "calculator":
        return Calculator(**options)
    if name == "python":
        if options.get("isolation") == "sandbox_fusion":
            options.pop("isolation")
            return SandboxFusion(options.pop("sandbox_fusion_url", None), **options)
        if options.pop("sandbox_fusion_url", None) is not None:
            raise ValueError("sandbox_fusion_url is only used with isolation='sandbox_fusion'")
        return PythonSandbox(**options)
    raise ValueError(f"unknown tool {name!r}: choose one of {list(TOOLS)} (or tools=none for no tool)")


def build_tool_from_config(cfg: ToolsConfig) -> Tool | None:
    """The tool ``cfg`` names, built (its sandbox checked); None for ``tools=none``."""
    if cfg.name == "none":
        return None
    return build_tool(cfg.name, **cfg.tool_options())
