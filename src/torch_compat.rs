//! Which torch releases can read a checkpoint's `.metadata`, and rewriting it into the form an
//! older release reads.
//!
//! Facts (`torch/distributed/checkpoint/metadata.py` and `filesystem.py` of each wheel, 2.3.1–2.15.0;
//! each release's own `.metadata` among the golden fixtures, tests/fixtures/README.md): every torch
//! 2.3–2.15 reads `.metadata` with plain `pickle.load`.
//! - torch 2.15 pickles `TensorProperties` as a 6-tuple (`strides` appended); torch ≤ 2.14's
//!   `__setstate__` unpacks exactly 5 ("too many values to unpack (expected 5)").
//! - torch 2.4 added `StorageMeta` (`Metadata.storage_meta`); 2.3 cannot unpickle that class.
//! - torch 2.7 added stream transforms (`_StorageInfo.transform_descriptors`, e.g. zstd): an older
//!   torch reads the transformed bytes as they are. Not rewritable.
//! - uint16/uint32/uint64 tensors fail on torch 2.4–2.5 (weights-only allowlist); float8_e8m0fnu
//!   and float4_e2m1fn_x2 need torch ≥ 2.7. In the data files too: not rewritable.
//! - Python 3.13 pickles `checkpoint_id` as `pathlib._local.PosixPath`, which Python ≤ 3.12
//!   cannot import (any torch).
//!
//! [`rewrite`] re-pickles the whole `.metadata` (protocol 2, shared objects kept shared through the
//! memo) from its symbolic value graph ([`crate::format::unpickle`], nothing executed), changing
//! only: `TensorProperties` states cut to their first 5 fields, `storage_meta` left out of the
//! top-level state, `pathlib._local` classes named from `pathlib`. The result must describe the
//! same keys, chunks and storage as before (checked by decoding both) before it replaces
//! `.metadata`; data files are never touched.

use std::collections::HashMap;

use serde::Serialize;

use crate::commit::part::Marker;
use crate::commit::record::{read_commit_record, Digest};
use crate::commit::state::save_ids;
use crate::error::{Error, Result};
use crate::format::pickle::Pickler;
use crate::format::read_metadata::read_metadata;
use crate::format::unpickle::{unpickle, Value};
use crate::format::METADATA_FILE;
use crate::storage::Location;

/// A torch release `major.minor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Torch(pub u32, pub u32);

/// The oldest and the newest torch release whose DCP `.metadata` classes shardwise knows (read
/// from each wheel's `torch/distributed/checkpoint/metadata.py`): a claim about a
/// release outside them would be a guess.
pub const OLDEST_KNOWN: Torch = Torch(2, 3);
pub(crate) const NEWEST_KNOWN: Torch = Torch(2, 15);

impl Torch {
    /// Parses `2.3`, `2.3.1` or `2.15.0+cu132`.
    ///
    /// Errors: [`Error::InvalidArgument`] for anything else, or a release before
    /// [`OLDEST_KNOWN`] or after [`NEWEST_KNOWN`].
    pub fn parse(s: &str) -> Result<Torch> {
        let bad = || {
            Error::InvalidArgument(format!(
                "--torch-compat {s:?}: expected a torch release like 2.3 or 2.14.1"
            ))
        };
        let mut it = s.split(['.', '+']);
        let major = it.next().and_then(|m| m.parse().ok()).ok_or_else(bad)?;
        let minor = it.next().and_then(|m| m.parse().ok()).ok_or_else(bad)?;
        let t = Torch(major, minor);
        if t < OLDEST_KNOWN || t > NEWEST_KNOWN {
            return Err(Error::InvalidArgument(format!(
                "--torch-compat {s}: shardwise knows the DCP format of torch {OLDEST_KNOWN} to {NEWEST_KNOWN}; for another release, load the checkpoint with that torch itself"
            )));
        }
        Ok(t)
    }
}

impl std::fmt::Display for Torch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.0, self.1)
    }
}

/// One reason a torch release cannot read the checkpoint.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Blocker {
    /// What stops that release from reading the checkpoint.
    pub reason: String,
    /// `rewrite-metadata` removes it.
    pub rewritable: bool,
}

/// Whether `target` reads the checkpoint.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Compat {
    pub(crate) torch: Torch,
    /// The release reads the checkpoint as it is.
    pub readable: bool,
    /// Why not, when it does not.
    pub blockers: Vec<Blocker>,
}

