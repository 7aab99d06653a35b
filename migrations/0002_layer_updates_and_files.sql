-- Update statistics (ckptstore.stats): each step's layers record how far they moved since the
-- step that last saved them; NULL where it could not be measured (first commit, changed model).
ALTER TABLE layers ADD COLUMN update_size REAL;
ALTER TABLE layers ADD COLUMN update_since INTEGER;

-- The fixed-position float32 sample of each parameter of the layers a step saved: what the
-- next commits compare with, so that no old blob is read back to measure an update.
CREATE TABLE samples (
    step INTEGER NOT NULL,
    layer TEXT NOT NULL,
    name TEXT NOT NULL,
    sample BLOB NOT NULL,
    PRIMARY KEY (step, name)
);

-- Auxiliary files kept with a step (config.json, tokenizer files): where materialize puts
-- them, relative to the output directory, and the stored object (files/<ab>/<key>).
CREATE TABLE files (
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    key TEXT NOT NULL,
    size INTEGER NOT NULL,
    PRIMARY KEY (step, path)
);
