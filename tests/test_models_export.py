"""export: a checkpoint is loaded as data only, so a hostile one cannot run code when it is unpickled."""

from __future__ import annotations

import pathlib

import pytest
import torch

from stare_lightning.models.export import export_checkpoint


class _TouchOnUnpickle:
    """Unpickling this calls ``Path.touch(mark)``: the shape of every pickle exploit, harmless here."""

    def __init__(self, mark: pathlib.Path) -> None:
        self.mark = mark

    def __reduce__(self):
        return pathlib.Path.touch, (self.mark,)


def test_a_checkpoint_that_would_run_code_is_refused_before_anything_runs(tmp_path):
    mark = tmp_path / "ran"
    checkpoint = {"state_dict": {"policy.w": torch.zeros(2)}, "hyper_parameters": {"model_dir": str(tmp_path)}}
    torch.save({**checkpoint, "callbacks": _TouchOnUnpickle(mark)}, tmp_path / "hostile.ckpt")
    with pytest.raises(ValueError, match=r"hostile\.ckpt holds objects other than tensors.*weights_only=True"):
        export_checkpoint(tmp_path / "hostile.ckpt", tmp_path / "hf")
    assert not mark.exists() and not (tmp_path / "hf").exists()
    # The same pickle loaded the permissive way runs the code: the test above would notice a regression.
    torch.load(tmp_path / "hostile.ckpt", weights_only=False)
    assert mark.exists()
