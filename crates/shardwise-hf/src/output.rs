//! The output folder of `to-hf`: which folders a conversion may write into, how an earlier
//! conversion is replaced without leaving anything stale, and the commit: the index is written
//! last, once, create-if-absent, so a crash at any point leaves no index over incomplete shards.
//!
//! One process (`--workers N` threads): shards are written into `<out>/.to-hf-staging/`; the
//! commit removes an earlier conversion's index first, then its files, moves the new shards in,
//! writes config.json and the tokenizer's files, and writes the index last.
//!
//! Several processes or machines (`--part i/n`): every part computes the same plan and writes its
//! own shards (shard k belongs to part `k % n`) under their final names (temporary name, fsync,
//! rename), then an empty marker `.to-hf-parts/<fingerprint>.<i>-of-<n>`; the fingerprint is a
//! SHA-256 of the source checkpoint's identity (the storage stamps of `.metadata`, `common.pt` and
//! every data file: two iterations of one model can have byte-identical `.metadata`), the index,
//! every header, config.json and the tokenizer's files, so parts of different conversions never count for each other. A
//! part replaces its own earlier marker and refuses to publish beside another conversion's. The
//! part that finds all n markers checks every shard file's header and size against the plan,
//! writes config.json and the tokenizer's files and creates the index if absent; a part that finds the index already there
//! checks it is the same bytes.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::write::{ShardPlan, INDEX};
use shardwise::error::{Error, Result};
use shardwise::failpoint::{hit, Op};
use shardwise::storage::{atomic_create, atomic_write, create_dir_all, fsync_dir, Location};

const STAGING: &str = ".to-hf-staging";
pub(crate) const PARTS: &str = ".to-hf-parts";
/// The HF model config: its name in an HF folder (transformers `CONFIG_NAME`).
pub(crate) const CONFIG: &str = "config.json";

/// One part of a conversion split over processes or machines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    /// 0-based.
    pub index: usize,
    pub count: usize,
}

impl Part {
    /// Parses `i/n` (`0 <= i < n`).
    ///
    /// Errors: [`Error::InvalidArgument`].
    pub fn parse(s: &str) -> Result<Part> {
        let bad = || Error::InvalidArgument(format!("--part {s:?}: use i/n with 0 <= i < n"));
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let (index, count): (usize, usize) = (
            i.trim().parse().map_err(|_| bad())?,
            n.trim().parse().map_err(|_| bad())?,
        );
        if index >= count {
            return Err(bad());
        }
        Ok(Part { index, count })
    }

    /// The shards of this part: shard k belongs to part `k % count`.
    pub fn shards(self, total: usize) -> Vec<usize> {
        (self.index..total).step_by(self.count).collect()
    }
}

/// The files an earlier conversion wrote into `dir`: its index, every file the index lists,
/// `model.safetensors` and `model-NNNNN-of-NNNNN.safetensors` (what transformers and to-hf
/// name weight files), and config.json. Anything else is the user's and is never touched.
fn earlier_conversion(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut names = std::collections::BTreeSet::new();
    if let Ok(bytes) = shardwise::storage::read_regular(&dir.join(INDEX)) {
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) {
            if let Some(m) = v.get("weight_map").and_then(|m| m.as_object()) {
                // Only plain file names: an index never makes us delete outside `dir`.
                names.extend(
                    m.values()
                        .filter_map(|f| f.as_str())
                        .filter(|f| !f.contains(['/', '\\']) && !f.starts_with('.'))
                        .map(String::from),
                );
            }
        }
    }
    for e in std::fs::read_dir(dir).map_err(Error::io("read directory", dir))? {
        let e = e.map_err(Error::io("read directory", dir))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if is_weight_file_name(&name) || name == CONFIG {
            names.insert(name);
        }
    }
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
}

/// `model.safetensors` or `model-NNNNN-of-NNNNN.safetensors`.
fn is_weight_file_name(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(".safetensors") else {
        return false;
    };
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    stem == "model"
        || stem
            .strip_prefix("model-")
            .and_then(|r| r.split_once("-of-"))
            .is_some_and(|(a, b)| digits(a) && digits(b))
}

