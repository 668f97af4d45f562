"""VerifierPool: hard timeouts, errors counted, restarts, results in order, shutdown."""

from __future__ import annotations

import os
import time

import pytest

from stare_lightning.rewards import VerifierPool

CD = {"numbers": [3, 5, 7], "target": 22, "ops": "+-*"}
GOOD = ("countdown", "3*5+7", "22", CD)
BAD = ("countdown", "3+5+7", "22", CD)

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
    with VerifierPool(timeout_s=1.0) as p:
        yield p


def test_scores_in_order(pool):
    result = pool.score([GOOD, BAD, GOOD, ("exact", "Yes", "yes", {}), ("numeric", "0.5", "1/2", {})])
    assert result.scores == [1.0, 0.0, 1.0, 1.0, 1.0]
    assert (result.timeouts, result.errors) == (0, 0)
    assert pool.score([]).scores == []


def test_hanging_user_verifier_times_out_and_the_next_call_works(pool, user_module):
    pool.score([GOOD])
    pid_before, starts_before = pool.worker_pid, pool.starts
    t0 = time.monotonic()
    result = pool.score([GOOD, (f"{user_module}:hang", "x", "y", {}), GOOD, BAD])
    elapsed = time.monotonic() - t0
    assert result.scores == [1.0, 0.0, 1.0, 0.0]  # items after the hang are still scored
    assert result.timeouts == 1 and result.errors == 0
    assert "no answer within 1 s" in result.messages[0]
    assert elapsed < 10
    assert pool.starts == starts_before + 1  # killed and restarted once
    assert pool.worker_pid != pid_before
    again = pool.score([GOOD] * 3)
    assert again.scores == [1.0, 1.0, 1.0] and again.timeouts == 0


def test_slow_items_each_get_their_own_deadline(pool, user_module):
    # three items of 0.45 s: 1.35 s in all, but each one is under the 1 s per-call limit
    result = pool.score([(f"{user_module}:sleep_a_bit", "0.45", "", {})] * 3)
    assert result.scores == [1.0, 1.0, 1.0] and result.timeouts == 0


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
    t0 = time.monotonic()
    result = pool.score([("math", r"\boxed{9^{9^{9^{9}}}}", "5", {}), ("math", r"\boxed{\frac{1}{2}}", "0.5", {})])
    assert result.scores == [0.0, 1.0]
    assert result.timeouts == 1 and result.errors == 0  # sympy was still computing after 1 s: killed
    assert time.monotonic() - t0 < 30  # worker restart and sympy import included


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


@pytest.mark.parametrize("kwargs", [{"timeout_s": 0}, {"timeout_s": float("inf")}, {"start_method": "fork"}])
def test_bad_settings(kwargs):
    with pytest.raises(ValueError):
        VerifierPool(**kwargs)


def test_overhead_for_128_countdown_checks_is_small(pool):
    from stare_lightning.rewards import get_verifier

    items = [GOOD, BAD] * 64
    pool.score(items)  # warm
    verify = get_verifier("countdown")
    best_pool = best_direct = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        result = pool.score(items)
        best_pool = min(best_pool, time.perf_counter() - t0)
        t0 = time.perf_counter()
        direct = [verify(*item[1:]) for item in items]
        best_direct = min(best_direct, time.perf_counter() - t0)
    assert result.scores == direct
    assert best_pool - best_direct < 0.05, (best_pool, best_direct)  # measured here: ~0.3 ms
