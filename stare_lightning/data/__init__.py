"""Prompt data: the record schema and its loaders, built-in offline tasks, and the prompt DataModule.

The DataModule streams prompt records only; rollouts happen in the training step and rewards come
from :mod:`stare_lightning.rewards`.
"""

from stare_lightning.lazy_exports import lazy_exports

_EXPORTS = {
    ".config": ("DataConfig",),
    ".datamodule": ("PromptDataModule",),
    ".prompts": ("encode_prompt", "render_prompt"),
    ".recipes": ("RECIPES", "prepare"),
    ".records": ("DataError", "PromptRecord", "load_records"),
    ".tasks": ("build_records", "sft_examples", "task_names"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