/// The entries of `dir` other than to-hf's own work folders (none when it does not exist).
fn entries(dir: &Path) -> Result<Vec<String>> {
    match std::fs::read_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(Error::io("read directory", dir)(e)),
        Ok(rd) => {
            let mut v = Vec::new();
            for e in rd {
                let name = e.map_err(Error::io("read directory", dir))?.file_name();
                let name = name.to_string_lossy().into_owned();
                if name != STAGING && name != PARTS {
                    v.push(name);
                }
            }
            v.sort();
            Ok(v)
        }
    }
}

/// A non-empty output folder refused, naming a few of its entries and what to do (`hint`).
pub(crate) fn not_empty(dir: &Path, found: &[String], hint: &str) -> Error {
    Error::InvalidArgument(format!(
        "output folder {} is not empty ({}): {hint}",
        dir.display(),
        shardwise::error::first_names(found, 5)
    ))
}

/// Checks the output folder of a one-process conversion before anything is read (changing
/// nothing): it must be absent or empty, unless `overwrite`.
///
/// Errors: [`Error::InvalidArgument`] for a URL, or a non-empty folder without `overwrite`.
pub(crate) fn check_folder(dir: &Path, overwrite: bool) -> Result<()> {
    let dir = Location::local_output(dir, "to-hf")?;
    let found = entries(dir)?;
    if !found.is_empty() && !overwrite {
        return Err(not_empty(
            dir,
            &found,
            "pass --overwrite to replace an earlier conversion there (other files are kept), or choose an empty folder",
        ));
    }
    Ok(())
}

/// Refuses an output folder that is the input's directory, lies inside it or contains it (an
/// input file: contains it; `input_kind` names the input in the message): to-hf's shards would be written among the
/// checkpoint's or `--base-hf`'s files (and `--overwrite` would remove the release's own
/// `model.safetensors`), from-hf's checkpoint among the HF folder's. Inputs are never written,
/// with or without `--overwrite`. A folder that does not exist yet is judged by its nearest
/// existing ancestor, so symlinks and `..` are resolved on both sides.
///
/// Errors: [`Error::InvalidArgument`] naming both.
pub(crate) fn check_outside(out: &Path, input_dir: &Path, input_kind: &str) -> Result<()> {
    let (Ok(input), Ok(abs)) = (input_dir.canonicalize(), std::path::absolute(out)) else {
        return Ok(()); // opening the input reports a missing one
    };
    let mut existing = abs.as_path();
    let mut rest = Vec::new();
    while !existing.exists() {
        let Some(parent) = existing.parent() else {
            return Ok(());
        };
        rest.push(existing.file_name().unwrap_or_default().to_owned());
        existing = parent;
    }
    let mut resolved = existing
        .canonicalize()
        .map_err(Error::io("resolve", existing))?;
    resolved.extend(rest.iter().rev());
    let how = if resolved == input {
        "is"
    } else if resolved.starts_with(&input) {
        "is inside"
    } else if input.starts_with(&resolved) {
        "contains"
    } else {
        return Ok(());
    };
    Err(Error::InvalidArgument(format!(
        "output folder {} {how} the {input_kind} {}: inputs are never written; choose a folder apart from it",
        out.display(),
        input_dir.display()
    )))
}

/// The staging folder of a one-process conversion in `dir`, created empty (a crashed run's is
/// removed: it is to-hf's own by name).
///
/// Errors: [`Error::Io`].
pub(crate) fn stage(dir: &Path) -> Result<PathBuf> {
    let staging = dir.join(STAGING);
    if staging.exists() {
        hit(Op::RemoveTree, &staging);
        std::fs::remove_dir_all(&staging).map_err(Error::io("remove", &staging))?;
    }
    create_dir_all(&staging)?;
    Ok(staging)
}

