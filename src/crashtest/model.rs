//! What a power loss may leave of a local folder, given the operations run in it
//! ([`crate::failpoint::Op`]) and the `fsync`s among them. The model follows POSIX, as ALICE
//! (Pillai et al., OSDI '14) does: a file's bytes are durable as of its last `fsync`; a directory
//! entry created, renamed or removed is durable once its directory is `fsync`ed. Everything else
//! may or may not have reached the disk.
//!
//! The folder's content at the start is durable (the test makes it before the operation). Files
//! are inodes with names: a rename or link moves or adds a name, never content, so a rename that
//! survives while the bytes of its file did not is a state the model produces.
//!
//! [`Model::states`] lists the durable states at a crash point; see its doc for which, and why
//! they cover the orderings that matter.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::failpoint::Op;

/// A file's bytes and modification time (a part records data files' sizes and mtimes, so a state
/// keeps them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Content {
    /// The bytes.
    pub data: Vec<u8>,
    /// The modification time.
    pub mtime: SystemTime,
}

impl Content {
    /// What `path` holds now (empty when unreadable).
    pub fn read(path: &Path) -> Content {
        let data = std::fs::read(path).unwrap_or_default();
        let mtime = std::fs::metadata(path)
            .and_then(|m| m.modified())
            .unwrap_or(SystemTime::UNIX_EPOCH);
        Content { data, mtime }
    }
}

/// A file: what is durable of it, and what it held when its last name went.
#[derive(Debug, Default)]
struct Inode {
    /// Its bytes as of its last `fsync` (the start counts as one); `None`: never synced, so a
    /// power loss may leave it empty.
    durable: Option<Content>,
    /// Written since then.
    dirty: bool,
    /// What it held when its last name was removed (an unlink, a rename over it, a removed tree).
    gone: Option<Content>,
}

/// What a name points to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Node {
    File(usize),
    Dir,
}

/// One change of a directory entry, made by operation `op` (the `op`-th point).
#[derive(Clone, Debug)]
struct Change {
    op: usize,
    rel: PathBuf,
    /// The new entry, or `None` when removed.
    node: Option<Node>,
    /// Its directory was `fsync`ed since.
    synced: bool,
}

/// Which directory entries a state keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Names {
    /// Every change (what a process death leaves).
    All,
    /// The synced changes and the first `n` unsynced operations (file systems that persist
    /// metadata in order: ext4, XFS journals).
    Prefix(usize),
    /// Every change but those of the unsynced operation `op` (one reordered away).
    AllBut(usize),
}

/// Which bytes a state keeps of the files written since their last `fsync`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Data {
    /// Every byte written.
    Written,
    /// Only what was synced, for every file.
    Synced,
    /// Only what was synced, for inode `i`; the others as written.
    SyncedOnly(usize),
    /// The first half of what inode `i` holds; the others as written.
    Torn(usize),
}

/// The recorder of one folder (see the module docs).
#[derive(Debug)]
pub struct Model {
    root: PathBuf,
    start: BTreeMap<PathBuf, Node>,
    now: BTreeMap<PathBuf, Node>,
    inodes: Vec<Inode>,
    changes: Vec<Change>,
    /// Each operation recorded, as `op path` (relative), for the names of states.
    ops: Vec<String>,
}

impl Model {
    /// A model of `root` as it is now, all of it durable.
    pub fn new(root: &Path) -> Model {
        let mut m = Model {
            root: root.to_path_buf(),
            start: BTreeMap::new(),
            now: BTreeMap::new(),
            inodes: Vec::new(),
            changes: Vec::new(),
            ops: Vec::new(),
        };
        for (rel, is_dir) in walk(root) {
            let node = if is_dir {
                Node::Dir
            } else {
                m.inodes.push(Inode {
                    durable: Some(Content::read(&root.join(&rel))),
                    ..Inode::default()
                });
                Node::File(m.inodes.len() - 1)
            };
            m.start.insert(rel.clone(), node);
            m.now.insert(rel, node);
        }
        m
    }

