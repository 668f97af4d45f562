"""Each callback of ``stare_lightning.callbacks`` on its own, in a real CPU ``lightning.Trainer`` driving a toy
module that logs scripted values (no STARE fit, no model download). Expected values are computed here."""

from __future__ import annotations

import io
import json
import warnings

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from stare_lightning.callbacks import EntropyGuard, FinalStateCheckpoint, RolloutSampleDump, RunSummary
from stare_lightning.callbacks.run_summary import TRAIN_HEADING, VAL_HEADING, train_heading, train_window

LOW, HIGH = 0.1, 5.0


class ToyModule(lightning.LightningModule):
    """A linear layer; training step ``i`` (0-based) logs ``train[key][i]``, validation ``j`` logs ``val[j]``."""

    def __init__(self, train=None, val=(), groups=0):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.train_values, self.val_values, self.groups, self.validations = train or {}, list(val), groups, 0
        # no ``cfg`` attribute: the callbacks must not read the project's config off the module

    def _log(self, key, value):
        self.log(key, value, logger=bool(self.trainer.loggers))

    def training_step(self, batch, batch_idx):
        step = self.global_step
        for key, values in self.train_values.items():
            self._log(key, values[step])
        self.last_rollout_samples = [
            {
                "id": f"{step}-{g}",
                "prompt": f"p{g}",
                "answer": str(g),
                "responses": ["a", "b"],
                "rewards": [1.0, 0.0],
                "advantages": [0.5, -0.5],
            }
            for g in range(self.groups)
        ]
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        if self.trainer.sanity_checking:
            values = {"val/avg@n": 99.0}  # must not reach RunSummary
        else:
            values = self.val_values[self.validations]
        for key, value in values.items():
            self._log(key, value)

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.validations += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(n=64):
    return DataLoader(TensorDataset(torch.randn(n, 2)), batch_size=1)


def fit(module, tmp_path, callbacks, max_steps, logger=False, ckpt_path=None, **kwargs):
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=logger,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        log_every_n_steps=1,
        **{"limit_val_batches": 0, **kwargs},
    )
    trainer.fit(module, train_dataloaders=loader(), val_dataloaders=loader(1), ckpt_path=ckpt_path)
    return trainer


# ------------------------------------------------------------------------------------------ EntropyGuard


