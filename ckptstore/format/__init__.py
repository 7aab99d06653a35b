"""Everything about bytes at rest: object names, the store config and version rule, the blob
codec, manifests, and non-tensor state as JSON."""
