//! What to tell someone who pointed a command at a directory that holds no checkpoint: the save
//! root of a training run (Megatron's `iter_XXXXXXX` directories and its tracker file) or a save
//! that is not committed yet.

use std::path::PathBuf;

use crate::error::Error;
use crate::format::METADATA_FILE;
use crate::storage::Location;

/// Megatron's tracker file in a save root: the last committed iteration, as decimal text (or
/// `release`). Source: megatron/training/checkpointing.py `get_checkpoint_tracker_filename`.
pub const TRACKER_FILE: &str = "latest_checkpointed_iteration.txt";

/// If `loc` looks like a save root (it holds `iter_*` directories or the tracker file), where
/// to point instead: `"it is a save root: ... point at DIR/iter_0000100"`. Best effort: `None`
/// when it cannot be listed or holds neither.
pub fn elsewhere(loc: &Location) -> Option<String> {
    let (files, dirs) = loc.list("").ok()?;
    let mut iters: Vec<&String> = dirs.iter().filter(|d| d.starts_with("iter_")).collect();
    iters.sort();
    let tracker = files
        .iter()
        .any(|f| f.name == TRACKER_FILE)
        .then(|| loc.read(TRACKER_FILE).ok().flatten())
        .flatten()
        .map(|b| String::from_utf8_lossy(&b).trim().to_string());
    if iters.is_empty() && tracker.is_none() {
        return None;
    }
    let tracked = tracker
        .as_deref()
        .and_then(|t| t.parse::<u64>().ok())
        .map(|i| format!("iter_{i:07}"));
    let target = tracked
        .clone()
        .filter(|t| iters.iter().any(|d| *d == t))
        .or_else(|| iters.last().map(|d| d.to_string()));
    let listed = match iters.as_slice() {
        [] => "no iter_* directory".to_string(),
        [one] => one.to_string(),
        [first, .., last] => format!("{} iter_* directories, {first} to {last}", iters.len()),
    };
    let mut hint = format!("{loc} is a training run's save root ({listed}");
    if let Some(t) = &tracker {
        hint.push_str(&format!("; {TRACKER_FILE} says {t}"));
    }
    hint.push(')');
    if let Some(t) = target {
        hint.push_str(&format!(": point at {}", loc.path_of(&t).display()));
    }
    Some(hint)
}

/// The error for a checkpoint location without `.metadata`, saying what is there instead.
pub fn no_metadata(loc: &Location) -> Error {
    let hint = elsewhere(loc).unwrap_or_else(|| {
        format!(
            "not a committed checkpoint; `shardwise status {loc}` shows any save in progress there"
        )
    });
    Error::Io {
        op: "read",
        path: PathBuf::from(loc.path_of(METADATA_FILE)),
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("no such file: {hint}"),
        ),
    }
}
