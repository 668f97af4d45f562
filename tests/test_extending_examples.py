"""The extension guide's examples (docs/examples/my_project, shown whole in docs/guides/extending.md): the selector
ranks a real batch as its definition says, the policy loss inside ``policy_loss`` equals a hand-written loop, the
verifier scores completions in the verifier worker, and a 2-step fit started by the example's own command line uses
the selector, the loss and the callback."""

from __future__ import annotations

import csv
import importlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stare_lightning.algorithms.policy_losses import POLICY_LOSSES
from stare_lightning.algorithms.selectors import STARE_SELECTORS
from stare_lightning.cli import compose, prepare_config
from stare_lightning.rollout.backends import ROLLOUT_BACKENDS
from tests.test_fit import FAST  # the fits' short settings: their cached cold start is shared

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "docs" / "examples"
GUIDE = REPO / "docs" / "guides" / "extending.md"
# The random tiny model's distributions are nearly flat (entropy 4.62 +- 0.003 nats): at this temperature their
# entropies differ from token to token as a trained model's do, so ranking by excess surprisal is not surprisal's.
TEMPERATURE = 0.05


@pytest.fixture
def my_project(monkeypatch):
    """The example package, imported as a user's would be; the registries and modules are restored after."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    saved = {registry: dict(registry._entries) for registry in (STARE_SELECTORS, POLICY_LOSSES)}
    backends = dict(ROLLOUT_BACKENDS)
    yield importlib.import_module("my_project")
    for registry, entries in saved.items():
        registry._entries.clear()
        registry._entries.update(entries)
    ROLLOUT_BACKENDS.clear()
    ROLLOUT_BACKENDS.update(backends)
    for name in [name for name in sys.modules if name == "my_project" or name.startswith("my_project.")]:
        del sys.modules[name]


def _config(tmp_path, overrides):
    return prepare_config(compose([f"output_dir={tmp_path}", *overrides]))[1]


def test_the_guide_shows_every_example_file_as_it_is():
    text = GUIDE.read_text()
    shown = dict(re.findall(r"<!-- example: (\S+) -->\n```python\n(.*?)```\n", text, flags=re.DOTALL))
    files = sorted(p.name for p in (EXAMPLES / "my_project").glob("*.py") if p.name != "__init__.py")
    assert sorted(Path(name).name for name in shown) == files
    for name, code in shown.items():
        assert code == (EXAMPLES / name).read_text(), f"{name}: the guide's code differs from the file"


# ------------------------------------------------------------------------------------------------------ selector
def _real_batch(tiny_dir):
    """Countdown prompts and solutions through the tiny model: per-token log-probs and entropy of the solutions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stare_lightning.algorithms.token_stats import token_stats_from_logits
    from stare_lightning.data.tasks import build_records

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    records = build_records("countdown", "train", 6, seed=3, val_size=0)
    rows = [(tokenizer.encode(r.prompt), tokenizer.encode(r.metadata["solution"])) for r in records]
    width = max(len(p) + len(s) for p, s in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    for i, (prompt, solution) in enumerate(rows):
        ids[i, : len(prompt) + len(solution)] = torch.tensor(prompt + solution)
        mask[i, len(prompt) - 1 : len(prompt) + len(solution) - 1] = True  # positions that predict the solution
    with torch.no_grad():
        stats = token_stats_from_logits(model(ids).logits[:, :-1], ids[:, 1:], temperature=TEMPERATURE)
    return stats.logprobs, stats.entropy, mask


def _by_definition(score, advantages, mask, top_ratio):
    """For each advantage sign: its valid tokens by score, highest first (the earlier token on a tie), the first
    ceil(P n) of them."""
    selected = torch.zeros_like(mask)
    for sign in (1, -1):
        tokens = [(b, t) for b, t in mask.nonzero().tolist() if sign * advantages[b] > 0]
        tokens.sort(key=lambda bt: (-float(score[bt]), bt))
        for b, t in tokens[: math.ceil(top_ratio * len(tokens))]:
            selected[b, t] = True
    return selected


def test_the_selector_ranks_a_real_batch_by_its_definition(my_project, tiny_dir):
    from stare_lightning.algorithms import stare_token_weights

    importlib.import_module("my_project.selectors")
    logprobs, entropy, mask = _real_batch(tiny_dir)
    advantages = torch.tensor([1.0, -0.5, 0.8, -1.2, 0.3, -0.7])
    weights, stats = stare_token_weights(
        logprobs,
        advantages,
        mask,
        variant="C2",
        top_ratio=0.2,
        w=1.3,
        m=0.7,
        selector="excess_surprisal",
        entropy=entropy,
    )
    want = _by_definition(-logprobs - entropy, advantages, mask, 0.2)
    assert torch.equal(stats.selected, want)
    positive = advantages[:, None] > 0
    assert torch.equal(weights, torch.where(want, torch.where(positive, 1.3, 0.7), 1.0))
    _, surprisal = stare_token_weights(logprobs, advantages, mask, variant="C2", top_ratio=0.2)
    assert not torch.equal(surprisal.selected, want)  # the two rankings differ on this batch: the test can fail
    with pytest.raises(ValueError, match="entropy=None is not allowed with selector='excess_surprisal'"):
        stare_token_weights(logprobs, advantages, mask, selector="excess_surprisal")


def test_the_selector_is_chosen_by_name_and_the_step_computes_what_it_reads(my_project, tmp_path):
    from stare_lightning.step.selection import TokenSelection

    overrides = ["algorithm=stare_o1", "algorithm.stare.selector=excess_surprisal"]
    with pytest.raises(ValueError, match=r"algorithm.stare.selector='excess_surprisal' is not allowed") as refused:
        _config(tmp_path, overrides)  # not imported yet: not registered
    assert f"```text\n{refused.value}\n```" in GUIDE.read_text()  # the guide quotes the message as it is
    importlib.import_module("my_project.selectors")
    run = _config(tmp_path, overrides)
    selection = TokenSelection.resolve(run.algorithm.stare, group_size=run.rollout.n)
    assert selection.needs_entropy and not selection.needs_phi and selection.reselect
    with pytest.raises(ValueError, match="'excess_surprisal' is registered twice"):
        STARE_SELECTORS.register("excess_surprisal")(STARE_SELECTORS["surprisal"])


# --------------------------------------------------------------------------------------------------- policy loss
def test_the_policy_loss_in_policy_loss_equals_a_hand_written_loop(my_project, tmp_path):
    from stare_lightning.algorithms.config_groups import EntropyControlConfig, KLConfig, PolicyLossConfig
    from stare_lightning.algorithms.objective import LossSpec, policy_loss
    from stare_lightning.algorithms.surrogates import LossNormalizer

    importlib.import_module("my_project.losses")
    g = torch.Generator().manual_seed(0)
    logprobs = (-3 * torch.rand(4, 7, generator=g, dtype=torch.float64)).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(4, 7, generator=g, dtype=torch.float64)
    advantages = torch.tensor([1.5, -0.5, 0.0, -2.0], dtype=torch.float64)
    mask = torch.rand(4, 7, generator=g) > 0.3
    weights = torch.where(torch.rand(4, 7, generator=g) > 0.7, 1.3, 1.0).to(torch.float64)
    spec = LossSpec(
        policy_loss=PolicyLossConfig(name="unclipped"),
        entropy_control=EntropyControlConfig(),
        kl=KLConfig(),
        aggregation="token-mean",
        entropy_coef=0.0,
    )
    loss, stats = policy_loss(
        logprobs, old, advantages, mask, spec, LossNormalizer.from_mask(mask), token_weights=weights
    )
    loss.backward()

    total, grad, n = 0.0, torch.zeros(4, 7, dtype=torch.float64), int(mask.sum())
    for b in range(4):
        for t in range(7):
            if mask[b, t]:
                ratio = math.exp(float(logprobs[b, t].detach()) - float(old[b, t]))
                total += -float(weights[b, t]) * float(advantages[b]) * ratio / n
                grad[b, t] = -float(weights[b, t]) * float(advantages[b]) * ratio / n
    assert float(loss.detach()) == pytest.approx(total, rel=1e-12)
    assert torch.allclose(logprobs.grad, grad, rtol=1e-12, atol=0)
    assert float(stats["clip_low"]) == float(stats["clip_high"]) == 0 and float(stats["tokens"]) == n

    chosen = ["algorithm.policy_loss.name=unclipped", "algorithm.policy_loss.dual_clip_c=null"]
    assert _config(tmp_path, chosen).algorithm.policy_loss.name == "unclipped"
    # The default recipe (stare_o1) sets PPO's dual clip, which means nothing to another loss: refused, not ignored.
    with pytest.raises(ValueError, match="dual_clip_c=10.0 does nothing with algorithm.policy_loss.name=unclipped"):
        _config(tmp_path, chosen[:1])


# ------------------------------------------------------------------------------------------------------ verifier
def test_the_verifier_scores_completions_in_the_verifier_worker(my_project, tmp_path):
    from stare_lightning.data.readers import DataError
    from stare_lightning.data.records import load_records
    from stare_lightning.rewards import VerifierPool

    tasks = importlib.import_module("my_project.tasks")
    path = tasks.write_jsonl(tasks.make_records(8, seed=1), tmp_path / "sort.jsonl")
    records = load_records(path, user_verifiers=[tasks.VERIFIER])
    assert len(records) == 8 and {r.verifier for r in records} == {tasks.VERIFIER}
    with pytest.raises(DataError, match="the config does not name; list it in data.user_verifiers"):
        load_records(path)  # a record may name a user verifier only when the config lists it
    broken = tasks.make_records(3, seed=1)
    broken[2]["answer"] = "1 2 3 4"
    with pytest.raises(DataError, match="line 3.*is not metadata.numbers"):
        load_records(tasks.write_jsonl(broken, tmp_path / "broken.jsonl"), user_verifiers=[tasks.VERIFIER])

    record = records[0]
    right, numbers = record.answer, record.metadata["numbers"]
    completions = [
        f" {right}\n",  # what the task asks for
        f" {right}\nSort: 1 2 3 4",  # the same, and the model carries on: only the first line counts
        f" {' '.join(map(str, numbers))}",  # the numbers as given
        f" {' '.join(reversed(right.split()))}",  # decreasing order
        " I think it is " + right.replace(" ", ", "),  # prose around the right numbers
        "",
    ]
    with VerifierPool(timeout_s=5.0) as pool:
        result = pool.score([(record.verifier, c, record.answer, record.metadata) for c in completions])
    assert result.scores == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0] and (result.timeouts, result.errors) == (0, 0)

    run = _config(tmp_path, ["data=files", f"data.train_files=[{path}]", f"data.user_verifiers=[{tasks.VERIFIER}]"])
    assert run.data.user_verifiers == [tasks.VERIFIER]