/// Commits a one-process conversion whose shards are in `staging`: the earlier conversion's
/// index goes first (from then on the folder holds no committed model), then its files; the new
/// shards are moved in, `files` (name, bytes: config.json, the tokenizer's) written, the index
/// written last.
///
/// Errors: [`Error::Io`].
pub(crate) fn commit(
    dir: &Path,
    staging: &Path,
    plan: &ShardPlan,
    index: &[u8],
    files: &[(String, Vec<u8>)],
) -> Result<()> {
    let index_path = dir.join(INDEX);
    let earlier = earlier_conversion(dir)?;
    hit(Op::Unlink, &index_path);
    match std::fs::remove_file(&index_path) {
        Ok(()) => fsync_dir(dir)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("remove", &index_path)(e)),
    }
    for p in earlier {
        hit(Op::Unlink, &p);
        match std::fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("remove", &p)(e)),
        }
    }
    for k in 0..plan.shards.len() {
        let name = plan.file_name(k);
        let (from, to) = (staging.join(&name), dir.join(&name));
        hit(Op::Rename { from: &from }, &to);
        std::fs::rename(&from, &to).map_err(Error::io("rename", &to))?;
    }
    for (name, bytes) in files {
        atomic_write(&dir.join(name), bytes)?;
    }
    atomic_write(&index_path, index)?;
    hit(Op::RemoveTree, staging);
    std::fs::remove_dir(staging).map_err(Error::io("remove", staging))?;
    fsync_dir(dir)
}