    /// Records `op` on `path`, right before it runs (paths outside the root are not modelled).
    pub fn record(&mut self, op: Op<'_>, path: &Path) {
        let op_index = self.ops.len();
        let Some(rel) = path.strip_prefix(&self.root).ok().map(Path::to_path_buf) else {
            self.ops.push(format!("{} {}", op.name(), path.display()));
            return;
        };
        self.ops.push(format!("{} {}", op.name(), rel.display()));
        if let Op::FsyncDir = op {
            for c in &mut self.changes {
                if c.rel.parent() == Some(rel.as_path()) {
                    c.synced = true;
                }
            }
            return;
        }
        if rel.as_os_str().is_empty() {
            return;
        }
        match op {
            Op::CreateDir => self.mkdir(op_index, &rel),
            Op::Create => match self.now.get(&rel) {
                Some(&Node::File(i)) => self.inodes[i].dirty = true,
                _ => {
                    self.inodes.push(Inode {
                        dirty: true,
                        ..Inode::default()
                    });
                    let node = Node::File(self.inodes.len() - 1);
                    self.change(op_index, rel, Some(node));
                }
            },
            Op::Write => {
                if let Some(&Node::File(i)) = self.now.get(&rel) {
                    self.inodes[i].dirty = true;
                }
            }
            Op::Fsync => {
                if let Some(&Node::File(i)) = self.now.get(&rel) {
                    self.inodes[i].durable = Some(Content::read(path));
                    self.inodes[i].dirty = false;
                }
            }
            Op::Rename { from } => self.rename(op_index, from, rel),
            Op::Link { from } => {
                let from = self.rel(from).and_then(|f| self.now.get(&f).copied());
                if let (Some(node), false) = (from, self.now.contains_key(&rel)) {
                    self.change(op_index, rel, Some(node));
                }
            }
            Op::Unlink => self.remove(op_index, &rel),
            Op::RemoveTree => {
                let under: Vec<PathBuf> = self
                    .now
                    .keys()
                    .filter(|p| p.starts_with(&rel) && **p != rel)
                    .cloned()
                    .collect();
                // Deepest first, as `remove_dir_all` goes.
                for p in under.iter().rev() {
                    self.remove(op_index, p);
                }
                self.remove(op_index, &rel);
            }
            Op::FsyncDir | Op::Put | Op::PutIfAbsent | Op::Delete => {}
        }
    }

    fn rel(&self, path: &Path) -> Option<PathBuf> {
        let rel = path.strip_prefix(&self.root).ok()?;
        (!rel.as_os_str().is_empty()).then(|| rel.to_path_buf())
    }

    fn mkdir(&mut self, op: usize, rel: &Path) {
        let mut at = PathBuf::new();
        for c in rel.components() {
            at.push(c);
            if !self.now.contains_key(&at) {
                self.change(op, at.clone(), Some(Node::Dir));
            }
        }
    }

    fn rename(&mut self, op: usize, from: &Path, to: PathBuf) {
        let Some(from) = self.rel(from) else { return };
        let Some(node) = self.now.get(&from).copied() else {
            return;
        };
        self.note_gone(&to);
        self.change(op, from, None);
        self.change(op, to, Some(node));
    }

    fn remove(&mut self, op: usize, rel: &Path) {
        if self.now.contains_key(rel) {
            self.note_gone(rel);
            self.change(op, rel.to_path_buf(), None);
        }
    }

    /// Keeps what the file at `rel` holds when that name is its last one and goes.
    fn note_gone(&mut self, rel: &Path) {
        if let Some(&Node::File(i)) = self.now.get(rel) {
            let names = self.now.values().filter(|n| **n == Node::File(i)).count();
            if names == 1 {
                self.inodes[i].gone = Some(Content::read(&self.root.join(rel)));
            }
        }
    }

    fn change(&mut self, op: usize, rel: PathBuf, node: Option<Node>) {
        match node {
            Some(n) => self.now.insert(rel.clone(), n),
            None => self.now.remove(&rel),
        };
        self.changes.push(Change {
            op,
            rel,
            node,
            synced: false,
        });
    }

    /// The model's idea of the folder now, against the folder itself: `Err` names the first
    /// difference (a harness error, not a finding).
    pub fn check_against_disk(&self) -> Result<(), String> {
        let disk: BTreeMap<PathBuf, bool> = walk(&self.root).into_iter().collect();
        let model: BTreeMap<PathBuf, bool> = self
            .now
            .iter()
            .map(|(p, n)| (p.clone(), *n == Node::Dir))
            .collect();
        if disk == model {
            return Ok(());
        }
        let only = |a: &BTreeMap<PathBuf, bool>, b: &BTreeMap<PathBuf, bool>| {
            a.keys()
                .filter(|k| !b.contains_key(*k))
                .cloned()
                .collect::<Vec<_>>()
        };
        Err(format!(
            "model and disk differ: only on disk {:?}, only in the model {:?}",
            only(&disk, &model),
            only(&model, &disk)
        ))
    }

