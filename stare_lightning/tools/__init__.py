"""Tools a policy can call during multi-turn rollouts: a sandboxed Python interpreter and a calculator, the call
formats that read the policy's calls and write the replies, and the ``tools`` config group."""

from stare_lightning.lazy_exports import lazy_exports

_EXPORTS = {
    ".base": ("Tool", "ToolResult", "function_schema", "run_calls"),
    ".config": ("ToolsConfig",),
    ".formats": ("CallFormat", "ParsedCall", "build_format"),
    ".registry": ("build_tool", "build_tool_from_config"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
