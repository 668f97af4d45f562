"""CPU time of a command and of every process on the machine while it runs, by kind of process: where a test
suite's time goes.

    python benchmarks/bench_suite_cpu.py [--json out.json] -- make test

On a machine the suite keeps busy (2 cores, `make test`: idle about 0.05% of a run) the wall time is the CPU time
over the cores, so what to cut is what uses CPU, and pytest's durations do not say it: a test's duration includes
waiting for the other worker's processes. This samples /proc every 0.5 s while the command runs (each process's user
and system time, parent and command line) and sums each process's CPU into a kind told by its own command line and
its ancestors' (a vLLM server's engine counts as the server, a command forked by tests/forked_cli.py as a forked
command). Processes that live less than one interval are missed, and processes already running at the start count
from then. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence

INTERVAL_S = 0.5
_TICKS = os.sysconf("SC_CLK_TCK")

Key = tuple[int, int]  # (pid, start time in ticks): a pid the kernel reuses is another process


def classify(chain: Sequence[str]) -> str:
    """The kind of a process from its command line and its ancestors' (``chain[0]`` is its own)."""
    own = chain[0]
    if any("vllm.entrypoints" in cmd for cmd in chain):
        return "vLLM server (API server, engine, worker)"
    if "exec(eval(sys.stdin.readline()))" in own:
        return "pytest worker (in-process tests)"
    if "forked_cli.py" in own:
        return "forked command" if len(chain) > 1 and "forked_cli.py" in chain[1] else "fork server (tests)"
    if "stare_lightning.__main__" in own:
        return "Lightning DDP child"
    if "-m stare_lightning" in own:
        return "fresh python -m stare_lightning"
    if "multiprocessing.spawn" in own or "multiprocessing.resource_tracker" in own:
        return "multiprocessing child"
    if "torch.distributed.run" in own:
        return "torchrun"
    if "python" in own:
        return "other Python"
    return "other"


def sample() -> dict[Key, tuple[int, float]]:
    """Every process now: its parent and its CPU seconds so far."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue  # ended meanwhile
        fields = stat[stat.rfind(")") + 2 :].split()  # after the command name, which may hold spaces
        found[(int(name), int(fields[19]))] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS)
    return found


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class Recorder:
    """What the samples say: each process's parent, command line and CPU used since it was first seen (or since it
    started, when that was after the first sample)."""

    def __init__(self) -> None:
        self.parent: dict[Key, int] = {}
        self.command: dict[Key, str] = {}
        self.used: Counter[Key] = Counter()
        self._last: dict[Key, float] = {}
        self._first = True

    def add(self, processes: dict[Key, tuple[int, float]], command_line=_command_line) -> None:
        for key, (ppid, cpu) in processes.items():
            if key not in self._last:
                self.parent[key], self.command[key] = ppid, command_line(key[0])
                self._last[key] = 0.0 if not self._first else cpu  # already running at the start: from now on
            self.used[key] += cpu - self._last[key]
            self._last[key] = cpu
        self._first = False

    def chain(self, key: Key) -> list[str]:
        """The command lines from this process up to the oldest ancestor seen."""
        by_pid: dict[int, list[Key]] = {}
        for known in self.command:
            by_pid.setdefault(known[0], []).append(known)
        chain, seen = [], set()
        while key is not None and key not in seen:
            seen.add(key)
            chain.append(self.command[key])
            older = [k for k in by_pid.get(self.parent[key], []) if k[1] <= key[1]]  # the parent started first
            key = max(older, key=lambda k: k[1]) if older else None
        return chain

    def by_kind(self) -> dict[str, dict[str, float]]:
        """CPU seconds and process count per kind, most CPU first."""
        seconds: Counter[str] = Counter()
        count: Counter[str] = Counter()
        for key, used in self.used.items():
            kind = classify(self.chain(key))
            seconds[kind] += used
            count[kind] += 1
        return {kind: {"cpu_s": round(s, 1), "processes": count[kind]} for kind, s in seconds.most_common()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the totals to this file")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    recorder = Recorder()
    recorder.add(sample())
    started = time.monotonic()
    process = subprocess.Popen(command)
    while process.poll() is None:
        time.sleep(INTERVAL_S)
        recorder.add(sample())
    recorder.add(sample())
    kinds = recorder.by_kind()
    total = sum(entry["cpu_s"] for entry in kinds.values())
    wall = time.monotonic() - started
    print(f"wall {wall:.0f} s, sampled CPU {total:.0f} s, exit status {process.returncode}")
    print(f"{'CPU s':>8} {'procs':>6}  kind")
    for kind, entry in kinds.items():
        print(f"{entry['cpu_s']:8.1f} {entry['processes']:6d}  {kind}")
    if args.json:
        record = {"command": command, "exit": process.returncode, "wall_s": round(wall, 1), "cpu_s": round(total, 1)}
        with open(args.json, "w") as handle:
            json.dump({**record, "kinds": kinds}, handle, indent=1)
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
