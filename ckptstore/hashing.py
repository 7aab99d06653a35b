"""How a store names its content: the hash behind every content key, and the tags of a keyed store.

An unauthenticated store names content by xxh3-128. It is fast and catches accidents, but
anyone can make other bytes with the same digest, so it proves nothing against someone who
can write the store. A store opened with a key (``ckptstore.open(key=...)``) names content by
keyed BLAKE3 cut to 128 bits, and binds each object that refers to others (a manifest) to its
name with a 256-bit keyed BLAKE3 tag: without the key, no one can make bytes that pass either
check, so a reader holding the key trusts what passes and nothing else.

The user's key is never used as it is: BLAKE3's key derivation turns it into independent
subkeys for content keys, for tags, and for the check value a store's config keeps so that a
wrong key is told apart from a tampered store. No subkey reveals another or the key.
"""

from __future__ import annotations

import hmac
from typing import Protocol

import blake3
import xxhash

MIN_KEY_BYTES = 32
_CONTEXT = "ckptstore 2026-11-25 "  # BLAKE3 derive_key contexts must be unique to the application


class Digest(Protocol):
    """An incremental hash: ``update`` with bytes-like data, then ``hexdigest``."""

    def update(self, data, /) -> object: ...

    def hexdigest(self) -> str: ...


class _Blake3Digest:
    """Keyed BLAKE3 as an incremental hash whose hex digest is 32 digits (128 bits)."""

    __slots__ = ("_hasher",)

    def __init__(self, key: bytes) -> None:
        self._hasher = blake3.blake3(key=key)

    def update(self, data, /) -> None:
        self._hasher.update(data)

    def hexdigest(self) -> str:
        return self._hasher.hexdigest(16)


class ContentHash:
    """The hash a store names content with: ``PLAIN`` (xxh3-128) or ``keyed(key)`` (keyed BLAKE3).

    ``name`` is what the store's config records. A keyed hash also makes ``tag``s. The key
    and its subkeys never appear in a repr, a message or the store.
    """

    __slots__ = ("name", "_content", "_tag", "_check")

    def __init__(self, name: str, content: bytes | None = None, tag: bytes | None = None, check: str = ""):
        self.name = name
        self._content, self._tag, self._check = content, tag, check

    @classmethod
    def keyed(cls, key: bytes) -> ContentHash:
        """The keyed hash of a store whose key is ``key`` (bytes, at least ``MIN_KEY_BYTES``);
        ValueError for a shorter or non-bytes key (callers say which argument it was)."""
        if not isinstance(key, bytes | bytearray | memoryview) or len(key) < MIN_KEY_BYTES:
            raise ValueError(f"a store key is at least {MIN_KEY_BYTES} bytes")
        key = bytes(key)

        def subkey(purpose: str) -> bytes:
            return blake3.blake3(key, derive_key_context=_CONTEXT + purpose).digest()

        return cls("blake3-keyed-128", subkey("content key"), subkey("tag"), subkey("key check").hex()[:32])

    @property
    def authenticated(self) -> bool:
        """Whether this hash needs the key (content keys and tags no one else can make)."""
        return self._content is not None

    @property
    def key_check(self) -> str:
        """What a store's config records to tell whether a later key is the same one: a
        derived value that reveals nothing of the key. Empty for the plain hash."""
        return self._check

    def digest(self) -> Digest:
        """A new incremental hash whose ``hexdigest`` is a content key (32 hex digits)."""
        return xxhash.xxh3_128() if self._content is None else _Blake3Digest(self._content)

    def key_of(self, data) -> str:
        """The content key of bytes-like ``data``."""
        digest = self.digest()
        digest.update(data)
        return digest.hexdigest()

    def tag(self, name: str, data) -> bytes:
        """32 bytes that bind ``data`` to the object ``name``: only the key makes them, and
        bytes moved under another name do not match. ValueError for the plain hash."""
        if self._tag is None:
            raise ValueError("an unauthenticated store has no tags")
        hasher = blake3.blake3(key=self._tag)
        encoded = name.encode()
        hasher.update(len(encoded).to_bytes(8, "little"))
        hasher.update(encoded)
        hasher.update(data)
        return hasher.digest()

    def tag_matches(self, name: str, data, tag: bytes) -> bool:
        """Whether ``tag`` is ``data``'s tag under ``name`` (compared in constant time)."""
        return hmac.compare_digest(self.tag(name, data), bytes(tag))

    def __repr__(self) -> str:
        return f"ContentHash({self.name})"


PLAIN = ContentHash("xxh3-128")