def run_guard(tmp_path, entropies, max_steps, **kwargs):
    guard = EntropyGuard(low=LOW, high=HIGH, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(ToyModule({"train/entropy": entropies}), tmp_path, [guard], max_steps)
    return trainer, guard, [w for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("collapsed", [0.01, 50.0], ids=["below_low", "above_high"])
def test_entropy_guard_stops_after_patience_steps_out_of_band(tmp_path, collapsed):
    trainer, guard, caught = run_guard(tmp_path, [1.0] * 3 + [collapsed] * 20, 20, patience=4, action="stop")
    assert trainer.global_step == 3 + 4, "three in-band steps, then exactly `patience` out-of-band ones"
    assert len(caught) == 1 and "train/entropy" in str(caught[0].message)
    assert "stopping" in str(caught[0].message)


def test_entropy_guard_back_in_band_resets_count(tmp_path):
    alternating = [0.01, 0.01, 1.0] * 10  # never `patience`=3 out-of-band steps in a row
    trainer, guard, caught = run_guard(tmp_path, alternating, 12, patience=3, action="stop")
    assert trainer.global_step == 12 and not caught
    assert guard.steps_outside == 0  # step 12 (index 11) was in band


def test_entropy_guard_warn_runs_to_max_steps(tmp_path):
    trainer, guard, caught = run_guard(tmp_path, [0.01] * 10, 10, patience=3, action="warn")
    assert trainer.global_step == 10
    assert len(caught) == 1 and "train/entropy" in str(caught[0].message)
    assert "(step 3)" in str(caught[0].message) and "stopping" not in str(caught[0].message)


def test_entropy_guard_state_survives_checkpoint_resume(tmp_path):
    guard, ckpt = EntropyGuard(low=LOW, high=HIGH, patience=8, action="stop"), tmp_path / "a" / "last.ckpt"
    saver = ModelCheckpoint(tmp_path / "a", save_last=True, every_n_train_steps=3)
    fit(ToyModule({"train/entropy": [0.01] * 20}), tmp_path, [guard, saver], 3)
    assert guard.steps_outside == 3
    fresh = EntropyGuard()
    fresh.load_state_dict(guard.state_dict())
    assert fresh.steps_outside == 3
    # Through a real checkpoint: without the restored count the resumed run would stop at step 3 + 5.
    resumed = EntropyGuard(low=LOW, high=HIGH, patience=5, action="stop")
    with pytest.warns(RuntimeWarning, match="train/entropy"):
        trainer = fit(ToyModule({"train/entropy": [0.01] * 20}), tmp_path, [resumed], 20, ckpt_path=ckpt)
    assert trainer.global_step == 3 + (5 - 3)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"action": "halt"}, "callbacks.entropy_guard.action"),
        ({"low": -0.1}, "callbacks.entropy_guard"),
        ({"low": 2.0, "high": 1.0}, "callbacks.entropy_guard"),
        ({"patience": 0}, "callbacks.entropy_guard.patience"),
    ],
)
def test_entropy_guard_rejects_bad_arguments(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        EntropyGuard(**kwargs)


# ---------------------------------------------------------------------------------- FinalStateCheckpoint


def saved_checkpoints(tmp_path, cls, max_steps):
    """Run with ``cls`` and return ([(file name, global_step)] per save, files left, last.ckpt's step)."""
    saves, dirpath = [], tmp_path / cls.__name__
    callback = cls(dirpath=dirpath, every_n_train_steps=2, save_last=True)

    class Spy(lightning.Callback):
        def setup(self, trainer, pl_module, stage):
            save = trainer.save_checkpoint
            trainer.save_checkpoint = lambda path, *a, **k: (
                saves.append((str(path).rsplit("/", 1)[-1], trainer.global_step)),
                save(path, *a, **k),
            )

    fit(ToyModule(), tmp_path / cls.__name__, [Spy(), callback], max_steps)
    last = torch.load(dirpath / "last.ckpt", weights_only=False)["global_step"]
    return saves, sorted(p.name for p in dirpath.iterdir()), last


def test_final_checkpoint_last_holds_final_step(tmp_path):
    saves, files, last = saved_checkpoints(tmp_path, FinalStateCheckpoint, 3)
    plain_saves, plain_files, plain_last = saved_checkpoints(tmp_path, ModelCheckpoint, 3)
    assert last == 3
    assert plain_last == 2, "Lightning's own ModelCheckpoint leaves last.ckpt at the periodic save"
    assert saves == plain_saves + [("last.ckpt", 3)] and files == plain_files


def test_final_checkpoint_no_extra_save_when_final_step_saved(tmp_path):
    saves, files, last = saved_checkpoints(tmp_path, FinalStateCheckpoint, 4)
    plain = saved_checkpoints(tmp_path, ModelCheckpoint, 4)
    assert (saves, files, last) == plain and last == 4
    assert saves.count(("last.ckpt", 4)) == 1


class KilledWhileValidating(Exception):
    pass


class ManualToyModule(lightning.LightningModule):
    """As the STARE module: manual optimisation, one optimizer step per batch. Records the step of every
    validation (in ``validated``, shared across a resume) and dies inside the validation of ``die_at``."""

    def __init__(self, validated, die_at=None):
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(2, 1)
        self.validated, self.die_at = validated, die_at

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self.layer(batch[0]).pow(2).mean())
        optimizer.step()

    def validation_step(self, batch, batch_idx):
        if self.global_step == self.die_at:
            raise KilledWhileValidating
        self.validated.append(self.global_step)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


VALIDATE_EVERY_2_STEPS = dict(limit_val_batches=1, val_check_interval=2, num_sanity_val_steps=0)


@pytest.mark.parametrize("cls", [FinalStateCheckpoint, ModelCheckpoint])
def test_final_checkpoint_resume_keeps_a_validation_cut_by_a_kill(tmp_path, cls):
    """Validation and a checkpoint every 2 steps; the run dies inside step 4's validation and is resumed from
    ``last``. Plain ``ModelCheckpoint`` saved step 4 before its validation, and the resume skips that validation;
    ``FinalStateCheckpoint`` saves after each validation, so the resume redoes steps 3-4 and validates at 4."""
    validated, dirpath = [], tmp_path / "checkpoints"

    def run(die_at, ckpt_path):
        callback = cls(dirpath=dirpath, every_n_train_steps=2, save_last=True, save_top_k=0)
        module = ManualToyModule(validated, die_at)
        fit(module, tmp_path, [callback], 6, ckpt_path=ckpt_path, **VALIDATE_EVERY_2_STEPS)

    with pytest.raises(KilledWhileValidating):
        run(die_at=4, ckpt_path=None)
    resumed_from = torch.load(dirpath / "last.ckpt", weights_only=False)["global_step"]
    run(die_at=None, ckpt_path=dirpath / "last.ckpt")
    if cls is FinalStateCheckpoint:
        assert (resumed_from, validated) == (2, [2, 4, 6])
    else:
        assert (resumed_from, validated) == (4, [2, 6]), "Lightning's own behaviour, which the subclass fixes"


