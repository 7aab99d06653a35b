"""The catalog: a SQLite index of the store's steps (``index``), kept in step with the
manifests or rebuilt from them (``sync``). Its schema changes only through ``migrations``."""

from .index import Catalog

__all__ = ["Catalog"]
