"""What ranks the tokens STARE may select: one file per selector, each registered under the name
``algorithm.stare.selector`` takes.

A selector maps the tokens' statistics (``RankingInputs``) to a score per token, highest first; ``stare.py`` then
takes the top P of each advantage sign by that score. An entry also says what it reads, so the step computes it:
the entropy sensitivity Phi (``needs_phi``), the per-token entropy (``needs_entropy``), and whether its ranking
follows the policy at all (``follows_policy``: a selection that does not is made once per step, never again
after an optimizer step). Adding a selector is one file here and its import below.
"""

from stare_lightning.algorithms.selectors import entropy, sensitivity, surprisal, uniform  # noqa: F401 - they register
from stare_lightning.algorithms.selectors.base import STARE_SELECTORS, RankingInputs, Selector, required

__all__ = ["STARE_SELECTORS", "RankingInputs", "Selector", "required"]
