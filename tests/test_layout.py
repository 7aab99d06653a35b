"""Object names: built in one place, parsed back to what built them, anything else is stray."""

import pytest

from ckptstore.format import layout
from ckptstore.objects import open_objects

KEY = "0123456789abcdef" * 2


def test_names_round_trip():
    assert layout.blob_name(KEY) == f"blobs/01/{KEY}"
    assert layout.file_name(KEY) == f"files/01/{KEY}"
    assert layout.manifest_name(42) == "manifests/000000000042.json"
    assert layout.parse_blob_name(layout.blob_name(KEY)) == KEY
    assert layout.parse_file_name(layout.file_name(KEY)) == KEY
    assert layout.parse_manifest_name(layout.manifest_name(42)) == (42, 0)
    assert layout.parse_manifest_name(layout.manifest_name(10**13)) == (10**13, 0)
    # a record gc rewrote (a weights-only step) is a later generation of the same step
    assert layout.manifest_name(42, 3) == "manifests/000000000042.3.json"
    assert layout.parse_manifest_name(layout.manifest_name(42, 3)) == (42, 3)
    assert layout.parse_manifest_name(layout.manifest_name(2**63 - 1, 2**63 - 1)) == (2**63 - 1, 2**63 - 1)
    # the store's deletion record (format.deletions)
    assert layout.deletions_name(5) == "manifests/deleted.000000000005"
    assert layout.parse_deletions_name(layout.deletions_name(5)) == 5


@pytest.mark.parametrize(
    "name",
    [
        "manifests/notes", "manifests/7.json", "manifests/00000000000x.json", "manifests/000000000007.json.bak",
        "manifests/000000000007.0.json", "manifests/000000000007.01.json", "manifests/000000000007.x.json",
        f"blobs/zz/{KEY}", f"blobs/{KEY}", "blobs/01/" + KEY.upper(), "blobs/01/short", f"files/01/{KEY}/x",
        f"manifests/01/{KEY}",
        # other scripts' digits (str.isdigit takes them, int() refuses "²"), and steps, generations
        # or sequence numbers SQLite cannot hold (2**63 and above)
        "manifests/000000000004.\u00b2.json", "manifests/\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff14.json",
        "manifests/" + "9" * 25 + ".json", f"manifests/{2**63}.json", f"manifests/000000000004.{2**63}.json",
        "manifests/deleted.1", "manifests/deleted.00000000000\u00b2", f"manifests/deleted.{2**63}",
    ],
)  # fmt: skip
def test_names_the_store_does_not_write_parse_as_nothing(name):
    parsed = [layout.parse_blob_name(name), layout.parse_file_name(name), layout.parse_manifest_name(name)]
    assert parsed == [None, None, None] and layout.parse_deletions_name(name) is None


def test_listings_separate_valid_names_from_stray_ones(tmp_path):
    objects = open_objects(str(tmp_path / "store"))
    for name in (layout.blob_name(KEY), "blobs/zz/junk", layout.manifest_name(3), "manifests/notes"):
        objects.put_if_absent(name, b"x")
    blobs = layout.list_blobs(objects)
    assert list(blobs.found) == [KEY] and blobs.stray == ["blobs/zz/junk"]
    manifests = layout.list_manifests(objects)
    assert list(manifests.found) == [3] and manifests.stray == ["manifests/notes"]
    assert manifests.missing([3, 5]) == [5] and list(manifests.unreferenced([5])) == [3]
    assert layout.list_files(objects).found == {}


def test_a_manifest_listing_takes_each_steps_newest_generation(tmp_path):
    objects = open_objects(str(tmp_path / "store"))
    for step, generation in ((3, 0), (3, 2), (3, 1), (4, 0)):
        objects.put_if_absent(layout.manifest_name(step, generation), b"x")
    manifests = layout.list_manifests(objects)
    assert manifests.found[3].name == layout.manifest_name(3, 2) and manifests.generation(3) == 2
    assert manifests.generations == {3: [0, 1, 2], 4: [0]}
