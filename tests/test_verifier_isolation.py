"""The verifier worker holds against hostile model output and hostile data: nothing written, no network, no secret.

Three layers, each tested on its own: the parse-only evaluation of ``scoring_guard`` (reasoning-gym scorers that
``eval`` the answer, sympy's ``parse_expr``), the confined worker of ``confinement`` (probed from a verifier's
``warmup``, which runs outside the guard, as code that found another way to run would), and the pool, which scores a
refused item 0 with the reason. Every hostile attempt targets a place the trainer's uid could write or reach.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from pathlib import Path

import pytest

from stare_lightning.rewards import VerifierPool
from stare_lightning.rewards.reasoning_gym import METADATA_KEY
from stare_lightning.rewards.scoring_guard import allowed_names, string_code_refusal

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the verifier worker's confinement is Linux's")

# reasoning-gym 0.1.25 scorers that eval() the response's answer or hand it to sympy's parse_expr (which evals);
# number_sorting evals the record's answer instead (test_a_hostile_record_answer_is_not_evaluated).
EVALUATING_GENERATORS = [
    "binary_matrix",
    "countdown",
    "intermediate_integration",
    "n_queens",
    "polynomial_multiplication",
    "puzzle24",
    "simple_integration",
    "spiral_matrix",
    "string_insertion",
]


def _payloads(mark: Path) -> list[str]:
    """Python that creates ``mark`` when evaluated, by the usual routes (no braces: they would end the box)."""
    return [
        f"__import__('os').system('touch {mark}')",
        f"open('{mark}', 'w').write('x')",
        f"[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'Popen'][0](['touch', '{mark}'])",
        f"Symbol('x').__class__.__init__.__globals__['__builtins__']['open']('{mark}', 'w')",
    ]


@pytest.fixture(scope="module")
def writable_dir():
    """A directory any uid may write, outside the directories the worker hides, removed afterwards."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=".verifier-isolation-", dir=Path(__file__).resolve().parent))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(timeout_s=20.0) as p:
        yield p


def _gym_item(name: str, response: str, answer_override: str | None = None) -> tuple:
    from stare_lightning.data.tasks.reasoning_gym import jsonable
    from stare_lightning.rewards.reasoning_gym import generator

    entry = generator(name, {}, 3)[0]
    answer = entry["answer"] if answer_override is None else answer_override
    info = {"generator": name, "config": {}, "seed": 3, "answer": answer, "metadata": jsonable(entry["metadata"])}
    return ("reasoning_gym", response, entry["answer"], {METADATA_KEY: info}), entry


def test_the_parse_only_policy_lets_expressions_through_and_nothing_else():
    allowed = allowed_names()

    def refusal(text):
        return string_code_refusal(compile(text, "<string>", "eval"), allowed)

    for benign in ["Integer(2)*Symbol('x') + Rational(1, 3)", "[1, 'a', (2.5, None)]", "sqrt(2) + x**2 + C"]:
        assert refusal(benign) is None, benign
    for hostile, name in [
        ("__import__('os')", "__import__"),
        ("open('/etc/passwd')", "open"),
        ("().__class__", "__class__"),
        ("os.system('true')", "os"),
        ("(lambda: getattr(x, 'y'))()", "getattr"),  # names inside nested code count too
        ("[t for t in type(x).mro()]", "type"),
        ("Symbol('x').func_globals", "func_globals"),
        ("test()", "test"),  # sympy.test runs a test suite
    ]:
        reason = refusal(hostile)
        assert reason is not None and name in reason, (hostile, reason)


@pytest.mark.slow
@pytest.mark.parametrize("name", EVALUATING_GENERATORS)
def test_hostile_answers_to_evaluating_scorers_score_zero_and_run_nothing(pool, writable_dir, name):
    pytest.importorskip("reasoning_gym")
    marks = [writable_dir / f"{name}-{k}" for k in range(len(_payloads(writable_dir)))]
    hostile = [_gym_item(name, f"The answer is \\boxed{{{_payloads(mark)[k]}}}") for k, mark in enumerate(marks)]
    _, entry = hostile[0]
    oracle, _ = _gym_item(name, f"\\boxed{{{entry['answer']}}}")
    result = pool.score([item for item, _ in hostile] + [oracle])
    assert not [mark.name for mark in marks if mark.exists()], "a payload ran"
    refused = [int(m.split()[1]) for m in result.messages if "refused while scoring" in m]
    assert refused, ("no payload reached the scorer's evaluation", name, result.messages)
    for k, score in enumerate(result.scores[:-1]):  # refused: 0; else the scorer's own score of a wrong answer
        assert score == 0.0 if k in refused else score < 0.1, (k, score, result.messages)
    assert result.scores[-1] == 1.0, ("the oracle answer still scores through the parse-only path", result)


