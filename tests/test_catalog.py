"""The catalog schema comes only from migrations; newer schemas are refused."""

import pytest
from ckptstore.catalog.migrations import MIGRATION_SET, migration_files, migrations
from sqlite_utils import Database

from ckptstore.catalog import Catalog
from ckptstore.errors import ConflictError, NotFoundError, UnsupportedError
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
