"""What a power loss may leave of a folder, given the file operations run in it and the fsyncs among
them: the rules and the states of the Rust model (``src/crashtest/model.rs``, whose docs give them),
for the tracker and retention, which Python writes. A file's bytes are durable as of its last
fsync; a directory entry created, renamed or removed once its directory is fsynced. Directories are
inodes here too: retention renames a directory, then empties it (the Rust side renames only
files).

``hooked(hook)`` routes the ``os`` calls of ``shardwise._fs`` and ``shardwise.training`` (and
``shutil.rmtree``'s) through ``hook(op, path, src=None)`` before each runs, in this process only
(the crash test runs it in a forked child).
"""

from __future__ import annotations

import builtins
import contextlib
import os
import stat


def _read(path):
    try:
        with builtins.open(path, "rb") as f:
            data = f.read()
        return data, os.stat(path).st_mtime_ns
    except OSError:
        return b"", 0


class Model:
    """Files and directories are inodes; a directory entry is (directory inode, name). A rename of
    a directory moves its one entry, and what is removed inside it stays removed whether or not
    the rename survives (retention renames a victim, then empties it)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.inodes = []  # files: dicts of durable (bytes, mtime) or None, dirty, gone
        self.dirs = 1  # directory inodes: 0 is the root
        self.start = {}  # (directory, name) -> ("f", i) | ("d", j)
        ids = {self.root: 0}
        for d, dirs, files in os.walk(self.root):
            for name in sorted(dirs):
                ids[os.path.join(d, name)] = self.dirs
                self.start[(ids[d], name)] = ("d", self.dirs)
                self.dirs += 1
            for name in files:
                p = os.path.join(d, name)
                self.inodes.append({"durable": _read(p), "dirty": False, "gone": None})
                self.start[(ids[d], name)] = ("f", len(self.inodes) - 1)
        self.now = dict(self.start)
        self.changes = []  # dicts: op, key (directory, name), node (None: removed), synced
        self.ops = []

    def _key(self, path):
        """The entry of ``path`` now: (directory inode, name), or None outside the root."""
        rel = os.path.relpath(os.path.abspath(path), self.root)
        if rel.startswith(".."):
            return None
        if rel == ".":
            return ("root",)
        parts, d = rel.split(os.sep), 0
        for name in parts[:-1]:
            node = self.now.get((d, name))
            if node is None or node[0] != "d":
                return None
            d = node[1]
        return (d, parts[-1])

    def _dir_of(self, path):
        key = self._key(path)
        if key == ("root",):
            return 0
        node = self.now.get(key) if key else None
        return node[1] if node and node[0] == "d" else None

    def _change(self, op, key, node):
        if node is None:
            self.now.pop(key, None)
        else:
            self.now[key] = node
        self.changes.append({"op": op, "key": key, "node": node, "synced": False})

    def _path(self, key):
        return next((p for p, k in self._paths(self.now).items() if k == key), None)

    def _gone(self, key):
        node = self.now.get(key)
        if node and node[0] == "f" and list(self.now.values()).count(node) == 1:
            self.inodes[node[1]]["gone"] = _read(os.path.join(self.root, self._path(key)))

    def record(self, op, path, src=None):
        i = len(self.ops)
        self.ops.append(f"{op} {os.path.relpath(path, self.root)}")
        if op == "fsync-dir":
            d = self._dir_of(path)
            for c in self.changes:
                c["synced"] = c["synced"] or c["key"][0] == d
            return
        key = self._key(path)
        if key is None or key == ("root",):
            return
        node = self.now.get(key)
        if op == "create":
            if node and node[0] == "f":
                self.inodes[node[1]]["dirty"] = True
            else:
                self.inodes.append({"durable": None, "dirty": True, "gone": None})
                self._change(i, key, ("f", len(self.inodes) - 1))
        elif op == "write" and node and node[0] == "f":
            self.inodes[node[1]]["dirty"] = True
        elif op == "fsync" and node and node[0] == "f":
            self.inodes[node[1]].update(durable=_read(path), dirty=False)
        elif op == "rename":
            old = self._key(src)
            if old in self.now:
                moved = self.now[old]
                self._gone(key)
                self._change(i, old, None)
                self._change(i, key, moved)
        elif op in ("unlink", "rmdir") and node:
            self._gone(key)
            self._change(i, key, None)

    def _paths(self, entries):
        """Every path reachable from the root through ``entries`` -> its entry's key."""
        out, todo = {}, [(0, "")]
        children = {}
        for (d, name) in entries:
            children.setdefault(d, []).append(name)
        while todo:
            d, prefix = todo.pop()
            for name in children.get(d, []):
                rel = os.path.join(prefix, name) if prefix else name
                out[rel] = (d, name)
                node = entries[(d, name)]
                if node[0] == "d":
                    todo.append((node[1], rel))
        return out

    def unsynced_ops(self):
        return sorted({c["op"] for c in self.changes if not c["synced"]})

    def dirty_inodes(self):
        reachable = {n[1] for n in self.now.values() if n[0] == "f"}
        return sorted(i for i in reachable if self.inodes[i]["dirty"] or self.inodes[i]["durable"] is None)

    def states(self):
        """As ``Model::states`` of the Rust model: (names, data) pairs besides process death."""
        unsynced = self.unsynced_ops()
        out = [(("prefix", n), ("written",)) for n in range(len(unsynced))]
        if len(unsynced) > 1:
            out += [(("all_but", op), ("written",)) for op in unsynced]
        dirty = self.dirty_inodes()
        if dirty:
            out += [(("all",), ("synced",)), (("prefix", 0), ("synced",))]
            for i in dirty:
                out += [(("all",), ("synced_only", i)), (("all",), ("torn", i))]
        return out

    def describe(self, names, data):
        unsynced = self.unsynced_ops()
        n = {"all": lambda: "every name", "prefix": lambda k: "only synced names" if k == 0 else
             f"names synced and up to {self.ops[unsynced[k - 1]]}",
             "all_but": lambda op: f"every name but {self.ops[op]}"}[names[0]](*names[1:])
        return f"{n}, bytes {' '.join(map(str, data))}"

    def tree(self, names, data):
        unsynced = self.unsynced_ops()

        def kept(c):
            if names[0] == "all" or c["synced"]:
                return True
            if names[0] == "prefix":
                return c["op"] in unsynced[: names[1]]
            return c["op"] != names[1]

        entries = dict(self.start)
        for c in filter(kept, self.changes):
            if c["node"] is None:
                entries.pop(c["key"], None)
            else:
                entries[c["key"]] = c["node"]
        out = {}
        for rel, key in sorted(self._paths(entries).items()):
            node = entries[key]
            out[rel] = None if node[0] == "d" else self._content(node[1], data)
        return out

    def _content(self, i, data):
        inode = self.inodes[i]
        names = [p for p, k in self._paths(self.now).items() if self.now[k] == ("f", i)]
        written = _read(os.path.join(self.root, names[0])) if names else (inode["gone"] or (b"", 0))
        synced = inode["durable"] or (b"", written[1])
        unsynced = inode["dirty"] or inode["durable"] is None
        if (data[0] == "synced" and unsynced) or (data[0] == "synced_only" and data[1] == i):
            return synced
        if data[0] == "torn" and data[1] == i:
            return written[0][: len(written[0]) // 2], written[1]
        return written


def materialize(tree, out):
    os.makedirs(out)
    for rel, content in tree.items():
        path = os.path.join(out, rel)
        if content is None:
            os.mkdir(path)
        else:
            with builtins.open(path, "wb") as f:
                f.write(content[0])
            os.utime(path, ns=(content[1], content[1]))


@contextlib.contextmanager
def hooked(hook):
    """``os.fsync``, ``os.replace``, ``os.rename``, ``os.unlink``, ``os.rmdir`` and the ``open`` of
    ``shardwise._fs`` call ``hook`` first (see the module docs)."""
    import shardwise._fs as fs

    real = {n: getattr(os, n) for n in ("fsync", "replace", "rename", "unlink", "rmdir")}

    def at(p, dir_fd=None):
        base = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.getcwd()
        return os.path.join(base, os.fspath(p))

    def fsync(fd):
        kind = "fsync-dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync"
        hook(kind, os.readlink(f"/proc/self/fd/{fd}"))
        return real["fsync"](fd)

    def mover(name):
        def move(a, b, **kw):
            hook("rename", at(b), at(a))
            return real[name](a, b, **kw)

        return move

    def remover(name, op):
        def remove(p, *, dir_fd=None):
            hook(op, at(p, dir_fd))
            return real[name](p, dir_fd=dir_fd)

        return remove

    class Written:
        def __init__(self, f, path):
            self.f, self.path = f, path

        def write(self, b):
            hook("write", self.path)
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def open_(path, mode="r", *args, **kw):
        if any(c in mode for c in "wax"):
            hook("create", at(path))
            return Written(builtins.open(path, mode, *args, **kw), at(path))
        return builtins.open(path, mode, *args, **kw)

    os.fsync, os.replace, os.rename = fsync, mover("replace"), mover("rename")
    os.unlink, os.rmdir = remover("unlink", "unlink"), remover("rmdir", "rmdir")
    fs.open = open_
    try:
        yield
    finally:
        for n, f in real.items():
            setattr(os, n, f)
        del fs.open
