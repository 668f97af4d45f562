"""The extension guides' example package: a verifier and its task, a STARE selector, a policy loss, a callback, and
the command line that registers them (docs/guides/extending.md; tests/test_extending_examples.py runs each)."""
