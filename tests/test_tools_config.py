"""The ``tools`` config group: values checked with the key's name, and settings that would do nothing refused."""

from __future__ import annotations

import pytest

from stare_lightning.tools import ToolsConfig, build_tool, build_tool_from_config


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"name": "shell"}, r"tools.name='shell' is not allowed: choose one of \['none', 'python', 'calculator'\]"),
        ({"name": "python", "format": "xml"}, r"tools.format='xml' is not allowed"),
        ({"name": "python", "timeout_seconds": 0}, r"tools.timeout_seconds=0 is out of range"),
        ({"name": "python", "max_workers": 0}, r"tools.max_workers=0 is out of range"),
        ({"max_workers": 8}, r"tools.max_workers=8 does nothing with tools=none"),
        (
            {"name": "calculator", "timeout_seconds": 9.0},
            r"tools.timeout_seconds=9.0 does nothing with tools=calculator",
        ),
        ({"name": "python", "isolation": "sandbox_fusion"}, r"needs tools.sandbox_fusion_url"),
        (
            {"name": "python", "isolation": "rlimits"},
            r"tools.isolation=rlimits was renamed to tools.isolation=rlimits_unsafe: without bubblewrap the code can "
            r"read the host's files",
        ),
        ({"name": "python", "sandbox_fusion_url": "http://x:1"}, r"does nothing with tools.isolation=bubblewrap"),
        ({"name": "python", "isolation": "sandbox_fusion", "sandbox_fusion_url": "ftp://x"}, r"http:// or https://"),
        (
            {"name": "python", "isolation": "sandbox_fusion", "sandbox_fusion_url": "http://x:1", "cpu_seconds": 9},
            r"tools.cpu_seconds=9 does nothing with tools.isolation=sandbox_fusion",
        ),
    ],
)
def test_bad_or_idle_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        ToolsConfig(**settings)


def test_each_tool_gets_the_settings_that_apply_to_it():
    assert build_tool_from_config(ToolsConfig()) is None
    calculator = build_tool_from_config(ToolsConfig(name="calculator", max_output_chars=64))
    assert calculator.name == "calculator" and calculator.run("2**10").text.strip() == "1024"
    options = ToolsConfig(name="python", isolation="rlimits_unsafe", timeout_seconds=3.0).tool_options()
    assert (
        options["isolation"] == "rlimits_unsafe"
        and options["timeout_seconds"] == 3.0
        and "sandbox_fusion_url" not in options
    )
    with pytest.raises(ValueError, match="tools=none means no tool"):
        build_tool("none")
    with pytest.raises(ValueError, match="unknown tool 'shell'"):
        build_tool("shell")
