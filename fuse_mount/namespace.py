"""The spoke's copy of the hub's namespace: built once from the metadata snapshot, then served
locally, so ``ls -R``, ``stat`` and ``find`` never wait for the WAN."""

from __future__ import annotations

import stat
from dataclasses import dataclass, field
from functools import cached_property

import pyfuse3

from fabric.protocol import MetaEntry

ROOT_INODE = pyfuse3.ROOT_INODE

_KIND_BITS = {"f": stat.S_IFREG, "d": stat.S_IFDIR, "l": stat.S_IFLNK}
READ_ONLY_MASK = 0o555
"""The mount is read-only: every write bit is cleared from the hub's modes."""


class NamespaceError(Exception):
    """The snapshot is not a well-formed tree (a hub bug or a corrupted reply)."""


@dataclass
class Node:
    inode: int
    entry: MetaEntry
    children: dict[str, int] = field(default_factory=dict)  # name -> inode, in hub order
    subdirs: int = 0

    @property
    def is_dir(self) -> bool:
        return self.entry.kind == "d"

    @cached_property
    def listing(self) -> list[tuple[str, int]]:
        """Children in a fixed order, so readdir can resume at an index."""
        return list(self.children.items())


class Namespace:
    """Inodes, attributes and directory listings of one snapshot."""

    def __init__(self, entries: list[MetaEntry]) -> None:
        if not entries or entries[0].path != "" or entries[0].kind != "d":
            raise NamespaceError("snapshot does not start with the root directory")
        self.nodes: dict[int, Node] = {}
        by_path: dict[str, int] = {}
        for i, entry in enumerate(entries):
            inode = ROOT_INODE + i
            node = Node(inode, entry)
            self.nodes[inode] = node
            if entry.path:
                parent_path, _, name = entry.path.rpartition("/")
                parent = by_path.get(parent_path)
                if (parent is None or not self.nodes[parent].is_dir or not name
                        or name in (".", "..")):
                    raise NamespaceError(f"entry {entry.path!r} has no parent directory")
                self.nodes[parent].children[name] = inode
                self.nodes[parent].subdirs += node.is_dir
            by_path[entry.path] = inode
        self._by_path = by_path
        self._by_file_id = {e.file_id: e for e in entries if e.kind == "f"}
        self.total_blocks = sum(-(-e.size // 4096) for e in entries if e.kind == "f")
        self.uid = 0
        self.gid = 0

    def __len__(self) -> int:
        return len(self.nodes)

    def node(self, inode: int) -> Node | None:
        return self.nodes.get(inode)

    def lookup(self, parent: int, name: str) -> Node | None:
        node = self.nodes.get(parent)
        if node is None:
            return None
        child = node.children.get(name)
        return self.nodes[child] if child is not None else None

    def by_path(self, path: str) -> Node | None:
        inode = self._by_path.get(path.strip("/"))
        return self.nodes[inode] if inode is not None else None

    def files(self) -> list[MetaEntry]:
        return [n.entry for n in self.nodes.values() if n.entry.kind == "f"]

    def file(self, file_id: int) -> MetaEntry | None:
        """The regular file with hub id ``file_id`` (the prefetcher names files by id)."""
        return self._by_file_id.get(file_id)

    @property
    def next_free_inode(self) -> int:
        """First inode number the snapshot does not use (the mount's virtual files start here)."""
        return ROOT_INODE + len(self.nodes)

    def attributes(self, node: Node) -> pyfuse3.EntryAttributes:
        """Kernel attributes; the timeouts are long because a snapshot never changes under a
        mount."""
        e = node.entry
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = node.inode
        attr.st_mode = _KIND_BITS[e.kind] | (e.mode & READ_ONLY_MASK)
        attr.st_nlink = 2 + node.subdirs if node.is_dir else 1
        attr.st_size = e.size
        attr.st_blksize = 4096
        attr.st_blocks = -(-e.size // 512)
        attr.st_uid = self.uid
        attr.st_gid = self.gid
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = e.mtime_ns
        attr.attr_timeout = ATTR_TIMEOUT
        attr.entry_timeout = ATTR_TIMEOUT
        attr.generation = 0
        return attr


ATTR_TIMEOUT = 3600.0
"""Seconds the kernel may cache names and attributes: the snapshot is fixed for the mount's life."""
