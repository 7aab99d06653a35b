-- Weights-only steps (gc --keep-weights-every/--keep-weights-last): the step keeps what exporting
-- its weights needs and no longer resumes. gc rewrites such a step's record as a new manifest
-- generation (manifests/<step>.<generation>.json, create-only); an S3 index re-imports a step
-- whose listed generation is newer than the one it recorded.
ALTER TABLE steps ADD COLUMN weights_only INTEGER NOT NULL DEFAULT 0;
ALTER TABLE steps ADD COLUMN generation INTEGER NOT NULL DEFAULT 0;
ALTER TABLE listed_steps ADD COLUMN generation INTEGER NOT NULL DEFAULT 0;