/// What the `.metadata` pickle uses that limits the torch releases reading it.
#[derive(Default)]
struct Uses {
    six_tuple_props: usize,
    storage_meta: bool,
    transforms: usize,
    pathlib_local: bool,
    dtypes: std::collections::BTreeSet<String>,
}

/// Walks the value graph once (shared nodes once, iteratively: a hostile pickle may nest deeply).
fn uses(root: &Value) -> Uses {
    let mut u = Uses::default();
    let mut seen = std::collections::HashSet::new();
    let mut work = vec![root.clone()];
    while let Some(v) = work.pop() {
        if let Some(p) = shared_ptr(&v) {
            if !seen.insert(p) {
                continue;
            }
        }
        match &v {
            Value::Tuple(t) => work.extend(t.iter().cloned()),
            Value::List(l) => work.extend(l.borrow().iter().cloned()),
            Value::Dict(d) => {
                for (k, v) in d.borrow().iter() {
                    work.push(k.clone());
                    work.push(v.clone());
                }
            }
            Value::Global(g) => {
                if g.0 == "pathlib._local" {
                    u.pathlib_local = true;
                }
                if g.0 == "torch" {
                    u.dtypes.insert(g.1.clone());
                }
            }
            Value::Call(c) => {
                work.push(c.0.clone());
                work.push(c.1.clone());
            }
            Value::Object(o) => {
                let name = o.class.global().map(|(_, n)| n.to_string());
                let state = o.state.borrow().clone();
                match (name.as_deref(), &state) {
                    (Some("TensorProperties"), Some(Value::Tuple(t))) if t.len() == 6 => {
                        u.six_tuple_props += 1
                    }
                    (Some("StorageMeta"), _) => u.storage_meta = true,
                    (Some("_StorageInfo"), Some(s)) => {
                        if s.get("transform_descriptors")
                            .and_then(|d| d.items())
                            .is_some_and(|d| !d.is_empty())
                        {
                            u.transforms += 1
                        }
                    }
                    _ => {}
                }
                work.push(o.class.clone());
                work.push(o.args.clone());
                work.extend(state);
            }
            Value::PersId(p) => work.push((**p).clone()),
            _ => {}
        }
    }
    u
}

/// The address of a shared (reference-counted) node, its identity in the graph.
fn shared_ptr(v: &Value) -> Option<usize> {
    Some(match v {
        Value::Tuple(t) => std::rc::Rc::as_ptr(t) as *const u8 as usize,
        Value::List(l) => std::rc::Rc::as_ptr(l) as *const u8 as usize,
        Value::Dict(d) => std::rc::Rc::as_ptr(d) as *const u8 as usize,
        Value::Call(c) => std::rc::Rc::as_ptr(c) as *const u8 as usize,
        Value::Object(o) => std::rc::Rc::as_ptr(o) as *const u8 as usize,
        _ => return None,
    })
}

fn blockers(u: &Uses, target: Torch) -> Vec<Blocker> {
    let mut out = Vec::new();
    let mut add = |reason: String, rewritable: bool| out.push(Blocker { reason, rewritable });
    if u.six_tuple_props > 0 && target < Torch(2, 15) {
        add(
            format!(
                "{} TensorProperties are pickled as 6-tuples with strides (torch 2.15); torch {target} \
                 unpacks exactly 5 (\"too many values to unpack (expected 5)\")",
                u.six_tuple_props
            ),
            true,
        );
    }
    if u.storage_meta && target < Torch(2, 4) {
        add(
            format!("Metadata.storage_meta is a StorageMeta (torch 2.4+), a class torch {target} does not have"),
            true,
        );
    }
    if u.transforms > 0 && target < Torch(2, 7) {
        add(
            format!(
                "{} items are stored with stream transforms (zstd, torch 2.7+); torch {target} would read \
                 the transformed bytes as they are",
                u.transforms
            ),
            false,
        );
    }
    for d in &u.dtypes {
        let blocked = match d.as_str() {
            "uint16" | "uint32" | "uint64" => (Torch(2, 4)..=Torch(2, 5)).contains(&target),
            "float8_e8m0fnu" | "float4_e2m1fn_x2" => target < Torch(2, 7),
            _ => false,
        };
        if blocked {
            add(
                format!("tensors of dtype {d}, which torch {target} cannot load"),
                false,
            );
        }
    }
    if u.pathlib_local {
        add(
            "storage_meta.checkpoint_id is a pathlib._local.PosixPath (written by Python 3.13): Python \
             3.12 and older cannot unpickle it, whatever the torch release"
                .into(),
            true,
        );
    }
    out
}

