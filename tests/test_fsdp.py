"""Sharded training with FSDP2 on two CPU processes (gloo): fit, resume from the distributed checkpoint, export."""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_fit import FAST, read_metrics, run_cli, train_rows

pytestmark = pytest.mark.slow

FSDP = [*FAST, "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true",
        "validation.before_fit=false", "trainer.val_check_interval=100",
        "callbacks.model_checkpoint.every_n_train_steps=2"]


def test_fsdp_fit_resumes_from_its_distributed_checkpoint_and_exports(tmp_path, model_cache):
    run = tmp_path / "run"
    proc = run_cli(["fit", f"output_dir={run}", *FSDP, "trainer.max_steps=2"], model_cache)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    checkpoint = run / "checkpoints" / "last.ckpt"
    assert checkpoint.is_dir(), "ModelParallelStrategy should write a distributed checkpoint directory"

    proc = run_cli(["fit", f"output_dir={run}", *FSDP, "trainer.max_steps=3", f"ckpt_path={checkpoint}"], model_cache)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    steps = train_rows(read_metrics(run))
    assert sorted(steps) == [0, 1, 2], "the resumed run should continue at step 2"
    assert all(math.isfinite(r["train/entropy"]) for r in steps.values())

    export_dir = tmp_path / "hf"
    proc = run_cli(["export", f"output_dir={run}", f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
                    f"export_dir={export_dir}", *FAST], model_cache)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(export_dir)
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    ids = tokenizer("3 5 7 -> 22:", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
