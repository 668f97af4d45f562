"""STARE where people already train: a plain-PyTorch entry point (``pytorch``) and a TRL trainer (``trl``).

Both are built from ``stare_lightning.algorithms``; neither imports Lightning or Hydra. Importing this package
imports neither submodule; importing ``trl`` imports TRL (and refuses a TRL outside the tested minor release).
"""
