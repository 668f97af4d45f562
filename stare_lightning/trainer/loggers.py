"""A CSV logger that keeps what an earlier run wrote to the same directory.

Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` when a new run (a resume, say) writes to the
same version directory. Here a resumed run appends instead, so a run's history survives restarts; rows of
steps that are logged again after a resume follow the old ones (readers keep the last value per step).
"""

from __future__ import annotations

import csv

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class _AppendingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as handle:
                self.metrics_keys = list(csv.DictReader(handle).fieldnames or [])


class ResumableCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` that appends to the ``metrics.csv`` of an earlier run in the same directory (a
    resume) instead of deleting it; it takes ``CSVLogger``'s arguments."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