/// Whether torch `target` reads the `.metadata` bytes `meta`, and why not.
///
/// Errors: [`Error::Corrupt`]-worthy input is reported by the caller: a pickle that does not
/// decode is [`Error::Validation`] here.
pub fn check(meta: &[u8], target: Torch) -> Result<Compat> {
    let graph = unpickle(meta)
        .map_err(|e| Error::Validation(format!(".metadata is not a readable pickle: {e}")))?;
    let blockers = blockers(&uses(&graph), target);
    Ok(Compat {
        torch: target,
        readable: blockers.is_empty(),
        blockers,
    })
}

/// The pickle of the value graph `root` in the form torch `target` reads (see the module docs).
fn repickle(root: &Value, target: Torch) -> Result<Vec<u8>> {
    let mut e = Emitter {
        p: Pickler::new(true),
        memo: HashMap::new(),
        target,
    };
    e.value(root, 0, true)?;
    Ok(e.p.finish())
}

struct Emitter {
    p: Pickler,
    /// Memo index of every shared node already emitted, by identity.
    memo: HashMap<usize, u32>,
    target: Torch,
}

/// Deepest nesting a `.metadata` needs is about 12; anything far deeper is refused.
const MAX_DEPTH: usize = 200;

impl Emitter {
    fn value(&mut self, v: &Value, depth: usize, top: bool) -> Result<()> {
        if depth > MAX_DEPTH {
            return Err(Error::Validation(format!(
                ".metadata nests deeper than {MAX_DEPTH} levels"
            )));
        }
        if let Some(&idx) = shared_ptr(v).and_then(|k| self.memo.get(&k)) {
            self.p.get(idx);
            return Ok(());
        }
        let d = depth + 1;
        match v {
            Value::None => self.p.none(),
            Value::Bool(b) => self.p.bool(*b),
            Value::Int(i) => self.p.int(*i),
            Value::Float(f) => {
                self.p.buf.push(b'G'); // BINFLOAT, big-endian IEEE 754
                self.p.buf.extend_from_slice(&f.to_be_bytes());
            }
            Value::Str(s) => self.p.str(s),
            Value::Bytes(b) => {
                self.p.buf.push(b'B'); // BINBYTES (protocol 3; CPython reads it in any stream)
                self.p
                    .buf
                    .extend_from_slice(&(b.len() as u32).to_le_bytes());
                self.p.buf.extend_from_slice(b);
            }
            Value::Tuple(t) => self.tuple(v, t, d)?,
            Value::List(l) => {
                self.p.empty_list();
                self.remember(v);
                let items = l.borrow().clone();
                if !items.is_empty() {
                    self.p.mark();
                    for it in &items {
                        self.value(it, d, false)?;
                    }
                    self.p.appends();
                }
            }
            Value::Dict(dict) => self.dict(v, &dict.borrow().clone(), d, false)?,
            Value::Global(g) => {
                let module = if g.0 == "pathlib._local" {
                    "pathlib"
                } else {
                    g.0.as_str()
                };
                self.p.global(module, &g.1);
            }
            Value::Call(c) => {
                self.value(&c.0, d, false)?;
                self.value(&c.1, d, false)?;
                self.p.reduce();
                self.remember(v);
            }
            Value::Object(o) => {
                if o.class.global().is_none() {
                    return Err(Error::Validation(
                        ".metadata holds an object built from a call result, which cannot be re-pickled as it was".into(),
                    ));
                }
                let name = o
                    .class
                    .global()
                    .map(|(_, n)| n.to_string())
                    .unwrap_or_default();
                self.value(&o.class, d, false)?;
                self.value(&o.args, d, false)?;
                self.p.newobj();
                self.remember(v);
                let state = o.state.borrow().clone();
                if let Some(state) = state {
                    match (&state, name.as_str()) {
                        (Value::Tuple(t), "TensorProperties")
                            if t.len() == 6 && self.target < Torch(2, 15) =>
                        {
                            self.p.mark();
                            for it in &t[..5] {
                                self.value(it, d, false)?;
                            }
                            self.p.tuple(5);
                        }
                        (Value::Dict(dict), _) => {
                            self.dict(&state, &dict.borrow().clone(), d, top)?
                        }
                        _ => self.value(&state, d, false)?,
                    }
                    self.p.build();
                }
            }
            Value::PersId(_) => {
                return Err(Error::Validation(
                    ".metadata holds a persistent id, which DCP metadata never does".into(),
                ))
            }
        }
        Ok(())
    }

