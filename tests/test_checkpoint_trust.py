"""Checkpoints from others are data: crafted files on every reading path run nothing, and say which file is wrong.

Each attack is a real file of the format torch writes (a distributed checkpoint saved by
``torch.distributed.checkpoint``, a Lightning ``meta.pt``, a single-file checkpoint), then tampered with. Each has a
control showing that torch's own permissive reader does run the payload, so a test that passes is not vacuous.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stare_lightning.trainer.checkpoint_trust import (
    DataOnlyLoadPlanner,
    DataOnlyReader,
    UntrustedCheckpointError,
    load_distributed_tensors,
    vet_checkpoint,
)
from tests import forked_cli

# One process, no process group: torch.distributed.checkpoint says so once per call.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class _TouchOnUnpickle:
    """Unpickling this calls ``Path.touch(mark)``: the shape of every pickle exploit, harmless here."""

    def __init__(self, mark: pathlib.Path) -> None:
        self.mark = mark

    def __reduce__(self):
        return pathlib.Path.touch, (self.mark,)


def _save_distributed(directory: pathlib.Path, extra: dict | None = None, module_key: str = "state_dict") -> dict:
    """A distributed checkpoint shaped like Lightning's: the module under "state_dict" (the Trainer's; Fabric's
    "model"), an optimizer, the loop state in meta.pt."""
    weights = {"policy.w": torch.randn(3, 4), "policy.b": torch.arange(5, dtype=torch.bfloat16)}
    state = {
        module_key: weights,
        "optimizer_0": {"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        **(extra or {}),
    }
    dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    torch.save({"hyper_parameters": {"model_dir": "/nowhere"}, "global_step": 3}, directory / "meta.pt")
    return weights


@pytest.mark.parametrize("module_key", ["state_dict", "model"])
def test_a_distributed_checkpoint_reads_back_as_data(tmp_path, module_key):
    weights = _save_distributed(tmp_path / "ckpt", module_key=module_key)
    vet_checkpoint(tmp_path / "ckpt")
    loaded = load_distributed_tensors(tmp_path / "ckpt", prefix=f"{module_key}.")
    assert sorted(loaded) == sorted(weights)
    for name, tensor in weights.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    # Non-tensor entries come back through the data-only planner too, equal to what was saved.
    state = {"optimizer_0": {"param_groups": [{"lr": None, "params": None}], "state": {0: {"step": torch.empty(())}}}}
    dcp.load(state, storage_reader=DataOnlyReader(tmp_path / "ckpt"), planner=DataOnlyLoadPlanner(), no_dist=True)
    assert state["optimizer_0"]["param_groups"][0] == {"lr": 0.1, "params": [0]}
    assert float(state["optimizer_0"]["state"][0]["step"]) == 2.0


def test_a_crafted_index_runs_nothing(tmp_path):
    _save_distributed(tmp_path / "ckpt")
    mark = tmp_path / "ran"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_TouchOnUnpickle(mark)))
    with pytest.raises(UntrustedCheckpointError, match=r"ckpt/\.metadata is not a distributed-checkpoint index"):
        vet_checkpoint(tmp_path / "ckpt")
    with pytest.raises(UntrustedCheckpointError, match=r"\.metadata"):
        load_distributed_tensors(tmp_path / "ckpt", prefix="state_dict.")
    assert not mark.exists()
    with contextlib.suppress(Exception):  # torch's own reader: a plain pickle.load, then it trips on the None
        dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata()
    assert mark.exists()


def test_a_crafted_entry_runs_nothing(tmp_path):
    mark = tmp_path / "ran"
    _save_distributed(tmp_path / "ckpt", extra={"loops": {"hook": _TouchOnUnpickle(mark)}})
    assert not mark.exists()
    with pytest.raises(UntrustedCheckpointError, match=r"holds entry 'loops\.hook' that is not plain data"):
        vet_checkpoint(tmp_path / "ckpt")
    with pytest.raises(dcp.CheckpointException, match="UntrustedCheckpointError: entry 'loops.hook' is not plain data"):
        dcp.load(
            {"loops": {"hook": None}},
            storage_reader=DataOnlyReader(tmp_path / "ckpt"),
            planner=DataOnlyLoadPlanner(),
            no_dist=True,
        )
    assert not mark.exists()
    # torch's default planner unpickles entries with weights_only=False: the payload runs.
    with contextlib.suppress(Exception):
        dcp.load({"loops": {"hook": None}}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert mark.exists()


def test_a_crafted_lightning_meta_file_runs_nothing(tmp_path):
    _save_distributed(tmp_path / "ckpt")
    mark = tmp_path / "ran"
    torch.save({"hyper_parameters": {}, "callbacks": _TouchOnUnpickle(mark)}, tmp_path / "ckpt" / "meta.pt")
    with pytest.raises(UntrustedCheckpointError, match=r"ckpt/meta\.pt holds objects other than tensors"):
        vet_checkpoint(tmp_path / "ckpt")
    assert not mark.exists()


def test_an_index_pointing_outside_the_directory_is_refused(tmp_path):
    _save_distributed(tmp_path / "ckpt")
    index = tmp_path / "ckpt" / ".metadata"
    metadata = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "../secret.distcp"
    index.write_bytes(pickle.dumps(metadata))
    with pytest.raises(UntrustedCheckpointError, match=r"at '\.\./secret\.distcp', outside the checkpoint directory"):
        vet_checkpoint(tmp_path / "ckpt")


def test_a_single_file_checkpoint_runs_nothing_on_resume(tmp_path):
    """The single-file path Lightning resumes through (the project's checkpoint IO) refuses the same payload."""
    from stare_lightning.trainer import SafeCheckpointIO

    mark = tmp_path / "ran"
    torch.save({"state_dict": {}, "loops": _TouchOnUnpickle(mark)}, tmp_path / "last.ckpt")
    with pytest.raises(UntrustedCheckpointError, match=r"last\.ckpt holds objects other than tensors"):
        SafeCheckpointIO().load_checkpoint(tmp_path / "last.ckpt", weights_only=False)  # the caller's False is ignored
    with pytest.raises(UntrustedCheckpointError, match=r"last\.ckpt holds objects other than tensors"):
        vet_checkpoint(tmp_path / "last.ckpt")
    assert not mark.exists()


@pytest.mark.parametrize("subcommand", ["export", "evaluate", "validate", "fit"])
def test_every_subcommand_refuses_a_crafted_checkpoint_before_it_starts(tmp_path, subcommand):
    """Through the real command line: one line naming the file, nothing run, nothing written."""
    _save_distributed(tmp_path / "ckpt")
    mark = tmp_path / "ran"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_TouchOnUnpickle(mark)))
    run_dir = tmp_path / "run"
    args = [
        subcommand,
        f"ckpt_path={tmp_path / 'ckpt'}",
        f"output_dir={run_dir}",
        f"hydra.run.dir={run_dir / 'hydra'}",
        f"export_dir={tmp_path / 'hf'}",
        f"model.cache_dir={tmp_path / 'cache'}",
    ]
    env = {**os.environ, "STARE_LIGHTNING_CACHE": str(tmp_path / "cache")}
    proc = forked_cli.run(args, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode != 0
    assert ".metadata is not a distributed-checkpoint index" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not mark.exists()
    assert not (tmp_path / "hf").exists() and not (tmp_path / "cache").exists()