# -------------------------------------------------------------------------------------------- RunSummary

STEPS = 12
QUADRANT = "train/quadrant/exact/pos_high/tokens"
TRAIN = {
    "train/entropy": [i / 8 for i in range(STEPS)],
    "train/reward/mean": [1 - i / 16 for i in range(STEPS)],
    QUADRANT: [(i % 3) / 4 for i in range(STEPS)],
    # The step time and its phases, one of which (tool) never ran: a row each, without it.
    "train/time/step_s": [1.0] * STEPS,
    "train/time/rollout": [0.75] * STEPS,
    "train/time/update": [0.25] * STEPS,
    "train/time/tool": [0.0] * STEPS,
}
TIME_ROWS = {
    "train/time/step_s": ("1.00", "1.00"),
    "train/time/rollout": ("0.75", "0.75"),
    "train/time/update": ("0.25", "0.25"),
}
VAL = [{"val/avg@n": 0.25, "val/pass@1": 0.5}, {"val/avg@n": 0.625, "val/pass@1": 0.75}]


def run_summary(tmp_path, logger=False):
    summary = RunSummary(name="toy")
    trainer = fit(
        ToyModule(TRAIN, VAL),
        tmp_path,
        [summary],
        STEPS,
        logger=logger,
        limit_val_batches=1,
        val_check_interval=STEPS // 2,
        num_sanity_val_steps=1,
    )
    return trainer, summary


def expected_rows():
    rows = {key: (f"{VAL[0][key]:.4f}", f"{VAL[-1][key]:.4f}") for key in ("val/avg@n", "val/pass@1")}
    for key, values in TRAIN.items():
        if key.startswith("train/time/"):
            continue
        rows[key] = (f"{sum(values[:6]) / 6:.4f}", f"{sum(values[-6:]) / 6:.4f}")  # 12 steps: half at each end
    return {**rows, **TIME_ROWS}


def test_run_summary_rows(tmp_path):
    _, summary = run_summary(tmp_path)
    assert len(summary.validations) == 2 and len(summary.train_history) == STEPS
    rows = summary.rows()
    assert {metric: (start, end) for metric, start, end in rows} == expected_rows()
    assert len(rows) == 8, "never-logged keys (val/entropy, train/stare/*, other quadrants) must be absent"
    assert ("train/entropy", "0.3125", "1.0625") in rows  # (0..5)/8 and (6..11)/8: the ends share no step
    heading = "training: mean of the first and last 6 of 12 steps (a short run: half of it at each end)"
    assert [heading for heading, _ in summary.sections()] == [VAL_HEADING, heading]


def test_a_short_runs_window_is_half_of_it_and_a_long_runs_ten_steps():
    assert [train_window(steps) for steps in (1, 2, 3, 12, 19, 20, 300)] == [1, 1, 1, 6, 9, 10, 10]
    assert train_heading(20) == train_heading(300) == TRAIN_HEADING == "training: mean of the first and last 10 steps"
    assert train_heading(3) == "training: mean of the first and last 1 of 3 steps (a short run: half of it at each end)"
    assert train_heading(1) == "training: the run's only step (start and end are the same)"


def test_run_summary_state_round_trip(tmp_path):
    _, summary = run_summary(tmp_path)
    restored = RunSummary()
    restored.load_state_dict(summary.state_dict())
    assert restored.rows() == summary.rows() and restored.train_history == summary.train_history
    empty = RunSummary()
    empty.load_state_dict({})
    assert empty.rows() == []