@pytest.mark.slow
def test_a_hostile_record_answer_is_not_evaluated(pool, writable_dir):
    """number_sorting evals the record's own answer: a data file is as hostile as a response."""
    pytest.importorskip("reasoning_gym")
    mark = writable_dir / "from-record"
    item, _ = _gym_item("number_sorting", "\\boxed{['1']}", answer_override=_payloads(mark)[0])
    result = pool.score([item])
    assert result.scores == [0.0] and not mark.exists()
    assert "refused while scoring" in result.messages[0]


HOSTILE_MODULE = """
import os, socket

WRITABLE = {writable!r}
PORT = {port}
PRIVATE = {private!r}
SECRET = {secret!r}
RESULTS = {{}}


def _attempt(name, action):
    try:
        action()
        RESULTS[name] = 1.0
    except BaseException:
        RESULTS[name] = 0.0


def _write(path):
    with open(path, "w") as handle:
        handle.write("x")


def _environment_has_secret():
    with open("/proc/self/environ", "rb") as handle:
        assert SECRET.encode() in handle.read()


def _fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def warmup():
    # Outside the scoring guard: what code that found a way to run could do in the confined worker.
    _attempt("write_world_writable_dir", lambda: _write(os.path.join(WRITABLE, "from-warmup")))
    _attempt("write_var_tmp", lambda: _write("/var/tmp/verifier-isolation-probe"))
    _attempt("write_dev_shm", lambda: _write("/dev/shm/verifier-isolation-probe"))
    _attempt("read_shadow", lambda: open("/etc/shadow").read())
    _attempt("read_owner_only_file", lambda: open(PRIVATE).read())
    _attempt("loopback_service", lambda: socket.create_connection(("127.0.0.1", PORT), timeout=2).close())
    _attempt("metadata_address", lambda: socket.create_connection(("169.254.169.254", 80), timeout=2).close())
    _attempt("secret_in_environment", _environment_has_secret)
    _attempt("fork", _fork)
    _attempt("become_root", lambda: os.setuid(0))
    _attempt("allocate_8_gib", lambda: bytearray(8 << 30))


def probe(response, answer, metadata):
    return RESULTS[response]


probe.warmup = warmup
"""
ATTEMPTS = (
    "write_world_writable_dir write_var_tmp write_dev_shm read_shadow read_owner_only_file loopback_service "
    "metadata_address secret_in_environment fork become_root allocate_8_gib"
).split()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="a uid of its own needs a root trainer")
def test_code_that_runs_in_the_worker_reaches_nothing(tmp_path, writable_dir, monkeypatch):
    probes = [Path("/var/tmp/verifier-isolation-probe"), Path("/dev/shm/verifier-isolation-probe")]
    for probe in probes:  # left by an earlier run of unconfined code: only a new write counts
        probe.unlink(missing_ok=True)
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted = []

    def serve():
        while not server_done.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    server_done = threading.Event()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    secret = "sk-verifier-isolation-0123456789"
    monkeypatch.setenv("STARE_TEST_API_TOKEN", secret)
    private = writable_dir / "private"
    private.mkdir(mode=0o700)
    (private / "answers.txt").write_text("the answers")
    source = HOSTILE_MODULE.format(
        writable=str(writable_dir), port=server.getsockname()[1], secret=secret, private=str(private / "answers.txt")
    )
    (tmp_path / "hostile_verifier.py").write_text(source)
    tmp_path.chmod(0o755)  # the worker's own uid reads it
    monkeypatch.syspath_prepend(str(tmp_path))  # under /tmp/pytest-of-root (owner-only): bound back for the worker
    try:
        with VerifierPool(timeout_s=30.0) as pool:
            result = pool.score([("hostile_verifier:probe", attempt, "", {}) for attempt in ATTEMPTS])
            confinement = pool.confinement
    finally:
        server_done.set()
        thread.join()
        server.close()
    assert result.errors == 0, result.messages
    succeeded = [attempt for attempt, score in zip(ATTEMPTS, result.scores) if score != 0.0]
    assert succeeded == [], f"the confined worker could: {succeeded}"
    assert not accepted and not (writable_dir / "from-warmup").exists()
    assert not [probe for probe in probes if probe.exists()]
    assert (
        confinement.own_uid and confinement.uid != 0 and confinement.network_namespace and confinement.mount_namespace
    )
    assert confinement.weaknesses() == []
