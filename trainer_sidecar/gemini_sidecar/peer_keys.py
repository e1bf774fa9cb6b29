"""The keys of one peer connection (see gemini_sidecar.protocol): the nonces the header MACs
cover, each payload's one-time key and AES-256-GMAC tag, and the optional AES-256-CTR
encryption with the X25519 key agreement that starts it. The sidecar's only use of
cryptography.
"""

from __future__ import annotations

import hashlib
import hmac

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes

from gemini_sidecar.peer_frames import AuthError, header_mac

_GCM_IV = bytes(12)  # every payload has a key of its own: its IV can be fixed
_PAYLOAD_KEYS = b"gemini peer payload keys"
_CIPHER_KEYS = b"gemini peer cipher keys"
_CTR_START = bytes(16)  # every payload has a key of its own: its counter can start at 0

PayloadCipher = CipherContext  # the AES-256-CTR stream of one payload (encrypts and decrypts)


class PayloadTag:
    """The AES-256-GMAC of one payload, fed in pieces; `update` runs without the GIL."""

    def __init__(self, key: bytes) -> None:
        self._gcm = Cipher(algorithms.AES(key), modes.GCM(_GCM_IV)).encryptor()

    def update(self, data: bytes | memoryview) -> None:
        self._gcm.authenticate_additional_data(data)

    def finalize(self) -> bytes:
        self._gcm.finalize()
        return self._gcm.tag

    @classmethod
    def of(cls, key: bytes, data: bytes | memoryview) -> bytes:
        tag = cls(key)
        tag.update(data)
        return tag.finalize()


def new_key_pair() -> tuple[X25519PrivateKey, bytes]:
    """An ephemeral X25519 key and its public bytes (HELLO, WELCOME)."""
    own = X25519PrivateKey.generate()
    return own, own.public_key().public_bytes_raw()


class SessionKeys:
    """The job token, the connection's nonces (the handshake sets them) and, once both ends
    agreed to encrypt, the cipher keys: every MAC, tag key and cipher of one connection."""

    def __init__(self, token: bytes) -> None:
        self.token = token
        self.nonces = b""
        self._payload_keys = hmac.new(token, _PAYLOAD_KEYS, hashlib.sha256).digest()
        self._cipher_keys: bytes | None = None  # set once the handshake agreed on encryption

    def header_mac(self, direction: int, fields: bytes) -> bytes:
        return header_mac(self.token, self.nonces, direction, fields)

    def payload_key(self, direction: int, seq: int) -> bytes:
        """The one-time GMAC key of the payload of frame `seq` in `direction`: never the
        same twice, as the nonces are new for every connection."""
        label = self.nonces + bytes([direction]) + seq.to_bytes(8, "big")
        return hmac.new(self._payload_keys, label, hashlib.sha256).digest()

    @property
    def encrypted(self) -> bool:
        return self._cipher_keys is not None

    def cipher(self, direction: int, seq: int) -> PayloadCipher | None:
        """The one-time AES-256-CTR stream of the payload of frame `seq` in `direction` (CTR
        encrypts and decrypts alike); None on a connection without encryption."""
        if self._cipher_keys is None:
            return None
        label = self.nonces + bytes([direction]) + seq.to_bytes(8, "big")
        key = hmac.new(self._cipher_keys, label, hashlib.sha256).digest()
        return Cipher(algorithms.AES(key), modes.CTR(_CTR_START)).encryptor()

    def agree(self, own: X25519PrivateKey, theirs: bytes) -> None:
        """Start encryption with the secret `own` shares with the peer's public key."""
        try:
            shared = own.exchange(X25519PublicKey.from_public_bytes(theirs))
        except ValueError as err:  # a low-order point: no shared secret
            raise AuthError(f"unusable peer key: {err}") from err
        self._cipher_keys = hmac.new(self.token, _CIPHER_KEYS + shared, hashlib.sha256).digest()
