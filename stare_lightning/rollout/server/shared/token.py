"""The rollout servers' credential, as both sides check it: the trainer before it hands a token to a server or a
client (``connect.py``, ``launch.py``, ``serve``), the server's token guard before it starts (``in_vllm/auth.py``)."""

from __future__ import annotations

TOKEN_ENV = "STARE_LIGHTNING_SERVER_TOKEN"
# secrets.token_urlsafe(32) gives 43 characters; 32 printable characters chosen at random are beyond guessing, a
# short one (a word, a PIN) is not, and the token is all that stands between a network and the weight routes.
MIN_TOKEN_CHARS = 32


def check_token(token: str | None, where: str) -> None:
    """Refuse a token that is missing, shorter than ``MIN_TOKEN_CHARS`` or not plain printable characters (a header
    value cannot carry whitespace or control characters intact), naming ``where`` it came from, never the token."""
    if not token or not token.strip():
        raise ValueError(
            f"{where} is blank: set it to a secret, e.g. $(python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))')"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"{where} has {len(token)} characters; a server credential needs at least {MIN_TOKEN_CHARS}, e.g. "
            "$(python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    if not token.isprintable() or any(character.isspace() for character in token):
        raise ValueError(
            f"{where} holds whitespace or control characters: a credential is one word of printable characters"
        )
