"""What reads finished runs: logged metrics (``runs``), the summaries committed beside notebooks (``summaries``),
figures (``plots``) and seed statistics over a sweep (``compare``, its interval from ``student_t``).

Nothing in training imports this package, and it imports nothing of training (tests/test_import_layers.py);
pandas and matplotlib load inside the functions that need them.
"""
