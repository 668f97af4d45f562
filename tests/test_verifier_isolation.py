"""The verifier worker holds against hostile model output and hostile data: nothing written, no network, no secret.

Three layers, each tested on its own: the parse-only evaluation of ``scoring_guard`` (reasoning-gym scorers that
``eval`` the answer, sympy's ``parse_expr``, a forged file name, sympy's importers), the confined worker of
``confinement`` (probed from a verifier's ``warmup``, which runs outside the guard, as code that found another way
to run would, and from a scoring call for its pid namespace), and the pool, which scores a refused item 0 with the
reason. Every hostile attempt targets a place the trainer's uid could write or reach.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from stare_lightning.rewards import VerifierPool
from stare_lightning.rewards.reasoning_gym import METADATA_KEY
from stare_lightning.rewards.scoring_guard import SYMPY_CONSTRUCTORS, allowed_names, string_code_refusal
from tests.needs import require

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the verifier worker's confinement is Linux's")
GOOD_COUNTDOWN = ("countdown", "3*5+7", "22", {"numbers": [3, 5, 7], "target": 22, "ops": "+-*"})

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
def writable_dir(tmp_path_factory):
    """A directory any uid may write that the worker sees: it is on ``sys.path``, so the worker binds it back into
    its own ``/tmp`` (read-only, as every mount it sees). ``HOSTILE_MODULE`` checks that it is there."""
    folder = tmp_path_factory.mktemp("verifier-isolation")
    folder.chmod(0o777)
    sys.path.append(str(folder))
    yield folder
    sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def pool(writable_dir, guard_verifiers):
    """One worker for the module; it imports from the directories those fixtures put on ``sys.path``."""
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
        ("lazy_function('os', 'system')('true')", "lazy_function"),  # imports any module
        ("parse_expr('x')", "parse_expr"),  # evaluates text of its own
        ("lambdify(x, x)", "lambdify"),  # generates and runs code
        ("evaluate(False)", "evaluate"),  # changes how every later item parses
        ("var('y')", "var"),  # writes into its caller's globals
        ("sympy.core", "core"),  # a module attribute
    ]:
        reason = refusal(hostile)
        assert reason is not None and name in reason, (hostile, reason)


@pytest.mark.slow
@pytest.mark.parametrize("name", EVALUATING_GENERATORS)
def test_hostile_answers_to_evaluating_scorers_score_zero_and_run_nothing(pool, writable_dir, name):
    require("reasoning_gym")
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
    require("reasoning_gym")
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
    RESULTS["sees_writable_dir"] = float(os.path.isdir(WRITABLE))  # the writes below are refused, not aimed amiss
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
@pytest.mark.needs("root")  # a uid of its own needs a root trainer
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
            asked = [*ATTEMPTS, "sees_writable_dir"]
            result = pool.score([("hostile_verifier:probe", attempt, "", {}) for attempt in asked])
            confinement = pool.confinement
    finally:
        server_done.set()
        thread.join()
        server.close()
    assert result.errors == 0, result.messages
    assert result.scores[-1] == 1.0, "the worker does not see the world-writable directory it is to fail to write"
    succeeded = [attempt for attempt, score in zip(ATTEMPTS, result.scores) if score != 0.0]
    assert succeeded == [], f"the confined worker could: {succeeded}"
    assert not accepted and not (writable_dir / "from-warmup").exists()
    assert not [probe for probe in probes if probe.exists()]
    assert (
        confinement.own_uid and confinement.uid != 0 and confinement.network_namespace and confinement.mount_namespace
    )
    assert confinement.weaknesses() == []


# Typical answers, plain and LaTeX: what sympify / parse_expr / math-verify turn into the code the guard checks.
PLAIN_ANSWERS = [
    "1/2", "3*5+7", "2*x", "x**2 + 2*x + 1", "x^2", "-7", "1.5", "1e-3", "sqrt(2)",
    "x**(1/3)", "cbrt(8)", "root(8, 3)", "pi", "2*pi/3", "E", "exp(-x**2)", "log(x)", "ln(2)", "log(8, 2)",
    "sin(x)", "cos(pi/3)", "tan(x)", "sec(x)", "csc(x)", "cot(x)", "asin(1)", "acos(0)", "atan(1)", "atan2(1, 1)",
    "sinh(x)", "Rational(1, 3)", "Integer(4)", "Float(2.5)", "Symbol('x')", "Function('f')(x)", "f(x)", "Abs(x)",
    "abs(-2)", "5!", "factorial(5)", "binomial(5, 2)", "gamma(5)", "erf(x)", "floor(2.5)", "ceiling(x)", "gcd(4, 6)",
    "lcm(4, 6)", "Mod(7, 3)", "7 % 3", "Max(1, 2)", "Min(1, 2)", "Interval(0, 1)", "FiniteSet(1, 2)", "{1, 2, 3}",
    "Union(Interval(0, 1), Interval(2, 3))", "EmptySet", "S.Reals", "Reals", "Matrix([[1, 2], [3, 4]])",
    "[[1, 0], [0, 1]]", "[1, 2]", "(1, 2)", "['a', 'b']", "oo", "-oo", "zoo", "nan", "I", "3 + 4*I", "re(z)", "im(z)",
    "conjugate(z)", "arg(z)", "sign(-2)", "Eq(x, 2)", "Ne(x, 1)", "x < 2", "x >= 1", "And(x > 0, x < 1)",
    "Or(x < 0, x > 1)", "Piecewise((1, x > 0), (0, True))", "Sum(k, (k, 1, n))", "Integral(x, x)",
    "Derivative(x**2, x)", "Lambda(x, x**2)", "Tuple(1, 2)", "x**2/2 + C", "alpha + theta", "lambda_",
    "GoldenRatio", "EulerGamma", "N(pi)", "True",
]  # fmt: skip
# Written as people write (parse_expr with implicit multiplication and ^ for powers).
IMPLICIT_ANSWERS = ["2x", "3(x+1)", "2pi", "3 sin x", "sqrt 2", "2 x y", "x^2 + 1", "0.1(6)"]
LATEX_ANSWERS = [
    r"\frac{1}{2}", r"\dfrac{3}{4}", r"\sqrt{2}", r"\sqrt[3]{8}", r"\pi", r"2\pi", r"x^{2}+1", r"e^{x}", r"\ln 2",
    r"\log_2 8", r"\sin x", r"\cos\left(\frac{\pi}{3}\right)", r"\tan^{-1}(1)", r"\arcsin(1)", r"(0, 1]",
    r"[1, \infty)", r"(-\infty, 0) \cup (1, \infty)", r"\{1, 2, 3\}", r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}",
    r"0.5", r"50\%", r"3 + 4i", r"x = 2", r"x \leq 3", r"\binom{5}{2}", r"5!", r"|x|", r"\lfloor 2.5 \rfloor",
    r"\emptyset", r"-\infty", r"\frac{\sqrt{3}}{2}", r"10^{-2}", r"\sinh x", r"\frac{x^2}{2} + C", r"\int x dx",
    r"\sum_{k=1}^{n} k", r"\theta = \frac{\pi}{4}", r"\text{(B)}", r"f(x) = x^2", r"\gcd(4, 6)", r"\max(1,2)",
]  # fmt: skip
# Equivalent but written differently, so math-verify gets to sympy's simplification (polynomial rings and all).
EQUIVALENT_PAIRS = [
    (r"\frac{1}{2}", "0.5"), (r"x^2+2x+1", "(x+1)^2"), (r"2\sqrt{2}", r"\sqrt{8}"), (r"\{2, 1\}", r"\{1, 2\}"),
    (r"\frac{x^2-1}{x-1}", "x+1"), (r"\sin^2 x + \cos^2 x", "1"), (r"a+b", "b+a"),
    (r"\frac{\sqrt{3}}{2}", r"\cos(\pi/6)"),
]  # fmt: skip

GUARD_MODULE = """
import sympy
from math_verify import parse
from sympy.parsing.sympy_parser import (
    convert_xor,
    implicit_multiplication_application,
    parse_expr,
    standard_transformations,
)


