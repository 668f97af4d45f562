"""The checks a server's adapter route makes before the engine loads an adapter
(``rollout/server/in_vllm/adapter_check.py``), without a server: each refusal beside the accepted directory it was
made from (the control), the same for an adapter sent inside its request (``shared/adapter_wire.py``), and the copy
the engine loads holding exactly the bytes that were checked."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stare_lightning.rollout.server.in_vllm.adapter_check import (
    ADAPTER_FILES,
    AdapterRefused,
    CheckedAdapters,
    checked_adapter_files,
    rewritten_load,
)
from stare_lightning.rollout.server.shared.adapter_wire import inline_load_request

CONFIG, WEIGHTS = ADAPTER_FILES
TOKEN = "the-servers-secret-" + "s" * 24


def _adapter(folder: Path, value: float = 0.5) -> Path:
    folder.mkdir(mode=0o700)
    (folder / CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    tensors = {"base_model.model.layer.lora_A.weight": torch.full((4, 8), value)}
    save_file(tensors, str(folder / WEIGHTS))
    return folder


def _spoil_mode(folder: Path) -> None:
    folder.chmod(0o770)


def _spoil_config(folder: Path) -> None:
    (folder / CONFIG).write_text("[1, 2]")


def _spoil_with_fifo(folder: Path) -> None:
    (folder / WEIGHTS).unlink()
    os.mkfifo(folder / WEIGHTS)  # opening it for reading would block without O_NONBLOCK


def _spoil_with_link(folder: Path) -> None:
    (folder / CONFIG).rename(folder.parent / "config-elsewhere")
    (folder / CONFIG).symlink_to(folder.parent / "config-elsewhere")


def _spoil_with_directory(folder: Path) -> None:
    (folder / CONFIG).unlink()
    (folder / CONFIG).mkdir()


def _spoil_with_inf(folder: Path) -> None:
    save_file({"base_model.model.layer.lora_B.weight": torch.tensor([1.0, float("inf")])}, str(folder / WEIGHTS))


@pytest.mark.parametrize(
    ("spoil", "refusal"),
    [
        (_spoil_mode, "is writable by other users \\(mode 0770\\)"),
        (_spoil_config, "adapter_config.json is not a JSON object"),
        (_spoil_with_fifo, "is not a regular file"),
        (_spoil_with_link, "adapter_config.json in .* cannot be opened as a file"),
        (_spoil_with_directory, "adapter_config.json in .* is not a regular file"),
        (_spoil_with_inf, "lora_B.weight' holds 1 non-finite values"),
    ],
)
def test_each_check_refuses_what_it_names_and_passes_the_adapter_it_was_made_from(tmp_path, spoil, refusal):
    good = _adapter(tmp_path / "good")
    assert set(checked_adapter_files(str(good))) == set(ADAPTER_FILES)  # the control
    spoiled = _adapter(tmp_path / "spoiled")
    spoil(spoiled)
    with pytest.raises(AdapterRefused, match=refusal):
        checked_adapter_files(str(spoiled))


def test_a_relative_path_and_a_link_at_the_directory_are_refused(tmp_path):
    good = _adapter(tmp_path / "good")
    (tmp_path / "link").symlink_to(good)
    with pytest.raises(AdapterRefused, match="cannot be opened as a directory"):
        checked_adapter_files(str(tmp_path / "link"))
    with pytest.raises(AdapterRefused, match="must be an absolute path"):
        checked_adapter_files("good")


def test_the_engine_loads_a_private_copy_of_the_checked_bytes_kept_while_it_serves_it(tmp_path):
    good = _adapter(tmp_path / "good")
    adapters = CheckedAdapters()

    def load(name: str) -> Path:
        body = json.dumps({"lora_name": name, "lora_path": str(good), "load_inplace": False}).encode()
        request = json.loads(rewritten_load(body, adapters, TOKEN))
        assert request["lora_name"] == name and request["load_inplace"] is False
        return Path(request["lora_path"])

    try:
        copy = load("v1")
        assert copy != good and copy.stat().st_mode & 0o777 == copy.parent.stat().st_mode & 0o777 == 0o700
        assert {name: (copy / name).read_bytes() for name in ADAPTER_FILES} == {
            name: (good / name).read_bytes() for name in ADAPTER_FILES
        }
        adapters.settle("v1", loaded=True)
        # What changes in the trainer's directory afterwards changes nothing in what the engine loads.
        _spoil_with_inf(good)
        assert (copy / WEIGHTS).read_bytes() != (good / WEIGHTS).read_bytes()
        # A load of the same name the engine refuses leaves the served copy; an unload removes it.
        _adapter(tmp_path / "again").rename(tmp_path / "swap")
        good = tmp_path / "swap"
        refused = load("v1")
        adapters.settle("v1", loaded=False)
        assert copy.exists() and not refused.exists()
        adapters.forget("v1")
        assert not copy.exists()
    finally:
        if adapters._directory is not None:
            adapters._directory.remove()


def _files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in ADAPTER_FILES}


def _signed_by_another(request: dict) -> None:
    request["digest"] = inline_load_request(request["lora_name"], _decoded(request), "another-secret-" + "x" * 24)[
        "digest"
    ]


def _decoded(request: dict) -> dict[str, bytes]:
    return {name: base64.b64decode(text) for name, text in request["lora_files"].items()}


def _bytes_changed_on_the_way(request: dict) -> None:
    files = _decoded(request)
    files[WEIGHTS] = files[WEIGHTS].replace(b"\x00\x00\x00?", b"\x00\x00\x80?")  # 0.5 -> 1.0, same length
    request["lora_files"] = {name: base64.b64encode(data).decode() for name, data in files.items()}


def _renamed_on_the_way(request: dict) -> None:
    request["lora_name"] = "another-name"


def _a_third_file(request: dict) -> None:
    request["lora_files"]["tokenizer.json"] = base64.b64encode(b"{}").decode()


def _not_base64(request: dict) -> None:
    request["lora_files"][CONFIG] = "not base64!"


def _a_path_as_well(request: dict) -> None:
    request["lora_path"] = "/elsewhere"


@pytest.mark.parametrize(
    ("spoil", "refusal"),
    [
        (_signed_by_another, "digest does not match its files"),
        (_bytes_changed_on_the_way, "digest does not match its files"),
        (_renamed_on_the_way, "digest does not match its files"),
        (_a_third_file, "lora_files has .*'tokenizer.json'.*; expected exactly"),
        (_not_base64, "lora_files\\['adapter_config.json'\\] is not base64"),
        (_a_path_as_well, "exactly one of lora_path and lora_files"),
    ],
)
def test_an_adapter_sent_inside_its_request_is_refused_unless_signed_with_the_secret(tmp_path, spoil, refusal):
    good = _files(_adapter(tmp_path / "good"))
    adapters = CheckedAdapters()
    try:
        control = json.loads(
            rewritten_load(json.dumps(inline_load_request("v1", good, TOKEN)).encode(), adapters, TOKEN)
        )
        assert set(control) == {"lora_name", "lora_path"} and _files(Path(control["lora_path"])) == good
        adapters.settle("v1", loaded=True)
        request = inline_load_request("v2", good, TOKEN)
        spoil(request)
        with pytest.raises(AdapterRefused, match=refusal):
            rewritten_load(json.dumps(request).encode(), adapters, TOKEN)
        assert adapters._directory.names() == [Path(control["lora_path"]).name]  # nothing copied for the refusal
    finally:
        if adapters._directory is not None:
            adapters._directory.remove()


def test_an_adapter_sent_inside_its_request_gets_the_checks_of_one_read_from_a_directory(tmp_path):
    spoiled = _adapter(tmp_path / "spoiled")
    _spoil_with_inf(spoiled)
    request = inline_load_request("v1", _files(spoiled), TOKEN)  # signed: the values, not the digest, are wrong
    with pytest.raises(AdapterRefused, match="the adapter sent as 'v1'.*lora_B.weight' holds 1 non-finite values"):
        rewritten_load(json.dumps(request).encode(), CheckedAdapters(), TOKEN)
