"""Prompt data: the record schema and its loaders, built-in offline tasks, and the prompt DataModule.

The DataModule streams prompt records only; rollouts happen in the training step and rewards come
from :mod:`stare_lightning.rewards`.
"""

from stare_lightning.lazy_exports import lazy_exports

_EXPORTS = {
    "DataConfig": ".config",
    "PromptDataModule": ".datamodule",
    "encode_prompt": ".prompts",
    "render_prompt": ".prompts",
    "RECIPES": ".recipes",
    "prepare": ".recipes",
    "DataError": ".records",
    "PromptRecord": ".records",
    "load_records": ".records",
    "build_records": ".tasks",
    "sft_examples": ".tasks",
    "task_names": ".tasks",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
