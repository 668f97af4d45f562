"""Prompt data: the record schema and its loaders, built-in offline tasks, and the prompt DataModule.

The DataModule streams prompt records only; rollouts happen in the training step and rewards come
from :mod:`stare_lightning.rewards`.
"""

from .config import DataConfig
from .datamodule import PromptDataModule
from .prompts import encode_prompt, render_prompt
from .recipes import RECIPES, prepare
from .records import DataError, PromptRecord, load_records
from .tasks import build_records, sft_examples, task_names

__all__ = [
    "DataConfig",
    "DataError",
    "PromptDataModule",
    "PromptRecord",
    "RECIPES",
    "build_records",
    "encode_prompt",
    "load_records",
    "prepare",
    "render_prompt",
    "sft_examples",
    "task_names",
]
