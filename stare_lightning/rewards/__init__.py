"""Verifiable rewards: pure verifier functions, a name registry, and a process pool with hard timeouts.

Built-in verifiers: ``math`` (boxed answer, equivalence through math-verify), ``exact`` (normalised
string match), ``numeric`` (number match with tolerance), ``last_number`` (the last number in the
response, for small models answering in prose), ``countdown`` (expression check with a safe
evaluator) and ``reasoning_gym`` (the reasoning-gym generator's own ``score_answer``, needs that extra).
Any ``package.module:function`` with the signature ``(response, answer, metadata) -> float`` works as well.
Score through :class:`VerifierPool` in training: it is the only place with a hard timeout.
"""

from stare_lightning.lazy_exports import lazy_exports

_EXPORTS = {
    ".message_watch": ("ScoreResult",),
    ".pool": ("VerifierPool",),
    ".registry": ("check_record", "get_verifier", "is_user_verifier_name", "known_verifiers"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