    fn remember(&mut self, v: &Value) {
        if let Some(k) = shared_ptr(v) {
            let idx = self.p.put();
            self.memo.insert(k, idx);
        }
    }

    fn tuple(&mut self, v: &Value, items: &[Value], d: usize) -> Result<()> {
        if items.is_empty() {
            self.p.empty_tuple();
            return Ok(());
        }
        if items.len() > 3 {
            self.p.mark();
        }
        for it in items {
            self.value(it, d, false)?;
        }
        // TUPLE1/2/3, or TUPLE after the MARK above; then memoized, as CPython does.
        self.p.buf.push(match items.len() {
            1 => 0x85,
            2 => 0x86,
            3 => 0x87,
            _ => b't',
        });
        self.remember(v);
        Ok(())
    }

    /// A dict; `top` is the top-level Metadata's state, whose `storage_meta` an old torch cannot read.
    fn dict(&mut self, v: &Value, pairs: &[(Value, Value)], d: usize, top: bool) -> Result<()> {
        self.p.empty_dict();
        self.remember(v);
        let drop_meta = top && self.target < Torch(2, 4);
        let kept: Vec<&(Value, Value)> = pairs
            .iter()
            .filter(|(k, _)| !(drop_meta && k.as_str() == Some("storage_meta")))
            .collect();
        if !kept.is_empty() {
            self.p.mark();
            for (k, val) in kept {
                self.value(k, d, false)?;
                self.value(val, d, false)?;
            }
            self.p.setitems();
        }
        Ok(())
    }
}

/// What [`rewrite`] did.
#[derive(Clone, Debug, Serialize)]
pub struct Rewritten {
    pub(crate) torch: Torch,
    /// `.metadata` already read in `torch`: nothing was written.
    pub unchanged: bool,
    /// Size of `.metadata` before the rewrite in bytes.
    pub metadata_bytes_before: u64,
    /// Size of the rewritten `.metadata` in bytes.
    pub metadata_bytes: u64,
    /// What the rewrite removed.
    pub removed: Vec<String>,
    /// The commit record (`COMMITTED`) and `integrity.json` updated to the new `.metadata`.
    pub records_updated: Vec<String>,
}

