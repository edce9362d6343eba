"""Who is talking on the teacher wire: the shared secret's token and the tokenizer's fingerprint.

Split out of protocol.py (which re-exports these names) to keep that module about messages.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

# The static message every authenticated header carries an HMAC of (see auth_token).
AUTH_CONTEXT = b"recipe_gkd teacher_server v1"


def auth_token(secret: bytes) -> bytes:
    """What a client presents in every header: HMAC-SHA256(secret, AUTH_CONTEXT); b"" without a secret.

    It keeps out anyone without the secret file; it does not encrypt (use a private network).
    """
    return hmac.new(secret, AUTH_CONTEXT, hashlib.sha256).digest() if secret else b""


def read_secret(path: str) -> bytes:
    """The shared secret from teacher.secret_file (surrounding whitespace stripped); b"" when unset."""
    if not path:
        return b""
    with open(path, "rb") as f:
        secret = f.read().strip()
    if not secret:
        raise ValueError(f"teacher.secret_file {path} is empty")
    return secret


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's sorted vocabulary and special tokens (works on any HF tokenizer).

    Duck-typed (get_vocab, all_special_tokens) so that neither side needs transformers to
    import this; the trainer computes it for the student, each replica for the teacher.
    """
    vocab = sorted((str(tok), int(idx)) for tok, idx in tokenizer.get_vocab().items())
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    blob = json.dumps({"vocab": vocab, "special": special}, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
