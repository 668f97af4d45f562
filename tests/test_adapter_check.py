"""The checks a server's adapter route makes before the engine loads an adapter
(``rollout/server/in_vllm/adapter_check.py``), without a server: each refusal beside the accepted directory it was
made from (the control), and the copy the engine loads holding exactly the bytes that were checked."""

from __future__ import annotations

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

CONFIG, WEIGHTS = ADAPTER_FILES


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
        request = json.loads(rewritten_load(body, adapters))
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
