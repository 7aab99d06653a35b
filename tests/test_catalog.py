"""The catalog schema comes only from migrations; newer schemas are refused."""

import pytest
from ckptstore.catalog.migrations import MIGRATION_SET, migration_files, migrations
from sqlite_utils import Database

from ckptstore.catalog import Catalog, digests
from ckptstore.errors import ConflictError, CorruptError, NotFoundError, UnsupportedError
from ckptstore.model import BlobRow, StepRecord, TensorRow


def record(catalog, step, sources):
    catalog.record_step(
        StepRecord(
            step=step, created_at="2026-01-01T00:00:00+00:00", world_size=1, description="{}",
            layer_sources=sources,
            tensors=[TensorRow(source, layer, f"{layer}.w", "fp32", 0, 4, f"k{source}{layer}")
                     for layer, source in sources.items()],
            blobs=[BlobRow(f"k{source}{layer}", 10, 16) for layer, source in sources.items()],
            added=(1, 10),
        ),
    )  # fmt: skip


def test_a_new_catalog_gets_every_migration(tmp_path):
    catalog = Catalog(tmp_path / "c.db")
    applied = [m.name for m in migrations().applied(catalog.db)]
    assert applied == [name for name, _ in migration_files()]
    assert {"steps", "layers", "tensors", "blobs"} <= set(catalog.db.table_names())


def test_a_catalog_with_a_newer_schema_is_refused(tmp_path):
    Catalog(tmp_path / "c.db").close()
    db = Database(tmp_path / "c.db")
    db["_sqlite_migrations"].insert(
        {"migration_set": MIGRATION_SET, "name": "9999_future", "applied_at": "x"}
    )
    db.close()
    with pytest.raises(UnsupportedError, match="9999_future"):
        Catalog(tmp_path / "c.db")


def test_a_failing_migration_rolls_back_and_stays_pending(tmp_path):
    schema = migrations()

    @schema(name="9998_broken")
    def broken(db):
        db.execute("CREATE TABLE half_done (x)")
        raise RuntimeError("boom")

    db = Database(tmp_path / "c.db")
    with pytest.raises(RuntimeError):
        schema.apply(db)
    assert "half_done" not in db.table_names()
    assert [m.name for m in schema.pending(db)] == ["9998_broken"]


def test_steps_record_their_layer_sources(tmp_path):
    catalog = Catalog(tmp_path / "c.db")
    record(catalog, 4, {"a": 4, "b": 4})
    record(catalog, 6, {"a": 4, "b": 6})
    assert catalog.steps() == [4, 6]
    assert catalog.sources(6) == {"a": 4, "b": 6}
    assert catalog.latest_step(before=6) == 4
    users = catalog.referenced_blobs()
    assert sorted(step for step, *_ in users["k4a"]) == [4, 6]
    with pytest.raises(ConflictError):
        record(catalog, 6, {"a": 6, "b": 6})
    with pytest.raises(NotFoundError, match="step 5 does not exist; committed steps: 4, 6"):
        catalog.sources(5)


@pytest.mark.parametrize(
    "change",
    [
        "UPDATE steps SET description = '{\"lr\":0.007}' WHERE step = 6",
        "UPDATE steps SET world_size = 2 WHERE step = 6",
        "UPDATE layers SET source_step = 6 WHERE step = 6 AND layer = 'a'",
        "UPDATE layers SET position = 1 - position WHERE step = 6",
        "UPDATE tensors SET numel = 5 WHERE step = 4 AND layer = 'a'",  # a row step 6 inherits
        "DELETE FROM tensors WHERE step = 6",
        "INSERT INTO files VALUES (6, 'extra.json', 'ff', 1)",
        "UPDATE metrics SET value = 0.1 WHERE step = 6",
    ],
)
def test_a_changed_catalog_row_is_refused_by_the_reads_that_use_it(tmp_path, change):
    catalog = Catalog(tmp_path / "c.db")
    record(catalog, 4, {"a": 4, "b": 4})
    record(catalog, 6, {"a": 4, "b": 6})
    catalog.db.execute("INSERT INTO metrics VALUES (6, 'loss', 0.5)")  # as recorded with the step
    catalog.db.execute("UPDATE steps SET rows_digest = NULL WHERE step = 6")
    catalog.close()
    catalog = Catalog(tmp_path / "c.db")
    catalog.manifest_parts = lambda step, generation: digests.record_parts(
        StepRecord(
            step=6, created_at="2026-01-01T00:00:00+00:00", world_size=1, description="{}",
            layer_sources={"a": 4, "b": 6},
            tensors=[TensorRow(source, layer, f"{layer}.w", "fp32", 0, 4, f"k{source}{layer}")
                     for layer, source in {"a": 4, "b": 6}.items()],
            blobs=[], metrics={"loss": 0.5},
        )
    )  # fmt: skip
    assert catalog.sources(6) == {"a": 4, "b": 6}  # checked against the manifest, its digest kept
    catalog.close()

    catalog = Catalog(tmp_path / "c.db")
    catalog.db.execute(change)
    for read in (catalog.description, catalog.sources, catalog.files, catalog.layer_rows):
        with pytest.raises(CorruptError, match="rows of step 6 are not what its manifest says"):
            read(6)
    if "step = 4" in change:  # step 4's own row: step 4 is refused too
        with pytest.raises(CorruptError, match="rows of step 4"):
            catalog.tensors(4, ["a"])
    else:
        assert catalog.sources(4) == {"a": 4, "b": 4} and len(catalog.tensors(4)) == 2
