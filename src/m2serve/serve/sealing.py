"""Thinking signatures and sealed reasoning under one per-server key.

Anthropic's ``thinking`` blocks carry a ``signature`` the server can verify when a client sends the
block back; the Responses API's ``reasoning.encrypted_content`` carries the reasoning itself, opaque to
the client, for stateless (``store: false``) sessions. Both use one key: ``--thinking-signing-key``
(so they survive restarts and work across replicas) or a random key per process.

Standard library only (no runtime dependency on a crypto package):

- signature = base64url(HMAC-SHA256(k_sign, "thinking\\0" + text));
- sealed = base64url(nonce[16] || ciphertext || tag[32]) with ciphertext = text XOR keystream,
  keystream block i = HMAC-SHA256(k_enc, nonce || i) (HMAC as a PRF in counter mode) and
  tag = HMAC-SHA256(k_mac, nonce || ciphertext) (encrypt-then-MAC). The three keys are derived from the
  server key with HMAC-SHA256 and distinct labels.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets


class Sealer:
    """Signs and seals reasoning text under ``key`` (any string; None = a random key)."""

    def __init__(self, key: str | None = None) -> None:
        master = key.encode("utf-8") if key else secrets.token_bytes(32)
        self._sign, self._enc, self._mac = (
            hmac.new(master, label, hashlib.sha256).digest() for label in (b"sign", b"enc", b"mac")
        )

    def sign(self, text: str) -> str:
        """The signature of a thinking block's text."""
        mac = hmac.new(self._sign, b"thinking\0" + text.encode("utf-8"), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).decode("ascii")

    def verify(self, text: str, signature: str | None) -> bool:
        """True when ``signature`` is this server's signature of ``text``."""
        return bool(signature) and hmac.compare_digest(self.sign(text), signature)

    def seal(self, text: str) -> str:
        """``text`` encrypted and authenticated (opaque to the client)."""
        nonce = secrets.token_bytes(16)
        data = text.encode("utf-8")
        ct = bytes(a ^ b for a, b in zip(data, self._keystream(nonce, len(data))))
        tag = hmac.new(self._mac, nonce + ct, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(nonce + ct + tag).decode("ascii")

    def open(self, sealed: str) -> str | None:
        """The text of ``sealed``, or None when it was not sealed under this key (or was altered)."""
        try:
            raw = base64.urlsafe_b64decode(sealed.encode("ascii"))
        except (ValueError, UnicodeEncodeError):
            return None
        if len(raw) < 48:
            return None
        nonce, ct, tag = raw[:16], raw[16:-32], raw[-32:]
        if not hmac.compare_digest(hmac.new(self._mac, nonce + ct, hashlib.sha256).digest(), tag):
            return None
        data = bytes(a ^ b for a, b in zip(ct, self._keystream(nonce, len(ct))))
        return data.decode("utf-8", errors="replace")

    def _keystream(self, nonce: bytes, n: int) -> bytes:
        blocks = (hmac.new(self._enc, nonce + i.to_bytes(8, "big"), hashlib.sha256).digest()
                  for i in range(-(-n // hashlib.sha256().digest_size)))
        return b"".join(blocks)[:n]
