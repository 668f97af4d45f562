"""``AdapterVersions``: the adapter versions an engine serves (``rollout.lora_sync=adapter``), from files to eviction.

Both engines that serve adapters (the colocated vLLM engine and the rollout servers) live the same lifecycle: each
synced version is written as a peft adapter directory into the run's private transfer directory (``transfer_dir.py``,
checked in place before every write), loaded by the engine under a name of its own, and once it falls out of the kept
window (``AdapterSync.versions``: ``rollout.max_staleness + 1``) unloaded before its files are deleted. A version
whose load fails leaves no files behind. An engine supplies only how to ``load`` and ``unload`` one version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from stare_lightning.rollout.adapters import AdapterSync, write_adapter
from stare_lightning.rollout.transfer_dir import TransferDirectory

__all__ = ["AdapterVersion", "AdapterVersions"]


@dataclass(frozen=True)
class AdapterVersion:
    """One synced version as its engine loads it."""

    name: str  # what a request names to sample with it: "<prefix>-<label>"
    serial: int  # 1 for the run's first version, then 2, ... (vLLM's lora_int_id in the colocated engine)
    path: Path  # its peft adapter directory
    bytes: int  # the adapter tensors' bytes, what the sync moved
    contents: dict[str, bytes]  # the directory's files, by name (for an engine that cannot read it)


class AdapterVersions:
    """The versions an engine serves, oldest first, and the transfer directory their files live in.

    ``load(version)`` makes the engine serve ``version`` (raising leaves nothing loaded); ``unload(version)`` takes it
    off again. ``under``: where the private transfer directory is made (None: ``/dev/shm``), when first needed.
    Names are ``"<prefix>-<label>"``: a prefix of its own per run keeps a server kept across runs from reusing an
    earlier run's version of the same label (and the prefixes it cached with that version's weights).
    """

    def __init__(
        self,
        sync: AdapterSync,
        *,
        load: Callable[[AdapterVersion], None],
        unload: Callable[[AdapterVersion], None],
        prefix: str,
        under: str | Path | None = None,
    ) -> None:
        self.sync, self.prefix, self.under = sync, prefix, under
        self._load, self._unload = load, unload
        self._directory: TransferDirectory | None = None
        self.serials = 0  # versions added so far
        self._served: list[AdapterVersion] = []

    def name_of(self, label: str) -> str:
        """The served name of the version labelled ``label``."""
        return f"{self.prefix}-{label}"

    def directory(self) -> TransferDirectory:
        """The run's transfer directory for adapter files, made at the first call."""
        if self._directory is None:
            self._directory = TransferDirectory(self.under)
        return self._directory

    def add(self, weights: Iterable[tuple[str, torch.Tensor]], label: str | None = None) -> AdapterVersion:
        """Write ``weights`` (peft-named adapter tensors) as the next version, labelled ``label`` (default
        ``v<serial>``), load it, then unload the versions that fall out of the kept window and delete their files."""
        directory = self.directory()
        self.serials += 1
        name = self.name_of(label or f"v{self.serials}")
        directory.check_in_place()
        with torch.no_grad():
            files = write_adapter(directory, name, weights, self.sync)
        version = AdapterVersion(name, self.serials, files.path, files.bytes, files.contents)
        try:
            self._load(version)
        except BaseException:
            directory.delete(name)
            raise
        self._served.append(version)
        while len(self._served) > self.sync.versions:
            old = self._served.pop(0)
            self._unload(old)
            directory.delete(old.name)
        return version

    @property
    def names(self) -> list[str]:
        """The served versions' names, oldest first."""
        return [version.name for version in self._served]

    @property
    def current(self) -> AdapterVersion | None:
        """The newest version (None before the first)."""
        return self._served[-1] if self._served else None

    def close(self) -> None:
        """Delete the transfer directory with every version's files (the engine has stopped serving them)."""
        if self._directory is not None:
            self._directory.remove()
            self._directory = None