/// A fingerprint of a conversion: its source's identity (`source`, see [`super::source_identity`]),
/// the index, every header, and the other files written (config.json, the tokenizer's).
pub(crate) fn fingerprint(
    source: &[u8],
    plan: &ShardPlan,
    index: &[u8],
    files: &[(String, Vec<u8>)],
) -> String {
    let mut h = Sha256::new();
    h.update((source.len() as u64).to_le_bytes());
    h.update(source);
    h.update(index);
    for s in &plan.shards {
        h.update((s.header.len() as u64).to_le_bytes());
        h.update(&s.header);
    }
    for (name, bytes) in files {
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    h.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Checks the output folder of one part: it may hold only this conversion's shard files (other
/// parts') and to-hf's work folders. Returns true when this very conversion is already committed
/// there (same index): the part has nothing to do.
///
/// Errors: [`Error::InvalidArgument`] naming what else is there.
pub(crate) fn prepare_part(dir: &Path, plan: &ShardPlan, index: &[u8]) -> Result<bool> {
    let ours: std::collections::BTreeSet<String> =
        (0..plan.shards.len()).map(|k| plan.file_name(k)).collect();
    let found = entries(dir)?;
    if found.iter().any(|n| n == INDEX)
        && shardwise::storage::read_regular(&dir.join(INDEX)).map_err(Error::io("read", dir))?
            == index
    {
        return Ok(true);
    }
    let other: Vec<String> = found
        .into_iter()
        .filter(|n| !(ours.contains(n) || n.starts_with('.') && n.contains(".to-hf-part")))
        .collect();
    if !other.is_empty() {
        return Err(not_empty(
            dir,
            &other,
            "--part writes only into an empty folder or one holding other parts of the same conversion",
        ));
    }
    create_dir_all(&dir.join(PARTS))?;
    Ok(false)
}

/// The temporary name of a part's shard file while it is written.
pub(crate) fn part_temp(dir: &Path, name: &str, part: Part) -> PathBuf {
    dir.join(format!(".{name}.to-hf-part{}", part.index))
}

/// Publishes part `part`'s shards (already written to [`part_temp`] names and synced) and its
/// marker, then commits when every part's marker is there. Returns whether the conversion is
/// committed (by this part or an earlier one).
///
/// Errors: [`Error::Validation`] when a different index is already committed, when the folder
/// holds a marker of another conversion (another checkpoint, options or config), or when a shard
/// file's header or size is not the plan's; [`Error::Io`].
pub(crate) fn commit_part(
    dir: &Path,
    source: &[u8],
    plan: &ShardPlan,
    part: Part,
    index: &[u8],
    files: &[(String, Vec<u8>)],
) -> Result<bool> {
    let fp = fingerprint(source, plan, index, files);
    let parts = dir.join(PARTS);
    let marker = |i: usize| parts.join(format!("{fp}.{i}-of-{}", part.count));
    // This part's earlier marker (a rerun, perhaps with other options) goes before its shards
    // change; any other conversion's marker means the folder mixes two conversions.
    for name in entries(&parts)? {
        // A marker another part is writing right now (`atomic_write`'s hidden temporary name) is
        // no conversion's yet.
        if name.starts_with('.') {
            continue;
        }
        let (of, which) = name.split_once('.').unwrap_or((&name, ""));
        if of == fp {
            continue;
        }
        if which.split_once("-of-").map(|(i, _)| i) == Some(part.index.to_string().as_str()) {
            let path = parts.join(&name);
            hit(Op::Unlink, &path);
            std::fs::remove_file(&path).map_err(Error::io("remove", &path))?;
        } else {
            return Err(Error::Validation(format!(
                "{} holds parts of another conversion (marker {name}: another checkpoint, \
                 options or config); empty the folder and run every part again",
                dir.display()
            )));
        }
    }
    for k in part.shards(plan.shards.len()) {
        let name = plan.file_name(k);
        let (from, to) = (part_temp(dir, &name, part), dir.join(&name));
        hit(Op::Rename { from: &from }, &to);
        std::fs::rename(from, &to).map_err(Error::io("rename", &to))?;
    }
    fsync_dir(dir)?;
    atomic_write(&marker(part.index), b"")?;
    let index_path = dir.join(INDEX);
    let same_index = || -> Result<bool> {
        match shardwise::storage::read_regular(&index_path) {
            Ok(b) if b == index => Ok(true),
            Ok(_) => Err(Error::Validation(format!(
                "{} already holds a different conversion's index",
                dir.display()
            ))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::io("read", &index_path)(e)),
        }
    };
    if same_index()? {
        return Ok(true);
    }
    if !(0..part.count).all(|i| marker(i).exists()) {
        return Ok(false);
    }
    check_shard_files(dir, plan)?;
    for (name, bytes) in files {
        atomic_write(&dir.join(name), bytes)?;
    }
    if !atomic_create(&index_path, index)? {
        // Another part committed first: it must be this conversion.
        same_index()?;
    }
    // Every part has published; the markers have served (best effort: a racing part that
    // committed too may have removed them already).
    hit(Op::RemoveTree, &parts);
    let _ = std::fs::remove_dir_all(&parts);
    Ok(true)
}

/// Every shard file of `plan` in `dir` has the planned header and size.
fn check_shard_files(dir: &Path, plan: &ShardPlan) -> Result<()> {
    use std::io::Read;
    for (k, s) in plan.shards.iter().enumerate() {
        let path = dir.join(plan.file_name(k));
        let mut f = shardwise::storage::open_regular(&path).map_err(Error::io("open", &path))?;
        let len = f.metadata().map_err(Error::io("stat", &path))?.len();
        let mut head = vec![0u8; 8 + s.header.len()];
        let read = f.read_exact(&mut head);
        let expected = 8 + s.header.len() as u64 + s.data_len;
        if read.is_err() || len != expected || head[8..] != s.header[..] {
            return Err(Error::Validation(format!(
                "{} is not the shard this conversion planned ({len} bytes, {expected} planned, or \
                 another header): a part of another conversion wrote it; nothing committed",
                path.display()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_parse_and_split_the_shards() {
        assert_eq!(Part::parse("1/3").unwrap(), Part { index: 1, count: 3 });
        assert!(Part::parse("3/3").is_err() && Part::parse("x").is_err());
        let all: Vec<Vec<usize>> = (0..3)
            .map(|i| Part { index: i, count: 3 }.shards(7))
            .collect();
        assert_eq!(all, vec![vec![0, 3, 6], vec![1, 4], vec![2, 5]]);
    }

    #[test]
    fn weight_file_names() {
        assert!(is_weight_file_name("model.safetensors"));
        assert!(is_weight_file_name("model-00001-of-00002.safetensors"));
        assert!(!is_weight_file_name("adapter_model.safetensors"));
        assert!(!is_weight_file_name("model-1-of-2.safetensors"));
    }
}
