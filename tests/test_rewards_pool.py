"""VerifierPool: hard timeouts, a budget per call, errors counted, restarts, results in order, shutdown.

Time limits are asserted as behaviour (the item was cut, scored 0, counted as a timeout, its processes are gone),
with wall-clock bounds derived from the configured limits plus a stated slack, never as speed targets (those are
in ``benchmarks/bench_verifier_pool.py``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from stare_lightning.rewards import VerifierPool
from stare_lightning.rewards.pool import BATCH_BUDGET_BASE_S, BATCH_BUDGET_PER_ITEM_S

CD = {"numbers": [3, 5, 7], "target": 22, "ops": "+-*"}
GOOD = ("countdown", "3*5+7", "22", CD)
BAD = ("countdown", "3+5+7", "22", CD)
TIMEOUT_S = 1.0
STARTUP_S = 30.0
# Stopping a worker takes milliseconds (SIGTERM; its supervisor kills and reaps it) and the pool polls every 0.1 s;
# 5 s covers both on a loaded machine many times over.
SLACK_S = 5.0
# A call that has to replace its worker once: the item's limit, then a start within the start-up limit (hello,
# then the verifiers' imports, each bounded by it), plus the slack.
ONE_RESTART_BOUND_S = TIMEOUT_S + 2 * STARTUP_S + SLACK_S

USER_MODULE = """
import os, time

def hang(response, answer, metadata):
    while True:
        pass

def sleep_a_bit(response, answer, metadata):
    time.sleep(float(response))
    return 1.0

def boom(response, answer, metadata):
    raise RuntimeError("boom " + response)

def too_big(response, answer, metadata):
    return 2.0

def not_a_number(response, answer, metadata):
    return "yes"

def die(response, answer, metadata):
    os._exit(3)
"""


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    """A user verifier module on sys.path (the spawned worker inherits sys.path)."""
    import sys

    folder = tmp_path_factory.mktemp("user_verifiers")
    (folder / "pool_test_verifiers.py").write_text(USER_MODULE)
    folder.chmod(0o755)  # the worker runs as a uid of its own
    sys.path.insert(0, str(folder))
    yield "pool_test_verifiers"
    sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def pool(user_module):
    with VerifierPool(timeout_s=TIMEOUT_S, startup_timeout_s=STARTUP_S) as p:
        yield p


def _gone(pid: int) -> bool:
    """No such process, or one that has exited and waits to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def _worker_processes(pool: VerifierPool) -> list[int]:
    """The process the pool started and its children (the worker, in its pid namespace, where there is one)."""
    pid = pool.worker_pid
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [pid, *(int(child) for child in children.read_text().split())] if children.exists() else [pid]


def test_scores_in_order(pool):
    result = pool.score([GOOD, BAD, GOOD, ("exact", "Yes", "yes", {}), ("numeric", "0.5", "1/2", {})])
    assert result.scores == [1.0, 0.0, 1.0, 1.0, 1.0]
    assert (result.timeouts, result.errors) == (0, 0)
    assert pool.score([]).scores == []


def test_hanging_user_verifier_times_out_and_the_next_call_works(pool, user_module):
    pool.score([GOOD])
    pid_before, starts_before = pool.worker_pid, pool.starts
    processes_before = _worker_processes(pool)
    t0 = time.monotonic()
    result = pool.score([GOOD, (f"{user_module}:hang", "x", "y", {}), GOOD, BAD])
    elapsed = time.monotonic() - t0
    assert result.scores == [1.0, 0.0, 1.0, 0.0]  # items after the hang are still scored
    assert result.timeouts == 1 and result.errors == 0
    assert "no answer within 1 s" in result.messages[0]
    assert elapsed < ONE_RESTART_BOUND_S, elapsed
    assert pool.starts == starts_before + 1  # killed and restarted once
    assert pool.worker_pid != pid_before
    assert [pid for pid in processes_before if not _gone(pid)] == []  # the hung worker did not survive
    again = pool.score([GOOD] * 3)
    assert again.scores == [1.0, 1.0, 1.0] and again.timeouts == 0


