"""stare_lightning: STARE and the GRPO family for RL with verifiable rewards, on PyTorch Lightning."""

__version__ = "0.1.0"
