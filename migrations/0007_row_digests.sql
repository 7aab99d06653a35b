-- The digest of the rows a read of the step uses, as its manifest gives them (ckptstore.catalog.digests):
-- with a key a tag under the store's key. Checked before a read uses the rows, so that a changed
-- or damaged row is never taken for the manifest's. NULL for steps recorded before this column:
-- their rows are compared with their manifest once, and the digest kept then.
ALTER TABLE steps ADD COLUMN rows_digest BLOB;
