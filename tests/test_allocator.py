"""The allocator helpers: tcmalloc found on disk is what a process started with the printed LD_PRELOAD runs on."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from stare_lightning import allocator

LOADED = "from stare_lightning.allocator import tcmalloc_loaded; print(tcmalloc_loaded())"


def _child(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", LOADED], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.needs("tcmalloc")  # make install installs it where apt-get can
def test_a_process_started_with_the_printed_preload_runs_on_tcmalloc():
    library = allocator.find_tcmalloc()
    printed = subprocess.run(
        [sys.executable, "-m", "stare_lightning.allocator"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert printed == f"LD_PRELOAD={library}" and library.is_file()
    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    assert _child(plain) == "False"
    assert _child({**plain, "LD_PRELOAD": str(library)}) == "True"


def test_loaded_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert not allocator.tcmalloc_loaded(maps)
    maps.write_text(maps.read_text() + "7f20-7f30 r-xp 00000000 08:01 2 /usr/lib/libtcmalloc_minimal.so.4\n")
    assert allocator.tcmalloc_loaded(maps)
    assert not allocator.tcmalloc_loaded(tmp_path / "missing")


def test_the_hint_is_for_cpu_runs_without_tcmalloc(caplog, monkeypatch):
    monkeypatch.setattr(allocator, "tcmalloc_loaded", lambda: False)
    with caplog.at_level(logging.WARNING, logger=allocator.__name__):
        allocator.hint_if_page_faulting(on_cpu=False)
        assert not caplog.records
        allocator.hint_if_page_faulting(on_cpu=True)
    assert len(caplog.records) == 1 and "LD_PRELOAD" in caplog.records[0].getMessage()
    monkeypatch.setattr(allocator, "tcmalloc_loaded", lambda: True)
    caplog.clear()
    allocator.hint_if_page_faulting(on_cpu=True)
    assert not caplog.records