def parses(response, answer, metadata):
    sympy.sympify(response)
    parse_expr(response, evaluate=False)
    return 1.0


def parses_implicit(response, answer, metadata):
    parse_expr(response, transformations=standard_transformations + (implicit_multiplication_application, convert_xor))
    return 1.0


def parses_latex(response, answer, metadata):
    return 1.0 if parse("$" + response + "$") else 0.0


def evaluates_among_sympy_names(response, answer, metadata):
    # A scorer that evaluates the answer with sympy's names in scope (``from sympy import *`` then ``eval``).
    eval(response, vars(sympy))
    return 1.0


def runs_compiled(response, answer, metadata):
    # A scorer that compiles the answer under a file name of its choosing (``answer``).
    exec(compile(response, answer, "exec"), {})
    return 1.0
"""


@pytest.fixture(scope="module")
def guard_verifiers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("guard_verifiers")
    (folder / "guard_probe_verifiers.py").write_text(GUARD_MODULE)
    folder.chmod(0o755)  # the worker runs as a uid of its own
    sys.path.insert(0, str(folder))
    yield "guard_probe_verifiers"
    sys.path.remove(str(folder))


def test_every_listed_constructor_is_a_sympy_name():
    import sympy

    assert sorted(name for name in SYMPY_CONSTRUCTORS if not hasattr(sympy, name)) == []


def test_the_library_code_generators_are_found():
    """Code that namedtuple, dataclasses and sympy's MonomialOps build runs unchecked: were one of them not found
    (a library reorganised), every answer that needs it would score 0."""
    from stare_lightning.rewards.scoring_guard import _code_generators

    names = {code.co_name for code in _code_generators()}
    assert {"namedtuple", "_build"} <= names and names & {"_create_fn", "add_fns_to_class"}, names


def test_typical_answers_still_parse_under_the_guard(pool, guard_verifiers):
    items = [(f"{guard_verifiers}:parses", text, "", {}) for text in PLAIN_ANSWERS]
    items += [(f"{guard_verifiers}:parses_implicit", text, "", {}) for text in IMPLICIT_ANSWERS]
    items += [(f"{guard_verifiers}:parses_latex", text, "", {}) for text in LATEX_ANSWERS]
    items += [("math", f"\\boxed{{{a}}}", b, {}) for a, b in EQUIVALENT_PAIRS]
    result = pool.score(items)
    failed = [(item[1], score) for item, score in zip(items, result.scores) if score != 1.0]
    assert failed == [] and result.errors == 0, (failed, result.messages)


def test_sympy_names_that_import_or_evaluate_are_refused(pool, guard_verifiers):
    name = f"{guard_verifiers}:evaluates_among_sympy_names"
    result = pool.score(
        [
            (name, "lazy_function('os', 'getcwd')()", "", {}),  # imports os and calls into it
            (name, "sympify('x + 1')", "", {}),
            (name, "Rational(1, 3) + sqrt(2) * pi", "", {}),  # what the name is there for
        ]
    )
    assert result.scores == [0.0, 0.0, 1.0], result.messages
    assert "lazy_function" in result.messages[0] and "sympify" in result.messages[1], result.messages


def test_code_compiled_under_a_forged_module_file_name_is_checked(pool, guard_verifiers):
    """A real file name (the os module's own) does not make text into an imported module."""
    name = f"{guard_verifiers}:runs_compiled"
    result = pool.score([(name, "import os\nx = os.getcwd()", os.__file__, {}), (name, "x = [1, 2]", os.__file__, {})])
    assert result.scores == [0.0, 1.0], result.messages
    assert "refused while scoring" in result.messages[0] and "getcwd" in result.messages[0], result.messages


PID_MODULE = """
import os


def sees_no_trainer(response, answer, metadata):
    return 0.0 if answer in os.listdir("/proc") else 1.0


def cannot_read_trainer_command_line(response, answer, metadata):
    try:
        with open(f"/proc/{answer}/cmdline", "rb") as handle:
            handle.read()
    except OSError:
        return 1.0
    return 0.0


def alone(response, answer, metadata):
    return 1.0 if [entry for entry in os.listdir("/proc") if entry.isdigit()] == [str(os.getpid())] else 0.0


def small_pid(response, answer, metadata):
    return 1.0 if os.getpid() <= 2 else 0.0
"""


def _gone(pid: int) -> bool:
    """No such process, or one that has exited and waits to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], limit_s: float) -> list[int]:
    import time

    end = time.monotonic() + limit_s
    while time.monotonic() < end and not all(_gone(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if not _gone(pid)]


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.needs("root")  # a pid namespace with its own /proc needs a root trainer here
def test_the_worker_sees_no_other_process_and_dies_with_its_namespace(tmp_path, monkeypatch):
    (tmp_path / "pid_probe_verifiers.py").write_text(PID_MODULE)
    tmp_path.chmod(0o755)
    monkeypatch.syspath_prepend(str(tmp_path))
    trainer = str(os.getpid())
    assert Path(f"/proc/{trainer}/cmdline").read_bytes()  # the host sees it
    probes = ["sees_no_trainer", "cannot_read_trainer_command_line", "alone", "small_pid"]
    with VerifierPool(timeout_s=10.0) as pool:
        result = pool.score([(f"pid_probe_verifiers:{probe}", "", trainer, {}) for probe in probes])
        assert dict(zip(probes, result.scores)) == dict.fromkeys(probes, 1.0), result.messages
        assert pool.confinement.pid_namespace and "processes" not in " ".join(pool.confinement.weaknesses())
        supervisor = pool.worker_pid
        (worker,) = _children(supervisor)
        assert Path(f"/proc/{worker}/status").read_text().split("NSpid:")[1].split("\n")[0].split()[-1] == "1"
        pool.restart()  # SIGTERM: the supervisor kills and reaps the worker, so not even a zombie is left
        assert not Path(f"/proc/{worker}").exists() and _gone(supervisor)
        # SIGKILL to the supervisor (nothing of it runs): the worker goes by its parent-death signal.
        assert pool.score([GOOD_COUNTDOWN]).scores == [1.0]
        supervisor = pool.worker_pid
        (worker,) = _children(supervisor)
        os.kill(supervisor, 9)
        assert _wait_gone([supervisor, worker], limit_s=10.0) == []  # the signal is immediate; 10 s for a loaded host


@pytest.mark.parametrize("where", ["tmp", "tmp_path"])
def test_the_worker_imports_the_built_in_verifiers_from_any_working_directory(where, tmp_path):
    """The built-in verifiers are imported after confinement: the package's own directory is bound back wherever
    it lives (an editable checkout under /tmp included), and a trainer started in /tmp itself does not bind /tmp
    back whole (which failed the worker's start)."""
    code = (
        "from stare_lightning.rewards.pool import VerifierPool\n"
        "with VerifierPool() as pool:\n"
        "    r = pool.score([('countdown', '3+4', '7', {'numbers': [3, 4], 'target': 7})])\n"
        "print(r.scores, r.errors, r.messages)\n"
    )
    cwd = "/tmp" if where == "tmp" else tmp_path
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[1.0] 0 []", out.stdout + out.stderr[-2000:]