/// Rewrites `.metadata` of the checkpoint at `loc` into the form torch `target` reads (see the
/// module docs), atomically (local: temporary file, fsync, rename; object store: one PUT); data
/// files untouched. A shardwise commit record and megatron-core's `integrity.json` that describe
/// the old `.metadata` are updated to the new one, so `status`, `verify` and `load` still see a
/// committed, checked checkpoint.
///
/// Errors: [`Error::Validation`] when a blocker cannot be rewritten (stream transforms, dtypes) or
/// the re-pickled metadata would describe anything else than the original; [`Error::Corrupt`] for
/// a `.metadata` that is not DCP metadata; storage errors.
pub fn rewrite(loc: &Location, target: Torch) -> Result<Rewritten> {
    let path = loc.path_of(METADATA_FILE);
    let before = loc
        .read(METADATA_FILE)?
        .ok_or_else(|| crate::hints::no_metadata(loc))?;
    let corrupt = |reason: String| Error::Corrupt {
        path: path.clone(),
        reason,
    };
    let old = read_metadata(&before).map_err(|e| corrupt(e.0))?;
    let compat = check(&before, target)?;
    let mut out = Rewritten {
        torch: target,
        unchanged: compat.readable,
        metadata_bytes_before: before.len() as u64,
        metadata_bytes: before.len() as u64,
        removed: Vec::new(),
        records_updated: Vec::new(),
    };
    if compat.readable {
        return Ok(out);
    }
    if let Some(b) = compat.blockers.iter().find(|b| !b.rewritable) {
        return Err(Error::Validation(format!(
            "torch {target} cannot read {} and no rewrite of .metadata changes that: {}; nothing written",
            loc, b.reason
        )));
    }
    let graph = unpickle(&before).map_err(|e| corrupt(e.to_string()))?;
    let after = repickle(&graph, target)?;
    let new = read_metadata(&after).map_err(|e| corrupt(format!("re-pickled: {}", e.0)))?;
    if new.entries != old.entries
        || new.class != old.class
        || new.nd_reformulated != old.nd_reformulated
    {
        return Err(Error::Validation(format!(
            "the rewritten .metadata of {loc} would describe other keys or chunks than the original; nothing written"
        )));
    }
    let left = check(&after, target)?;
    if !left.readable {
        return Err(Error::Validation(format!(
            "the rewritten .metadata of {loc} is still not readable by torch {target}: {}; nothing written",
            left.blockers.iter().map(|b| b.reason.as_str()).collect::<Vec<_>>().join("; ")
        )));
    }
    out.removed = compat.blockers.into_iter().map(|b| b.reason).collect();
    out.metadata_bytes = after.len() as u64;
    let old_digest = Digest::of(&before);
    let new_digest = Digest::of(&after);
    let integrity = loc.read(crate::commit::manifest::INTEGRITY_FILE)?;
    loc.write(METADATA_FILE, after.clone())?;
    // The record that committed the old .metadata now names the new one: without this, `status`
    // would call the checkpoint damaged and readers would skip its checksums.
    for id in save_ids(loc)? {
        if let Some(mut r) = read_commit_record(loc, &id).filter(|r| r.metadata == old_digest) {
            r.metadata = new_digest;
            r.summary.metadata_bytes = after.len() as u64;
            r.stamp_files(loc)?;
            let rel = Marker::Committed.rel(&id);
            loc.write(&rel, r.to_json()?)?;
            out.records_updated.push(rel);
        }
    }
    if let Some(bytes) = integrity {
        if let Ok(mut m) = serde_json::from_slice::<serde_json::Value>(&bytes) {
            let old_sha = crate::commit::manifest::sha256_hex(&before);
            if let Some(entry) = m
                .pointer_mut("/files/.metadata")
                .filter(|e| e.as_str() == Some(&old_sha))
            {
                *entry = serde_json::Value::String(crate::commit::manifest::sha256_hex(&after));
                let text = serde_json::to_vec_pretty(&m).map_err(|e| {
                    Error::InvalidArgument(format!("cannot encode integrity.json: {e}"))
                })?;
                loc.write(crate::commit::manifest::INTEGRITY_FILE, text)?;
                out.records_updated
                    .push(crate::commit::manifest::INTEGRITY_FILE.into());
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(v: &str) -> Vec<u8> {
        let path = crate::golden_fixtures().join(format!("dcp/torch-{v}/.metadata"));
        std::fs::read(path).unwrap()
    }

    #[test]
    fn versions_parse() {
        assert_eq!(Torch::parse("2.3").unwrap(), Torch(2, 3));
        assert_eq!(Torch::parse("2.14.1").unwrap(), Torch(2, 14));
        assert_eq!(Torch::parse("2.15.0+cu132").unwrap(), Torch(2, 15));
        for bad in ["2", "x.1", "2.2", "1.13", "2.16", "3.0", "9.9"] {
            assert!(Torch::parse(bad).is_err(), "{bad}");
        }
    }

    /// torch's own files: 2.15's is blocked for 2.14 (6-tuples) and 2.3 (also StorageMeta); 2.3.1's
    /// reads everywhere. The 2.15 file re-pickled for 2.3 describes the same keys and chunks and
    /// has no blocker left.
    #[test]
    fn golden_files_are_judged_and_rewritten() {
        let new = fixture("2.15.0");
        let c = check(&new, Torch(2, 14)).unwrap();
        assert!(
            !c.readable && c.blockers.len() == 1 && c.blockers[0].reason.contains("6-tuples"),
            "{c:?}"
        );
        assert_eq!(check(&new, Torch(2, 3)).unwrap().blockers.len(), 2);
        assert!(check(&new, Torch(2, 15)).unwrap().readable);
        for v in ["2.3.1", "2.5.1", "2.8.0"] {
            assert!(check(&fixture(v), Torch(2, 4)).unwrap().readable, "{v}");
        }
        assert!(!check(&fixture("2.8.0"), Torch(2, 3)).unwrap().readable);
        let graph = unpickle(&new).unwrap();
        let old = repickle(&graph, Torch(2, 3)).unwrap();
        assert!(check(&old, Torch(2, 3)).unwrap().readable);
        assert_eq!(
            read_metadata(&old).unwrap().entries,
            read_metadata(&new).unwrap().entries
        );
        // for 2.14 only the tuples change: storage_meta stays
        let mid = repickle(&graph, Torch(2, 14)).unwrap();
        assert!(check(&mid, Torch(2, 14)).unwrap().readable);
        assert!(!check(&mid, Torch(2, 3)).unwrap().readable);
    }
}
