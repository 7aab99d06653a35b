-- Steps: one row per committed step; the row is the commit point of a local store.
CREATE TABLE steps (
    step INTEGER PRIMARY KEY,
    created_at TEXT NOT NULL,
    world_size INTEGER NOT NULL,
    description TEXT NOT NULL,      -- plain JSON: layout and non-tensor state (ckptstore.plainstate)
    layers_saved INTEGER NOT NULL,
    bytes_added INTEGER NOT NULL,
    blobs_added INTEGER NOT NULL
);

-- For every step, every layer and the step whose tensors it uses (itself, or an earlier step
-- for layers a composite commit did not save).
CREATE TABLE layers (
    step INTEGER NOT NULL,
    layer TEXT NOT NULL,
    position INTEGER NOT NULL,
    source_step INTEGER NOT NULL,
    PRIMARY KEY (step, layer)
);
CREATE INDEX layers_by_source ON layers (source_step);

-- The tensors a step saved: whole tensors (start 0) or fragments of the flattened tensor.
CREATE TABLE tensors (
    step INTEGER NOT NULL,
    layer TEXT NOT NULL,
    name TEXT NOT NULL,
    kind TEXT NOT NULL,
    start INTEGER NOT NULL,
    numel INTEGER NOT NULL,
    blob TEXT NOT NULL,
    PRIMARY KEY (step, name, kind, start)
);
CREATE INDEX tensors_by_layer ON tensors (step, layer);
CREATE INDEX tensors_by_blob ON tensors (blob);

-- Every blob the catalog references, with its stored and uncompressed sizes.
CREATE TABLE blobs (
    key TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    raw_size INTEGER NOT NULL,
    first_step INTEGER NOT NULL
);