    /// A state's description: its names as the operations they keep or undo, and its bytes.
    pub fn describe(&self, names: Names, data: Data) -> String {
        let unsynced = self.unsynced_ops();
        let names = match names {
            Names::All => "every name".to_string(),
            Names::Prefix(0) => "only synced names".to_string(),
            Names::Prefix(n) => format!("names synced and up to {}", self.ops[unsynced[n - 1]]),
            Names::AllBut(op) => format!("every name but {}", self.ops[op]),
        };
        let file = |i: usize| {
            self.now
                .iter()
                .find(|(_, n)| **n == Node::File(i))
                .map_or("?".to_string(), |(p, _)| p.display().to_string())
        };
        let data = match data {
            Data::Written => "bytes as written".to_string(),
            Data::Synced => "only synced bytes".to_string(),
            Data::SyncedOnly(i) => format!("only synced bytes of {}", file(i)),
            Data::Torn(i) => format!("{} torn", file(i)),
        };
        format!("{names}, {data}")
    }

    /// The unsynced operations, in order.
    fn unsynced_ops(&self) -> Vec<usize> {
        let ops: BTreeSet<usize> = self
            .changes
            .iter()
            .filter(|c| !c.synced)
            .map(|c| c.op)
            .collect();
        ops.into_iter().collect()
    }

    /// The files reachable now whose bytes are not all durable.
    fn dirty_inodes(&self) -> Vec<usize> {
        let reachable: BTreeSet<usize> = self
            .now
            .values()
            .filter_map(|n| match n {
                Node::File(i) => Some(*i),
                Node::Dir => None,
            })
            .collect();
        reachable
            .into_iter()
            .filter(|&i| self.inodes[i].dirty || self.inodes[i].durable.is_none())
            .collect()
    }

    /// The states a power loss may leave at this point, besides what a process death leaves
    /// (`(Names::All, Data::Written)`, which is the folder itself):
    /// - names: the synced changes plus each prefix of the unsynced operations (in-order
    ///   metadata, the common case), and all changes but one unsynced operation's (each single
    ///   reordering), with every byte written;
    /// - bytes: every unsynced file back to its last `fsync` (empty if never synced), with all
    ///   names and with only the synced ones; each such file alone back to its last `fsync`, and
    ///   each alone torn (its first half kept), with all names.
    ///
    /// Not enumerated: combinations of two or more reorderings, and of tears in several files at
    /// once; docs/guarantees.md says why the list covers the orderings the protocol depends on.
    pub fn states(&self) -> Vec<(Names, Data)> {
        let unsynced = self.unsynced_ops();
        let mut out = Vec::new();
        for n in 0..unsynced.len() {
            out.push((Names::Prefix(n), Data::Written));
        }
        if unsynced.len() > 1 {
            for &op in &unsynced {
                out.push((Names::AllBut(op), Data::Written));
            }
        }
        let dirty = self.dirty_inodes();
        if !dirty.is_empty() {
            out.push((Names::All, Data::Synced));
            out.push((Names::Prefix(0), Data::Synced));
            for &i in &dirty {
                out.push((Names::All, Data::SyncedOnly(i)));
                out.push((Names::All, Data::Torn(i)));
            }
        }
        out
    }

    /// The folder tree of state `(names, data)`: every path (relative) with its content, `None`
    /// for a directory.
    pub fn tree(&self, names: Names, data: Data) -> BTreeMap<PathBuf, Option<Content>> {
        let unsynced = self.unsynced_ops();
        let kept = |c: &Change| match names {
            Names::All => true,
            Names::Prefix(n) => c.synced || unsynced[..n].contains(&c.op),
            Names::AllBut(op) => c.synced || c.op != op,
        };
        let mut ns = self.start.clone();
        for c in self.changes.iter().filter(|c| kept(c)) {
            match c.node {
                Some(n) => ns.insert(c.rel.clone(), n),
                None => ns.remove(&c.rel),
            };
        }
        let mut out = BTreeMap::new();
        let mut dirs: BTreeSet<PathBuf> = BTreeSet::new();
        for (rel, node) in ns {
            // An entry whose directory is not there is lost with it.
            let parent_there = rel
                .parent()
                .is_none_or(|p| p.as_os_str().is_empty() || dirs.contains(p));
            if !parent_there {
                continue;
            }
            match node {
                Node::Dir => {
                    dirs.insert(rel.clone());
                    out.insert(rel, None);
                }
                Node::File(i) => {
                    out.insert(rel, Some(self.content(i, data)));
                }
            }
        }
        out
    }

