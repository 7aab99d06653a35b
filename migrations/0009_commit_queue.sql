-- What the queue of a non-blocking commit recorded with its step, for `log` and `report`: the
-- seconds it held training (its call, and the optimizer step's wait for its snapshot copy), and
-- the steps since the previous commit that were not committed, a JSON list of [step, "replaced"
-- or "skipped"]. NULL for blocking commits and for steps whose manifest predates the figures.
ALTER TABLE steps ADD COLUMN stall_seconds REAL;
ALTER TABLE steps ADD COLUMN not_committed TEXT;