def test_slow_items_each_get_their_own_deadline(user_module):
    # three items of 1.5 s: 4.5 s in all, past the 4 s per-item limit, but each one well under it
    with VerifierPool(timeout_s=4.0) as p:
        result = p.score([(f"{user_module}:sleep_a_bit", "1.5", "", {})] * 3)
    assert result.scores == [1.0, 1.0, 1.0] and result.timeouts == 0


def test_a_call_past_its_budget_is_cut_and_the_rest_score_zero_as_timeouts(user_module):
    budget = 2.5
    items = [(f"{user_module}:sleep_a_bit", "0.6", "", {})] * 10  # each under the 1 s limit, 6 s in all
    with VerifierPool(timeout_s=TIMEOUT_S, batch_timeout_s=budget) as p:
        assert p.score([GOOD]).scores == [1.0]  # started: the budget below pays for scoring only
        processes = _worker_processes(p)
        t0 = time.monotonic()
        result = p.score(items)
        elapsed = time.monotonic() - t0
        assert elapsed < budget + SLACK_S, elapsed
        finished = result.scores.count(1.0)
        assert 0 < finished < len(items)
        assert result.scores == [1.0] * finished + [0.0] * (len(items) - finished)
        assert result.timeouts == len(items) - finished and result.errors == 0
        assert any("budget of 2.5 s" in m for m in result.messages), result.messages
        assert [pid for pid in processes if not _gone(pid)] == []  # the worker was stopped
        assert p.score([GOOD]).scores == [1.0]  # the next call has a budget of its own


def test_the_default_budget_grows_with_the_batch():
    p = VerifierPool()
    assert p.budget_s(0) == BATCH_BUDGET_BASE_S
    assert p.budget_s(1000) == pytest.approx(BATCH_BUDGET_BASE_S + 1000 * BATCH_BUDGET_PER_ITEM_S)
    assert VerifierPool(batch_timeout_s=7).budget_s(1000) == 7.0


def test_exceptions_and_bad_scores_are_errors(pool, user_module):
    result = pool.score(
        [
            (f"{user_module}:boom", "now", "", {}),
            GOOD,
            (f"{user_module}:too_big", "", "", {}),
            (f"{user_module}:not_a_number", "", "", {}),
            ("no_such_module_abc:f", "", "", {}),
            ("numeric", "1", "one", {}),  # reference is not a number: the verifier raises
            GOOD,
        ]
    )
    assert result.scores == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert result.errors == 5 and result.timeouts == 0
    text = "\n".join(result.messages)
    assert "RuntimeError: boom now" in text and "outside [0, 1]" in text and "cannot import" in text


def test_a_crashing_worker_counts_as_an_error(pool, user_module):
    result = pool.score([GOOD, (f"{user_module}:die", "", "", {}), GOOD])
    assert result.scores == [1.0, 0.0, 1.0]
    assert result.errors == 1 and "died" in result.messages[0]


def test_pathological_math_input_cannot_hang_the_run(pool):
    pool.score([GOOD])
    processes = _worker_processes(pool)
    t0 = time.monotonic()
    result = pool.score([("math", r"\boxed{9^{9^{9^{9}}}}", "5", {}), ("math", r"\boxed{\frac{1}{2}}", "0.5", {})])
    elapsed = time.monotonic() - t0
    assert result.scores == [0.0, 1.0]
    assert result.timeouts == 1 and result.errors == 0  # sympy was still computing after 1 s: killed
    # Twice the one-restart bound: the first item imports math-verify too, under the same start-up limit.
    assert elapsed < 2 * ONE_RESTART_BOUND_S, elapsed
    assert [pid for pid in processes if not _gone(pid)] == []


def test_bad_items_and_closed_pool_raise(user_module):
    p = VerifierPool(timeout_s=1.0)
    with pytest.raises(TypeError, match="item 0"):
        p.score([("countdown", "3*5+7")])
    assert p.score([GOOD]).scores == [1.0]
    pid = p.worker_pid
    p.close()
    with pytest.raises(RuntimeError, match="close"):
        p.score([GOOD])
    time.sleep(0.1)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the worker is gone


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout_s": 0},
        {"timeout_s": float("inf")},
        {"start_method": "fork"},
        {"batch_timeout_s": 0},
        {"batch_timeout_s": float("nan")},
        {"batch_timeout_s": "60"},
    ],
)
def test_bad_settings(kwargs):
    with pytest.raises(ValueError):
        VerifierPool(**kwargs)
