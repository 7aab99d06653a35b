"""What ``verify`` found: problems of packs, blobs and auxiliary files, and the whole report."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlobProblem:
    """A referenced pack or blob that is missing or corrupt, with every (step, layer, name, kind)
    needing it (for a pack, name says whose tensors it holds and kind is ``pack``)."""

    blob: str
    problem: str
    users: list[tuple[int, str, str, str]]

    def describe(self) -> str:
        layer, name, kind = self.users[0][1:]
        if kind == "pack":
            return f"pack {self.blob} ({layer}: {name}) {self.problem}; {_needed_by(self.users)}"
        return f"blob {self.blob} ({layer}: {name} {kind}) {self.problem}; {_needed_by(self.users)}"


@dataclass
class FileProblem:
    """A stored auxiliary file that is missing or corrupt, with every (step, path, size) needing it."""

    key: str
    problem: str
    users: list[tuple[int, str, int]]

    def describe(self) -> str:
        return f"auxiliary file {self.users[0][1]} (stored as {self.key}) {self.problem}; {_needed_by(self.users)}"


def _needed_by(users: list[tuple]) -> str:
    steps = sorted({user[0] for user in users})
    return f"needed by step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"


@dataclass
class VerifyReport:
    """Outcome of ``verify``: problems make it fail; orphans and strays are information only."""

    blobs_checked: int = 0
    bytes_checked: int = 0
    deep: bool = True
    problems: list[BlobProblem] = field(default_factory=list)
    files_checked: int = 0
    file_problems: list[FileProblem] = field(default_factory=list)
    catalog_problems: list[str] = field(default_factory=list)
    manifests_checked: int = 0
    # steps whose manifest cannot be read, or says other than the catalog
    manifest_problems: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    # objects under blobs/, files/ or manifests/ whose names are not names the store writes
    stray_objects: list[str] = field(default_factory=list)
    # manifests and deletion records that cannot be read or are not authentic (what
    # ``verify --quarantine`` moves aside); one a newer ckptstore wrote is not among them
    unreadable_manifests: list[str] = field(default_factory=list)
    # manifests of deleted steps (``format.deletions``): not steps; gc deletes them with a key,
    # and without one keeps them with what they need (``buried_kept``): a record alone frees nothing
    buried_manifests: list[str] = field(default_factory=list)
    buried_kept: bool = False
    # what ``verify --quarantine`` moved: name -> where it is now
    quarantined: dict[str, str] = field(default_factory=dict)
    # unfinished writes (``.tmp``): in flight, or left by killed writers (gc removes old ones)
    temporary: int = 0
    temporary_bytes: int = 0
    # problems seen on the way that were gone when checked again at the end (a gc ran beside)
    passed_on_recheck: int = 0

    @property
    def ok(self) -> bool:
        """True when nothing a committed step needs is missing or damaged."""
        return not (self.problems or self.file_problems or self.catalog_problems or self.manifest_problems)

    def as_dict(self) -> dict:
        """Plain dict for ``--json``."""
        return {
            "ok": self.ok,
            "deep": self.deep,
            "blobs_checked": self.blobs_checked,
            "bytes_checked": self.bytes_checked,
            "problems": [
                {"blob": p.blob, "problem": p.problem, "steps": sorted({u[0] for u in p.users}),
                 "layers": sorted({u[1] for u in p.users})}
                for p in self.problems
            ],
            "files_checked": self.files_checked,
            "file_problems": [
                {"file": p.key, "path": p.users[0][1], "problem": p.problem, "steps": sorted({u[0] for u in p.users})}
                for p in self.file_problems
            ],
            "catalog_problems": self.catalog_problems,
            "manifests_checked": self.manifests_checked,
            "manifest_problems": self.manifest_problems,
            "orphans": self.orphans,
            "stray_objects": self.stray_objects,
            "unreadable_manifests": self.unreadable_manifests,
            "buried_manifests": self.buried_manifests,
            "buried_kept": self.buried_kept,
            "quarantined": self.quarantined,
            "temporary": self.temporary,
            "temporary_bytes": self.temporary_bytes,
            "passed_on_recheck": self.passed_on_recheck,
        }  # fmt: skip