# --------------------------------------------------------------------------------------------- the command line
def _metrics(run_dir: Path) -> list[dict[str, float]]:
    with open(run_dir / "logs" / "metrics.csv") as handle:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(handle)]


@pytest.mark.slow
def test_a_fit_from_the_examples_command_line_uses_the_selector_the_loss_and_the_callback(tmp_path, model_cache):
    """``python -m my_project.run fit ...`` as the guide writes it: 2 steps, the gate held open, generated by the
    example's rollout backend."""
    journal = tmp_path / "journal.jsonl"
    args = [
        "fit",
        f"output_dir={tmp_path}",
        *FAST,
        "trainer.max_steps=2",
        "algorithm=stare_o1",
        "algorithm.stare.selector=excess_surprisal",
        "algorithm.policy_loss.name=unclipped",
        "algorithm.policy_loss.dual_clip_c=null",
        "algorithm.stare.target_entropy=10.0",
        "allowed_targets=[my_project.callbacks.MetricsJournal]",
        "+callbacks.journal._target_=my_project.callbacks.MetricsJournal",
        "+callbacks.journal.path=${output_dir}/journal.jsonl",
        "+callbacks.journal.keys=[train/reward/mean,train/stare/gate_on,train/stare/selected_frac/pos]",
        "rollout.backend=logged_hf",
    ]
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES), "STARE_LIGHTNING_CACHE": model_cache}
    done = subprocess.run(
        [sys.executable, "-m", "my_project.run", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The example's rollout backend generated every step's samples (8 prompts x 6) and the validation's (x 2).
    log = "".join(path.read_text() for path in tmp_path.rglob("stare_lightning.log"))
    calls = re.findall(r"logged_hf: (\d+) prompts, (\d+) samples", log)
    per_prompt = [int(samples) // int(prompts) for prompts, samples in calls]
    assert per_prompt.count(6) >= 2 and set(per_prompt) <= {6, 2}, calls
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    logged = sorted((row for row in _metrics(tmp_path) if "train/reward/mean" in row), key=lambda row: row["step"])
    assert len(logged) == len(lines)
    for line, row in zip(lines, logged):
        assert {key: pytest.approx(row[key], rel=1e-6) for key in line if key != "step"} == {
            key: value for key, value in line.items() if key != "step"
        }
        assert line["train/stare/gate_on"] == 1.0 and line["train/stare/selected_frac/pos"] > 0
