"""benchmarks/bench_suite_cpu.py: the kinds a process is counted under, CPU counted from when it is first seen, and
a real command whose child burns CPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_suite_cpu.py"
# Loaded from its file: benchmarks/ is not a package, and putting it on sys.path would reach every later test.
_spec = importlib.util.spec_from_file_location("bench_suite_cpu", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

PYTEST_WORKER = "python -u -c import sys;exec(eval(sys.stdin.readline()))"
FORK_SERVER = "python tests/forked_cli.py /tmp/x/server.sock"


@pytest.mark.parametrize(
    "chain,kind",
    [
        ([PYTEST_WORKER, "python -m pytest -n 2"], "pytest worker (in-process tests)"),
        ([FORK_SERVER, PYTEST_WORKER], "fork server (tests)"),
        ([FORK_SERVER, FORK_SERVER, PYTEST_WORKER], "forked command"),  # a fork keeps its server's command line
        # A server's engine is the server's, whoever started the server.
        (["VLLM::EngineCore", "python -m vllm.entrypoints.openai.api_server --model m", FORK_SERVER], "vLLM server"),
        (["python -m stare_lightning.__main__ fit trainer=ddp", FORK_SERVER], "Lightning DDP child"),
        (["python -m stare_lightning serve rollout=server", "bash"], "fresh python -m stare_lightning"),
        (["python -c from multiprocessing.spawn import spawn_main; spawn_main()", PYTEST_WORKER], "multiprocessing"),
        (["python -m torch.distributed.run --nnodes=2", "bash"], "torchrun"),
        (["python -c print(1)"], "other Python"),
        (["bwrap --ro-bind /usr /usr"], "other"),
    ],
)
def test_each_process_is_counted_under_its_kind(chain, kind):
    assert bench.classify(chain).startswith(kind)


def test_cpu_counts_from_the_first_sample_or_from_the_start():
    recorder = bench.Recorder()
    commands = {1: "bash", 2: PYTEST_WORKER, 3: FORK_SERVER, 4: FORK_SERVER}.get
    recorder.add({(1, 10): (0, 50.0), (2, 20): (1, 7.0)}, command_line=commands)  # both already running
    recorder.add({(1, 10): (0, 50.5), (2, 20): (1, 9.0), (3, 30): (2, 1.5)}, command_line=commands)
    recorder.add({(2, 20): (1, 9.5), (3, 30): (2, 2.0), (4, 40): (3, 4.0)}, command_line=commands)
    assert recorder.used == {(1, 10): 0.5, (2, 20): 2.5, (3, 30): 2.0, (4, 40): 4.0}
    assert recorder.chain((4, 40)) == [FORK_SERVER, FORK_SERVER, PYTEST_WORKER, "bash"]
    kinds = recorder.by_kind()
    assert kinds["forked command"] == {"cpu_s": 4.0, "processes": 1}
    assert kinds["pytest worker (in-process tests)"] == {"cpu_s": 2.5, "processes": 1}
    # A pid the kernel reuses is another process: a child's parent is the one of that pid that started before it.
    reused = {4: "bash -c again", 6: "python -c child"}.get
    recorder.add({(4, 60): (1, 1.0), (6, 70): (4, 0.5)}, command_line=reused)
    assert recorder.chain((6, 70)) == ["python -c child", "bash -c again", "bash"]


def test_a_command_whose_child_burns_a_second_of_cpu(tmp_path):
    busy = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {busy!r}], check=True)"
    out = tmp_path / "cpu.json"
    command = [sys.executable, str(SCRIPT), "--json", str(out), "--", sys.executable, "-c", child]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["exit"] == 0 and record["kinds"]["other Python"]["cpu_s"] >= 0.5, record
