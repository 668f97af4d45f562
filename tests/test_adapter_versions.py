"""``AdapterVersions`` (rollout/adapter_versions.py): the adapter lifecycle both engines share, on real files.

The engine is its two callables, ``load`` and ``unload``, each recording what it was handed and what lay on disk at
that moment; everything else (the transfer directory, the peft files, the kept window) is the real code. The engines
themselves serve these files in tests/test_lora_sync.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from stare_lightning.models.lora import PEFT_PREFIX
from stare_lightning.rollout.adapter_versions import AdapterVersions
from stare_lightning.rollout.adapters import CONFIG_FILE, WEIGHTS_FILE, AdapterSync
from stare_lightning.rollout.transfer_dir import UnsafeTransferDirectory

RANK = 2
LAYER = f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj"


def _weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        f"{LAYER}.lora_A.weight": torch.randn(RANK, 8, generator=generator),
        f"{LAYER}.lora_B.weight": torch.randn(8, RANK, generator=generator),
    }


class Recorder:
    """The engine's two callables: each call is kept with whether the version's files existed when it came."""

    def __init__(self, fail_on: set[str] = frozenset()) -> None:
        self.calls: list[tuple[str, str, int, bool]] = []
        self.fail_on = fail_on

    def load(self, version) -> None:
        self.calls.append(("load", version.name, version.serial, version.path.is_dir()))
        if version.name in self.fail_on:
            raise RuntimeError(f"the engine refused {version.name}")

    def unload(self, version) -> None:
        self.calls.append(("unload", version.name, version.serial, version.path.is_dir()))


def _versions(tmp_path, recorder: Recorder, keep: int = 2, prefix: str = "policy") -> AdapterVersions:
    sync = AdapterSync(rank=RANK, alpha=4.0, target_modules=("q_proj",), versions=keep, max_lora_rank=8)
    under = tmp_path / "transfer"
    under.mkdir(mode=0o700)
    return AdapterVersions(sync, load=recorder.load, unload=recorder.unload, prefix=prefix, under=under)


def test_each_version_is_written_loaded_then_the_one_out_of_the_window_unloaded_before_its_files_go(tmp_path):
    recorder = Recorder()
    versions = _versions(tmp_path, recorder, keep=2)
    assert versions.current is None and versions.names == []
    added = [versions.add(_weights(seed).items()) for seed in range(4)]
    assert [v.name for v in added] == ["policy-v1", "policy-v2", "policy-v3", "policy-v4"]
    assert [v.serial for v in added] == [1, 2, 3, 4]
    # Every load saw its files; the evicted version was unloaded while its files were still there, after the newer
    # version was loaded (so a request always has a loaded version to name).
    assert recorder.calls == [
        ("load", "policy-v1", 1, True),
        ("load", "policy-v2", 2, True),
        ("load", "policy-v3", 3, True),
        ("unload", "policy-v1", 1, True),
        ("load", "policy-v4", 4, True),
        ("unload", "policy-v2", 2, True),
    ]
    assert versions.names == ["policy-v3", "policy-v4"] and versions.current == added[-1]
    assert versions.directory().names() == ["policy-v3", "policy-v4"]
    assert not added[0].path.exists() and not added[1].path.exists()
    # The files are peft's adapter as written: the tensors back bit for bit, the config's rank and alpha.
    newest = added[-1]
    loaded = load_file(newest.path / WEIGHTS_FILE)
    assert loaded.keys() == _weights(3).keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in _weights(3).items())
    config = json.loads((newest.path / CONFIG_FILE).read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (RANK, 4.0, ["q_proj"])
    assert newest.bytes == sum(t.numel() * t.element_size() for t in _weights(3).values()) == 4 * 2 * RANK * 8
    path = versions.directory().path
    versions.close()
    assert not path.exists()


def test_labels_name_versions_under_the_runs_prefix(tmp_path):
    recorder = Recorder()
    versions = _versions(tmp_path, recorder, keep=1, prefix="run1a2b")
    assert versions.name_of("push-7") == "run1a2b-push-7"
    version = versions.add(_weights(0).items(), "push-7")
    assert (version.name, version.serial) == ("run1a2b-push-7", 1)
    assert versions.directory().names() == ["run1a2b-push-7"]
    versions.close()


def test_a_version_the_engine_refuses_leaves_no_files_and_the_served_ones_as_they_were(tmp_path):
    recorder = Recorder(fail_on={"policy-v2"})
    versions = _versions(tmp_path, recorder, keep=1)
    versions.add(_weights(0).items())
    with pytest.raises(RuntimeError, match="refused policy-v2"):
        versions.add(_weights(1).items())
    assert versions.names == ["policy-v1"] and versions.directory().names() == ["policy-v1"]
    assert ("unload", "policy-v1", 1, True) not in recorder.calls
    # Control: the next version loads, and the window moves on from the version still served.
    versions.add(_weights(2).items())
    assert versions.names == ["policy-v3"] and versions.directory().names() == ["policy-v3"]
    assert recorder.calls[-1] == ("unload", "policy-v1", 1, True)
    versions.close()


def test_a_replaced_transfer_directory_stops_the_sync_before_anything_is_written_or_loaded(tmp_path):
    recorder = Recorder()
    versions = _versions(tmp_path, recorder)
    versions.add(_weights(0).items())  # control: in place, the sync goes through
    directory = versions.directory()
    directory.path.rename(directory.path.with_name("moved"))
    directory.path.mkdir(mode=0o700)  # a look-alike under the same name
    with pytest.raises(UnsafeTransferDirectory, match="was replaced"):
        versions.add(_weights(1).items())
    assert [call[0:2] for call in recorder.calls] == [("load", "policy-v1")]
    assert list(directory.path.iterdir()) == []
    versions.close()
