"""What reads finished runs: logged metrics (``runs``), the summaries committed beside notebooks (``summaries``),
figures (``plots``) and seed statistics over a sweep (``compare``, its interval from ``student_t``).

It imports nothing of training, and the training step never imports it; the one exception on the training side
is the end-of-fit summary (``callbacks/run_summary.py``), which loads the run it closes (``runs``) and plots it
(``plots``) after the last step. ``tests/test_import_layers.py`` holds that order: callbacks sit above analysis,
everything the step runs below it. pandas and matplotlib load inside the functions that need them.
"""
