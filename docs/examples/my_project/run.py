"""Your command line: import the modules that register your entries, then run stare_lightning's.
``python -m my_project.run`` takes what ``python -m stare_lightning`` takes, and knows the names registered here.

Lightning starts the processes of a multi-GPU run with ``python -m my_project.run`` and the same arguments, so
they register the same entries.
"""

import my_project.losses  # noqa: F401 - registers the policy loss "unclipped"
import my_project.rollout  # noqa: F401 - registers the rollout backend "logged_hf"
import my_project.selectors  # noqa: F401 - registers the selector "excess_surprisal"
from stare_lightning.__main__ import main

if __name__ == "__main__":
    main()
