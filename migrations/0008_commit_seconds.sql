-- How long each commit took, as its manifest records it (seconds from sampling the engine to
-- the manifest: snapshot, encode, hash and writing the packs), for `ckptstore report`. NULL for
-- steps whose manifest predates the figure.
ALTER TABLE steps ADD COLUMN commit_seconds REAL;
