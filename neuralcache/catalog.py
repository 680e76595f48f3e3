"""The file table the prefetcher reasons over: ids, paths, sizes and sibling order.

The mount owns the real metadata; it mirrors the part the prefetcher needs here. Sibling order
(files of one directory sorted by name) is how the prefetcher guesses "the next shard" and which
files make up a data set.
"""

from __future__ import annotations

import bisect
import posixpath
from dataclasses import dataclass

from neuralcache.blocks import block_count


@dataclass(frozen=True, slots=True)
class FileInfo:
    """One file as the prefetcher sees it; ``path`` is relative to the mount root."""

    file_id: int
    path: str
    size: int

    @property
    def blocks(self) -> int:
        """Number of blocks the file occupies."""
        return block_count(self.size)


def normalize_path(path: str) -> str:
    """Mount-relative form of ``path``: no leading slash, no ``.`` parts, ``/`` separators."""
    return posixpath.normpath("/" + path).lstrip("/")


class Catalog:
    """File ids to paths and sizes, with per-directory name order for next/previous file."""

    def __init__(self, entries: list[tuple[int, str, int]] | None = None) -> None:
        self._by_id: dict[int, FileInfo] = {}
        self._blocks: dict[int, int] = {}  # id -> size in blocks (asked on every read)
        self._by_path: dict[str, int] = {}
        self._dirs: dict[str, list[tuple[str, int]]] = {}  # dir -> sorted (path, id)
        self._neighbours: dict[tuple[int, int], int | None] = {}  # memo, cleared on change
        self._dir_memo: dict[str, tuple[list[int], int]] = {}  # dir -> (ids, bytes), memo
        for file_id, path, size in entries or []:
            self.add(file_id, path, size)

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, file_id: int) -> bool:
        return file_id in self._by_id

    def add(self, file_id: int, path: str, size: int) -> None:
        """Add or update a file (a changed size or path replaces the old entry)."""
        if file_id in self._by_id:
            self.remove(file_id)
        path = normalize_path(path)
        self._neighbours.clear()
        self._dir_memo.clear()
        self._by_id[file_id] = FileInfo(file_id, path, size)
        self._blocks[file_id] = block_count(size)
        self._by_path[path] = file_id
        bisect.insort(self._dirs.setdefault(posixpath.dirname(path), []), (path, file_id))

    def remove(self, file_id: int) -> None:
        """Forget a file; unknown ids are ignored."""
        info = self._by_id.pop(file_id, None)
        if info is None:
            return
        del self._blocks[file_id]
        self._neighbours.clear()
        self._dir_memo.clear()
        self._by_path.pop(info.path, None)
        siblings = self._dirs[posixpath.dirname(info.path)]
        siblings.remove((info.path, file_id))

    def get(self, file_id: int) -> FileInfo | None:
        """The file's entry, or None."""
        return self._by_id.get(file_id)

    def size(self, file_id: int) -> int:
        """File size in bytes (0 for unknown files)."""
        info = self._by_id.get(file_id)
        return info.size if info else 0

    def blocks(self, file_id: int) -> int:
        """File size in blocks (0 for unknown files)."""
        return self._blocks.get(file_id, 0)

    def file_id(self, path: str) -> int | None:
        """Id of the file at mount-relative ``path``."""
        return self._by_path.get(normalize_path(path))

    def _neighbour(self, file_id: int, step: int) -> int | None:
        memo = self._neighbours.get((file_id, step), -1)
        if memo != -1:
            return memo
        info = self._by_id.get(file_id)
        if info is None:
            return None
        siblings = self._dirs[posixpath.dirname(info.path)]
        i = bisect.bisect_left(siblings, (info.path, file_id)) + step
        found = siblings[i][1] if 0 <= i < len(siblings) else None
        self._neighbours[(file_id, step)] = found
        return found

    def next_file(self, file_id: int) -> int | None:
        """The sibling that follows ``file_id`` in name order (the "next shard")."""
        return self._neighbour(file_id, 1)

    def prev_file(self, file_id: int) -> int | None:
        """The sibling that precedes ``file_id`` in name order."""
        return self._neighbour(file_id, -1)

    def _dir(self, directory: str) -> tuple[list[int], int]:
        memo = self._dir_memo.get(directory)
        if memo is None:
            ids = [fid for _, fid in self._dirs.get(directory, [])]
            memo = self._dir_memo[directory] = (ids, sum(self._by_id[f].size for f in ids))
        return memo

    def siblings(self, file_id: int) -> list[int]:
        """Ids of all files in ``file_id``'s directory, in name order (itself included).

        The list is shared (memoised until the catalog changes): do not modify it.
        """
        info = self._by_id.get(file_id)
        return self._dir(posixpath.dirname(info.path))[0] if info else []

    def directory_bytes(self, directory: str) -> int:
        """Total size of the files directly in ``directory``."""
        return self._dir(directory)[1]

    def directory(self, file_id: int) -> str | None:
        """The directory holding ``file_id``."""
        info = self._by_id.get(file_id)
        return posixpath.dirname(info.path) if info else None
