"""The selectors STARE ranks its tokens with: each against the slow loop of test_algorithms_stare, the random
control's counts, seeding and uniformity, and when each selection is made."""

from __future__ import annotations

import pytest
import torch

from stare_lightning.algorithms import STAREConfig, stare_token_weights
from stare_lightning.algorithms.selectors import STARE_SELECTORS
from stare_lightning.step.selection import SelectionTiming, selection_timing
from tests.test_algorithms_stare import k_of, loop_weights_segments, one_part_weights, random_batch


def test_every_selector_is_registered_with_what_it_reads():
    assert set(STARE_SELECTORS.names()) == {"surprisal", "sensitivity", "entropy", "random"}
    assert [name for name in STARE_SELECTORS.names() if STARE_SELECTORS[name].needs_phi] == ["sensitivity"]
    assert [name for name in STARE_SELECTORS.names() if STARE_SELECTORS[name].needs_entropy] == ["entropy"]
    assert [name for name in STARE_SELECTORS.names() if not STARE_SELECTORS[name].follows_policy] == ["random"]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("variant", ["O1", "C2"])
def test_entropy_selector_ranks_by_the_predictive_entropy(seed, variant):
    """The loop ranks by the value it is handed as the sensitivity column: pass the entropy there."""
    lp, adv, mask, _ = random_batch(seed)
    entropy = torch.randint(0, 5, lp.shape, generator=torch.Generator().manual_seed(seed + 7)).float() * 0.3
    weights, stats = stare_token_weights(
        lp, adv, mask, variant=variant, top_ratio=0.3, w=1.4, m=0.6, selector="entropy", entropy=entropy
    )
    want, selected = loop_weights_segments(
        [(lp, adv, mask, entropy)], lambda p, r: 0, 0.3, variant, 1.4, 0.6, True, use_sensitivity=True
    )
    assert torch.equal(weights, want[0]) and torch.equal(stats.selected, selected[0])
    surprisal, _ = stare_token_weights(lp, adv, mask, variant=variant, top_ratio=0.3, w=1.4, m=0.6)
    assert not torch.equal(surprisal, weights)  # the two rankings differ on this batch: the test can fail


def test_entropy_selector_needs_the_entropy():
    lp, adv, mask, _ = random_batch(0)
    with pytest.raises(ValueError, match="entropy=None is not allowed with selector='entropy'"):
        stare_token_weights(lp, adv, mask, selector="entropy")


def _random(seed, lp, adv, mask, **kwargs):
    generator = torch.Generator().manual_seed(seed)
    return stare_token_weights(lp, adv, mask, selector="random", generator=generator, **kwargs)


def test_random_selector_takes_the_same_counts_and_is_seeded():
    lp, adv, mask, _ = random_batch(3)
    _, reference = stare_token_weights(lp, adv, mask, top_ratio=0.25)
    first_w, first = _random(11, lp, adv, mask, top_ratio=0.25)
    again_w, again = _random(11, lp, adv, mask, top_ratio=0.25)
    _, other = _random(12, lp, adv, mask, top_ratio=0.25)
    for stats in (first, other):
        assert stats.selected_pos == reference.selected_pos == k_of(0.25, int(reference.num_pos))
        assert stats.selected_neg == reference.selected_neg
        assert not (stats.selected & ~mask).any()
    assert torch.equal(first.selected, again.selected) and torch.equal(first_w, again_w)
    assert not torch.equal(first.selected, other.selected)


def test_random_selector_picks_every_token_of_a_sign_equally_often():
    """Over many seeds each positive token is chosen k / n of the time (a binomial bound at 5 sd)."""
    lp, adv, mask, _ = random_batch(5, ties=False)
    positive = mask & (adv.unsqueeze(1) > 0)
    n, draws = int(positive.sum()), 3000
    k = k_of(0.2, n)
    counts = torch.zeros(lp.shape)
    for seed in range(draws):
        counts += _random(seed, lp, adv, mask, top_ratio=0.2)[1].selected & positive
    p = k / n
    bound = 5 * (draws * p * (1 - p)) ** 0.5
    assert ((counts[positive] - draws * p).abs() < bound).all(), (counts[positive], draws * p)
    # Surprisal, by contrast, always takes the same k: the frequencies are 0 or `draws`.
    _, surprisal = stare_token_weights(lp, adv, mask, top_ratio=0.2)
    assert int((surprisal.selected & positive).sum()) == k


def test_random_selector_needs_a_generator():
    lp, adv, mask, _ = random_batch(0)
    with pytest.raises(ValueError, match="generator=None is not allowed with selector='random'"):
        one_part_weights(lp, adv, mask, selector="random")


@pytest.mark.parametrize(
    "selector, scope, source, timing",
    [
        ("entropy", "step", "current", SelectionTiming.OPTIMIZER_STEP),
        ("entropy", "sequence", "current", SelectionTiming.MICRO_BATCH),
        ("entropy", "step", "old", SelectionTiming.STEP),
        ("random", "step", "current", SelectionTiming.STEP),  # drawn once: the policy does not enter its ranking
        ("random", "group", "current", SelectionTiming.STEP),
        ("random", "sequence", "current", SelectionTiming.STEP),
        ("random", "micro_batch", "current", SelectionTiming.MICRO_BATCH),
    ],
)
def test_when_each_selector_selects(selector, scope, source, timing):
    stare = STAREConfig(enabled=True, selector=selector, scope=scope, surprisal_source=source)
    assert selection_timing(stare) is timing
