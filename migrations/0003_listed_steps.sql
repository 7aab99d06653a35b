-- Steps of an S3 store whose manifests the last listing found. A listed step is imported
-- (its rows in steps, layers, tensors, blobs, files) only when something first needs it, so
-- that opening a store on a machine with an empty cache costs one listing, not one download
-- per step (ckptstore.catalog.sync). Local stores list nothing here: their catalog is the truth.
CREATE TABLE listed_steps (
    step INTEGER PRIMARY KEY
);
