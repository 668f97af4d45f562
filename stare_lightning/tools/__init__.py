"""Tools a policy can call during multi-turn rollouts: a sandboxed Python interpreter and a calculator, the call
formats that read the policy's calls and write the replies, and the ``tools`` config group."""

from stare_lightning.lazy_exports import lazy_exports

_EXPORTS = {
    "Tool": "stare_lightning.tools.base",
    "ToolResult": "stare_lightning.tools.base",
    "function_schema": "stare_lightning.tools.base",
    "run_calls": "stare_lightning.tools.base",
    "ToolsConfig": "stare_lightning.tools.config",
    "CallFormat": "stare_lightning.tools.formats",
    "ParsedCall": "stare_lightning.tools.formats",
    "build_format": "stare_lightning.tools.formats",
    "build_tool": "stare_lightning.tools.registry",
    "build_tool_from_config": "stare_lightning.tools.registry",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
