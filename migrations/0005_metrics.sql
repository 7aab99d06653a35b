-- Metrics a commit recorded with its step (commit(metrics={"eval_loss": 2.31})), for `log` and
-- gc's --keep-best. A value that was not finite (a NaN loss) is kept as NULL: never the best.
CREATE TABLE metrics (
    step INTEGER NOT NULL,
    name TEXT NOT NULL,
    value REAL,
    PRIMARY KEY (step, name)
);
