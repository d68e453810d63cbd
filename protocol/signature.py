"""Request signatures as RocketMQ 4.x's AclClientRPCHook makes them (acl module, AclUtils).

    content   = concat(values of extFields sorted by key, "Signature" left out) as UTF-8, then the body
    Signature = base64(HmacSHA1(secretKey, content))

The broker re-computes it over the extFields it received (PlainAccessValidator.parse), so a
client that signs every extField it sends -- AccessKey included -- verifies. Pure: no I/O.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass

ACCESS_KEY = "AccessKey"
SECRET_KEY = "SecretKey"
SIGNATURE = "Signature"
SECURITY_TOKEN = "SecurityToken"


def signed_content(ext_fields: dict, body: bytes) -> bytes:
    text = "".join(ext_fields[k] for k in sorted(ext_fields) if k != SIGNATURE)
    return text.encode("utf-8") + bytes(body)


def signature(content: bytes, secret_key: str) -> str:
    digest = hmac.new(secret_key.encode("utf-8"), content, hashlib.sha1).digest()
    return base64.b64encode(digest).decode("ascii")


@dataclass(frozen=True)
class Credentials:
    """An accessKey / secretKey pair; ``sign`` is the client's one signing hook."""
    access_key: str
    secret_key: str

    def __post_init__(self) -> None:
        if not self.access_key or not self.secret_key:
            raise ValueError("credentials need both an access key and a secret key")

    def __repr__(self) -> str:      # never print the secret
        return f"Credentials(access_key={self.access_key!r})"

    def sign(self, cmd) -> None:
        fields = cmd.ext_fields
        fields.pop(SIGNATURE, None)
        fields[ACCESS_KEY] = self.access_key
        fields[SIGNATURE] = signature(signed_content(fields, cmd.body_bytes()), self.secret_key)
