-- Format 2: where a layer a step saved is stored, as one compact fragment index per layer
-- (ckptstore.format.layerpacks: its packs, and every fragment of every tensor) instead of a
-- row per fragment in ``tensors``. Like ``tensors``, keyed by the step that saved the layer;
-- a step inheriting it finds it through ``layers.source_step``.
CREATE TABLE layer_packs (
    step INTEGER NOT NULL,
    layer TEXT NOT NULL,
    size INTEGER NOT NULL,        -- stored bytes of its packs
    raw_size INTEGER NOT NULL,    -- bytes of its tensors
    packs BLOB NOT NULL,
    PRIMARY KEY (step, layer)
);