def test_run_summary_shows_the_asynchronous_rows_only_when_samples_were_stale():
    step = {
        "train/time/step_s": 2.0,
        "train/time/update": 1.5,
        "train/time/trainer_idle": 0.5,
        "train/async/staleness/mean": 0.0,
        "train/async/staleness/max": 0.0,
        "train/async/queue_depth": 1.0,
        "train/time/engine_idle": 0.25,
        "train/time/weight_push": 0.125,
    }
    summary = RunSummary()
    summary.train_history = [dict(step) for _ in range(3)]
    rows = {metric: (start, end) for metric, start, end in summary.rows()}
    assert rows["train/time/trainer_idle"] == ("0.50", "0.50")  # a phase of the step: it adds up to step_s
    assert "train/async/staleness/mean" not in rows and "train/time/engine_idle" not in rows
    summary.train_history = [{**step, "train/async/staleness/mean": s, "train/async/staleness/max": s} for s in (0, 1)]
    rows = {metric: (start, end) for metric, start, end in summary.rows()}
    assert rows["train/async/staleness/mean"] == ("0.00", "1.00")  # 2 steps: the first, then the last
    assert rows["train/time/engine_idle"] == ("0.25", "0.25") and rows["train/time/weight_push"] == ("0.12", "0.12")
    from rich.console import Console

    console = Console(width=100, record=True, file=io.StringIO())
    console.print(summary.table(2))
    text = console.export_text()
    assert "│   train/time/trainer_idle " in text  # indented under step_s, as a phase
    assert "│ train/time/engine_idle " in text  # the producer's time: not a phase of the step


def test_the_curves_get_a_row_for_asynchronous_rollouts(tmp_path):
    import pandas as pd

    from stare_lightning.analysis.plots import plot_runs

    def height(png):  # the PNG header's IHDR: width, then height, big-endian
        return int.from_bytes(png.read_bytes()[20:24], "big")

    base = {"step": [0, 1, 2], "train/entropy": [0.5, 0.4, 0.45], "train/time/trainer_idle": [0.1, 0.2, 0.1]}
    fresh = pd.DataFrame({**base, "train/async/staleness/mean": [0.0] * 3})
    synchronous = plot_runs({"run": fresh}, tmp_path / "s.png")
    stale = plot_runs({"run": pd.DataFrame({**base, "train/async/staleness/mean": [0, 1, 1]})}, tmp_path / "a.png")
    assert height(synchronous) == 12 * 110 and height(stale) == 16 * 110


def test_run_summary_prints_table_and_writes_png(tmp_path, capsys):
    run_summary(tmp_path / "plain")  # no CSVLogger: a table, no PNG
    out = capsys.readouterr().out
    assert "toy after 12 steps" in out and "0.3125" in out and "0.6250" in out
    assert not (tmp_path / "plain" / "curves.png").exists() and "curves:" not in out

    run_summary(tmp_path / "csv", logger=CSVLogger(tmp_path / "csv"))
    png = tmp_path / "csv" / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "curves:" in capsys.readouterr().out


# ------------------------------------------------------------------------------------- RolloutSampleDump


def test_sample_dump_writes_every_n_steps_from_the_first(tmp_path):
    fit(ToyModule(groups=5), tmp_path, [RolloutSampleDump(every_n_steps=3, max_groups=2)], 8)
    lines = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [line["batch"] for line in lines] == [0, 0, 3, 3, 6, 6]  # rollout batches 0, 3, 6 of 8
    assert [line["step"] for line in lines] == [1, 1, 4, 4, 7, 7]  # the optimizer steps taken by then
    for line in lines:
        assert set(line) == {"batch", "step", "id", "prompt", "answer", "responses", "rewards", "advantages"}
        assert line["rewards"] == [1.0, 0.0] and line["advantages"] == [0.5, -0.5]
    # the first max_groups groups of the step that just ran (training_step's 0-based index is step - 1)
    assert [line["id"] for line in lines] == [f"{s - 1}-{g}" for s in (1, 4, 7) for g in (0, 1)]


class TwoStepsPerBatch(ToyModule):
    """Manual optimisation with two optimizer steps per batch, as with PPO epochs x mini-batches."""

    def __init__(self):
        super().__init__(groups=1)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        for _ in range(2):
            self.manual_backward(self.layer(batch[0]).pow(2).mean())
            self.optimizers().step()
            self.optimizers().zero_grad()


def test_sample_dump_counts_rollout_batches_not_optimizer_steps(tmp_path):
    # every_n_steps=2 with two optimizer steps per batch: keyed on optimizer steps it would never dump again.
    fit(TwoStepsPerBatch(), tmp_path, [RolloutSampleDump(every_n_steps=2)], 12)
    lines = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [line["batch"] for line in lines] == [0, 2, 4]
    assert [line["step"] for line in lines] == [2, 6, 10]


def test_sample_dump_without_samples_writes_nothing(tmp_path):
    fit(ToyModule(groups=0), tmp_path, [RolloutSampleDump(every_n_steps=1)], 3)
    assert not (tmp_path / "rollouts.jsonl").exists()


@pytest.mark.parametrize("kwargs", [{"every_n_steps": 0}, {"max_groups": 0}])
def test_sample_dump_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=r"callbacks\.sample_dump"):
        RolloutSampleDump(**kwargs)
