//! Errors of every shardwise operation. The Python binding maps each variant to a subclass of
//! `shardwise.ShardwiseError`.

use std::path::PathBuf;

/// The result of every fallible call of the crate; `E` defaults to [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What Ctrl-C stopped ([`Error::Interrupted`]), for its message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stopped {
    /// A save's write or wait, or a merge's wait: this process committed nothing.
    Commit,
    /// A load: the destinations may hold part of the requested data.
    Load,
}

impl Stopped {
    fn outcome(self) -> &'static str {
        match self {
            Stopped::Commit => "nothing committed",
            Stopped::Load => {
                "the load stopped before it finished (the destinations may hold part of the data)"
            }
        }
    }
}

/// Every error of the crate. Each variant's message is the one users see (the CLI prints it; the
/// Python binding raises it as the exception its doc names).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor dtype the DCP writer does not support (complex, uint16/32/64, float4, ...).
    #[error(
        "unsupported dtype {0}: shardwise writes float32, float64, float16, bfloat16, int64, int32, \
         int16, int8, uint8, bool, float8_e4m3fn and float8_e5m2"
    )]
    UnsupportedDtype(String),

    /// Arguments that contradict themselves (shape and byte count disagree, rank >= world_size, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A requested key is not in the checkpoint.
    #[error("no key {key:?} in the checkpoint {dir}")]
    MissingKey {
        /// The key asked for.
        key: String,
        /// The checkpoint directory.
        dir: PathBuf,
    },

    /// Inputs that do not fit together: a save being merged (overlapping or missing chunks, shape,
    /// dtype or world_size disagreements between ranks; nothing was committed), a region a
    /// checkpoint does not cover, a `to-hf` config that disagrees with the checkpoint. The message
    /// says "nothing committed" only where a commit was at stake (the commit path adds it).
    #[error("validation failed: {0}")]
    Validation(String),

    /// Some ranks did not publish a current metadata part within the timeout. `stale` lists the
    /// ranks whose part was ignored, with the reason (an earlier attempt's, or its data file
    /// changed since).
    #[error(
        "timed out after {timeout_s:.1}s waiting for the metadata parts of ranks [{}] (world_size {world_size}, \
         save {save_id}) in {dir}{}; nothing committed",
        fmt_ranks(missing),
        fmt_stale(stale)
    )]
    MissingRanks {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The save attempt.
        save_id: String,
        /// Number of ranks of the save.
        world_size: u32,
        /// Ranks without a current part, ascending.
        missing: Vec<u32>,
        /// The bound that passed, in seconds.
        timeout_s: f64,
        /// Ranks whose part was ignored, with why.
        stale: Vec<(u32, String)>,
    },

    /// Ctrl-C stopped a save's write or a wait of a save or merge (nothing was committed by this
    /// process) or a load.
    #[error("interrupted; {}", .0.outcome())]
    Interrupted(Stopped),

    /// The merging rank reported a failure, or no commit appeared within the timeout.
    #[error("save {save_id} in {dir} was not committed: {reason}")]
    NotCommitted {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The save attempt.
        save_id: String,
        /// The merger's failure, or the timeout.
        reason: String,
    },

    /// The target directory already holds a committed checkpoint and `overwrite` was not given.
    #[error(
        "{0} already holds a committed checkpoint (.metadata); pass overwrite=True to replace it"
    )]
    CheckpointExists(PathBuf),

    /// An I/O operation failed on `path`.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done (`write`, `open`, ...).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },

    /// An object-store request failed on `url` after its retries (or was refused, e.g. 403).
    #[error("{op} {url}: {source}")]
    Remote {
        /// What was being done (`put`, `get`, ...).
        op: &'static str,
        /// The object's URL.
        url: String,
        /// The object store's error.
        source: Box<object_store::Error>,
    },

    /// An I/O operation of one rank's save failed (full disk, permissions, object store down);
    /// `source` is the [`Error::Io`] or [`Error::Remote`]. The rank removed its partial data file; nothing was committed.
    #[error("rank {rank}: {source}; nothing committed")]
    RankStorage {
        /// The rank whose save failed.
        rank: u32,
        /// The storage error.
        source: Box<Error>,
    },

    /// The CUDA driver is missing or a CUDA call failed.
    #[error("CUDA: {0}")]
    Gpu(String),

    /// A file that should be a shardwise part or checkpoint file is malformed.
    #[error("corrupt file {path}: {reason}")]
    Corrupt {
        /// The malformed file.
        path: PathBuf,
        /// What is wrong in it.
        reason: String,
    },
}

impl Error {
    /// A `map_err` closure that wraps an I/O error of `op` on `path` as [`Error::Io`].
    pub fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }
}

/// The ignored parts of [`Error::MissingRanks`], each as `; ignored the part of rank R: why`.
fn fmt_stale(stale: &[(u32, String)]) -> String {
    stale
        .iter()
        .map(|(r, why)| format!("; ignored the part of rank {r}: {why}"))
        .collect()
}

/// The first `max` of `names`, comma-separated, and ", ..." when there are more: how a message
/// names what it refuses.
pub fn first_names(names: &[String], max: usize) -> String {
    let shown: Vec<&str> = names.iter().take(max).map(|s| s.as_str()).collect();
    let more = if names.len() > max { ", ..." } else { "" };
    format!("{}{more}", shown.join(", "))
}

/// Formats a sorted rank list compactly: `[0, 2, 3, 4, 7]` → `0, 2-4, 7`.
pub fn fmt_ranks(ranks: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        out.push(if j > i {
            format!("{}-{}", ranks[i], ranks[j])
        } else {
            ranks[i].to_string()
        });
        i = j + 1;
    }
    out.join(", ")
}

#[cfg(test)]
mod tests {
    #[test]
    fn rank_ranges() {
        assert_eq!(super::fmt_ranks(&[0, 2, 3, 4, 7]), "0, 2-4, 7");
        assert_eq!(super::fmt_ranks(&[]), "");
        let names: Vec<String> = ["a", "b", "c"].map(String::from).into();
        assert_eq!(super::first_names(&names, 2), "a, b, ...");
        assert_eq!(super::first_names(&names, 3), "a, b, c");
    }
}