    /// What inode `i` holds in a state whose bytes are `data`.
    fn content(&self, i: usize, data: Data) -> Content {
        let inode = &self.inodes[i];
        let written = || match self.now.iter().find(|(_, n)| **n == Node::File(i)) {
            Some((rel, _)) => Content::read(&self.root.join(rel)),
            None => inode.gone.clone().unwrap_or(Content {
                data: Vec::new(),
                mtime: SystemTime::UNIX_EPOCH,
            }),
        };
        let synced = || {
            inode.durable.clone().unwrap_or_else(|| Content {
                data: Vec::new(),
                mtime: written().mtime,
            })
        };
        let unsynced = inode.dirty || inode.durable.is_none();
        match data {
            Data::Synced if unsynced => synced(),
            Data::SyncedOnly(j) if j == i => synced(),
            Data::Torn(j) if j == i => {
                let mut c = written();
                c.data.truncate(c.data.len() / 2);
                c
            }
            _ => written(),
        }
    }
}

/// Every path under `root` (relative), with whether it is a directory; sorted.
pub fn walk(root: &Path) -> Vec<(PathBuf, bool)> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(root.join(&rel)) else {
            continue;
        };
        for e in rd.flatten() {
            let p = rel.join(e.file_name());
            let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
            if is_dir {
                stack.push(p.clone());
            }
            out.push((p, is_dir));
        }
    }
    out.sort();
    out
}

/// Writes `tree` ([`Model::tree`]) into the empty folder `dir`, with each file's mtime.
pub fn materialize(tree: &BTreeMap<PathBuf, Option<Content>>, dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (rel, content) in tree {
        let path = dir.join(rel);
        match content {
            None => std::fs::create_dir(&path)?,
            Some(c) => {
                std::fs::write(&path, &c.data)?;
                let f = std::fs::File::options().write(true).open(&path)?;
                f.set_times(std::fs::FileTimes::new().set_modified(c.mtime))?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(tree: &BTreeMap<PathBuf, Option<Content>>) -> Vec<String> {
        tree.keys().map(|p| p.display().to_string()).collect()
    }

    /// The textbook atomic replace (tmp, write, fsync, rename, directory fsync) and the same
    /// without the directory fsync: the first leaves only the old or the new file, the second
    /// also loses the rename; a file never synced may come back empty or torn.
    #[test]
    fn a_rename_is_durable_only_after_its_directory_is_synced() {
        let dir = std::env::temp_dir().join(format!("model-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("f"), b"old").unwrap();
        let mut m = Model::new(&dir);
        let (tmp, f) = (dir.join(".f.tmp"), dir.join("f"));
        m.record(Op::Create, &tmp);
        std::fs::write(&tmp, b"new!").unwrap();
        m.record(Op::Write, &tmp);
        // Before the fsync: the new bytes may be lost or torn.
        let states = m.states();
        assert!(states.contains(&(Names::All, Data::Torn(1))), "{states:?}");
        let torn = m.tree(Names::All, Data::Torn(1));
        assert_eq!(torn[&PathBuf::from(".f.tmp")].as_ref().unwrap().data, b"ne");
        m.record(Op::Fsync, &tmp);
        m.record(Op::Rename { from: &tmp }, &f);
        std::fs::rename(&tmp, &f).unwrap();
        m.check_against_disk().unwrap();
        // Unsynced: the create and the rename may both be undone, each alone or in order.
        let undone = m.tree(Names::Prefix(0), Data::Written);
        assert_eq!(names(&undone), ["f"]);
        assert_eq!(undone[&PathBuf::from("f")].as_ref().unwrap().data, b"old");
        let created_only = m.tree(Names::Prefix(1), Data::Written);
        assert_eq!(names(&created_only), [".f.tmp", "f"]);
        m.record(Op::FsyncDir, &dir);
        assert!(m.states().is_empty(), "everything is durable");
        let all = m.tree(Names::All, Data::Written);
        assert_eq!(all[&PathBuf::from("f")].as_ref().unwrap().data, b"new!");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A file in a directory whose creation was not synced is lost with the directory.
    #[test]
    fn an_unsynced_mkdir_takes_what_is_under_it() {
        let dir = std::env::temp_dir().join(format!("model-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut m = Model::new(&dir);
        let sub = dir.join("a/b");
        m.record(Op::CreateDir, &sub);
        std::fs::create_dir_all(&sub).unwrap();
        m.record(Op::Create, &sub.join("x"));
        std::fs::write(sub.join("x"), b"1").unwrap();
        m.record(Op::Fsync, &sub.join("x"));
        m.record(Op::FsyncDir, &sub);
        m.check_against_disk().unwrap();
        assert_eq!(
            names(&m.tree(Names::All, Data::Written)),
            ["a", "a/b", "a/b/x"]
        );
        assert!(m.tree(Names::Prefix(0), Data::Written).is_empty());
        m.record(Op::FsyncDir, &dir);
        m.record(Op::FsyncDir, &dir.join("a"));
        assert!(m.states().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
