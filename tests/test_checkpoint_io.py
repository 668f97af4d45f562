"""A checkpoint write that runs out of space fails clearly and leaves the previous checkpoint intact."""

import subprocess
import sys
import textwrap

import torch

SCRIPT = textwrap.dedent(
    """
    import resource, signal, sys, torch
    from stare_lightning.trainer import CheckpointWriteError, SafeCheckpointIO

    path = sys.argv[1]
    io = SafeCheckpointIO()
    io.save_checkpoint({"step": 1, "weights": torch.zeros(10)}, path)
    # From here on no file of this process may grow past 64 KiB: a real write failure, like a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
    try:
        io.save_checkpoint({"step": 2, "weights": torch.zeros(1_000_000)}, path)
    except CheckpointWriteError as error:
        print("ERROR:", error)
        sys.exit(3)
    sys.exit(0)
    """
)


def test_failed_write_is_reported_and_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert str(path) in proc.stdout and "previous file" in proc.stdout and "unchanged" in proc.stdout
    kept = torch.load(path, weights_only=False)
    assert kept["step"] == 1 and kept["weights"].numel() == 10
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"], "a partial temporary file was left behind"


def test_trainer_uses_the_safe_checkpoint_io(tmp_path):
    # The plugin comes from conf/trainer/cpu.yaml (so also gpu and ddp, which inherit it); fsdp sets none.
    from stare_lightning.cli import compose, prepare_config
    from stare_lightning.train import build_trainer
    from stare_lightning.trainer import SafeCheckpointIO

    cfg = compose([f"output_dir={tmp_path}", "callbacks=minimal", "logger=[csv]"])
    trainer = build_trainer(prepare_config(cfg)[1])
    assert isinstance(trainer.strategy.checkpoint_io, SafeCheckpointIO)
    for option in ("gpu", "ddp"):
        assert prepare_config(compose([f"output_dir={tmp_path}", f"trainer={option}"]))[1].trainer["plugins"] == [
            {"_target_": "stare_lightning.trainer.SafeCheckpointIO"}
        ]
    assert prepare_config(compose([f"output_dir={tmp_path}", "trainer=fsdp"]))[1].trainer["plugins"] is None


def test_csv_logger_appends_to_an_earlier_runs_metrics(tmp_path):
    from stare_lightning.trainer import ResumableCSVLogger

    first = ResumableCSVLogger(tmp_path, name="logs", version="")
    first.log_metrics({"train/entropy": 0.5}, step=0)
    first.log_metrics({"train/entropy": 0.4}, step=1)
    first.finalize("success")
    resumed = ResumableCSVLogger(tmp_path, name="logs", version="")  # the same directory, as after a resume
    resumed.log_metrics({"train/entropy": 0.3, "train/new_metric": 1.0}, step=2)
    resumed.finalize("success")
    import csv

    rows = list(csv.DictReader(open(tmp_path / "logs" / "metrics.csv")))
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert [r["train/entropy"] for r in rows] == ["0.5", "0.4", "0.3"] and rows[2]["train/new_metric"] == "1.0"
