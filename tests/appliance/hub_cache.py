"""A Hugging Face Hub cache laid out by hand, in the standard layout, for offline resolution tests:

    <cache>/models--ORG--NAME/refs/<ref>                       the commit hash (no newline)
    <cache>/models--ORG--NAME/snapshots/<commit>/<file>        -> ../../blobs/<sha256 of file>
    <cache>/models--ORG--NAME/blobs/<sha256 of file>           the file's bytes

Used by tests/appliance/test_hub.py and tests/e2e/test_cli.py.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path


def commit_hash(label: str) -> str:
    """A stable 40-hex commit id for a label (the Hub's commits are git SHA-1s)."""
    return hashlib.sha1(label.encode()).hexdigest()


def add_snapshot(
    cache: Path,
    repo_id: str,
    checkpoint: Path,
    *,
    refs: Iterable[str] = ("main",),
    label: str = "",
    skip: Iterable[str] = (),
) -> Path:
    """Adds `checkpoint`'s files (but those named in `skip`) as one commit of `repo_id`, pointed to
    by each of `refs`; returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = commit_hash(label or f"{repo_id}:{checkpoint}")
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    skipped = set(skip)
    for source in sorted(checkpoint.iterdir()):
        if not source.is_file() or source.name in skipped:
            continue
        blob = repo / "blobs" / hashlib.sha256(source.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(source, blob)
        link = snapshot / source.name
        if not link.is_symlink():
            os.symlink(os.path.relpath(blob, snapshot), link)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
