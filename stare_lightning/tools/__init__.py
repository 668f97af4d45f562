"""Tools a policy can call during multi-turn rollouts: a sandboxed Python interpreter and a calculator, the call
formats that read the policy's calls and write the replies, and the ``tools`` config group."""

from stare_lightning.tools.base import Tool, ToolResult, function_schema, run_calls
from stare_lightning.tools.config import ToolsConfig
from stare_lightning.tools.formats import CallFormat, ParsedCall, build_format
from stare_lightning.tools.registry import build_tool, build_tool_from_config

__all__ = [
    "CallFormat",
    "ParsedCall",
    "Tool",
    "ToolResult",
    "ToolsConfig",
    "build_format",
    "build_tool",
    "build_tool_from_config",
    "function_schema",
    "run_calls",
]
