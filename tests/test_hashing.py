"""The content hash: plain xxh3 for unauthenticated stores, keyed BLAKE3 and tags with a key."""

import pytest
import torch

from ckptstore.errors import CorruptError
from ckptstore.format import codec, pack
from ckptstore.hashing import PLAIN, ContentHash

KEY = bytes(range(32))


def test_a_keyed_content_key_depends_on_the_key_and_looks_like_a_plain_one():
    tensor = torch.arange(100, dtype=torch.float32)
    keyed = codec.tensor_key(tensor, content_hash=ContentHash.keyed(KEY))
    assert len(keyed) == 32 and int(keyed, 16) >= 0
    assert keyed == codec.tensor_key(tensor, content_hash=ContentHash.keyed(KEY))
    assert keyed != codec.tensor_key(tensor)
    assert keyed != codec.tensor_key(tensor, content_hash=ContentHash.keyed(bytes(32)))


def test_a_key_shorter_than_32_bytes_or_not_bytes_is_refused():
    with pytest.raises(ValueError, match="at least 32 bytes"):
        ContentHash.keyed(b"x" * 31)
    with pytest.raises(ValueError, match="at least 32 bytes"):
        ContentHash.keyed("a" * 40)


def test_the_key_never_shows_in_a_repr_or_the_check_value():
    keyed = ContentHash.keyed(KEY)
    assert repr(keyed) == "ContentHash(blake3-keyed-128)"
    assert KEY.hex() not in keyed.key_check and len(keyed.key_check) == 32
    assert keyed.key_check == ContentHash.keyed(KEY).key_check != ContentHash.keyed(bytes(32)).key_check
    assert PLAIN.key_check == "" and not PLAIN.authenticated and keyed.authenticated


def test_a_tag_binds_the_bytes_to_their_name():
    keyed = ContentHash.keyed(KEY)
    tag = keyed.tag("manifests/000000000004.json", b"record")
    assert keyed.tag_matches("manifests/000000000004.json", b"record", tag)
    assert not keyed.tag_matches("manifests/000000000002.json", b"record", tag)
    assert not keyed.tag_matches("manifests/000000000004.json", b"recorD", tag)
    assert not ContentHash.keyed(bytes(32)).tag_matches("manifests/000000000004.json", b"record", tag)
    with pytest.raises(ValueError):
        PLAIN.tag("manifests/000000000004.json", b"record")


def test_a_blob_and_a_pack_verify_only_under_the_hash_that_named_them():
    keyed = ContentHash.keyed(KEY)
    tensor = torch.randn(64, 8)
    key, blob = codec.encode(tensor, content_hash=keyed)
    assert torch.equal(codec.decode(blob, key, content_hash=keyed), tensor)
    with pytest.raises(CorruptError, match="does not hash to its key"):
        codec.decode(blob, key)
    pack_key, parts, _ = pack.encode_parts([("w", "fp32", 0, tensor)], content_hash=keyed)
    data = b"".join(bytes(memoryview(part).cast("B")) for part in parts)
    assert [t for _, t in pack.decode(data, pack_key, content_hash=keyed)][0].equal(tensor)
    with pytest.raises(CorruptError, match="does not hash to"):
        pack.decode(data, pack_key)
