//! Crash points: every operation that changes durable state calls [`hit`] first, with the
//! operation ([`Op`]) and the path or object it changes. Outside the crash tests [`hit`] is an
//! empty inline function: the registry behind it exists only with `cfg(test)` or the cargo
//! feature `failpoints`, which only the crates' own tests turn on (a dev-dependency of each
//! crate on the core with the feature: cargo builds dev-dependencies for `cargo test` and never
//! for `cargo build`, maturin or an installed wheel). Never put `failpoints` in a default or a
//! release feature set.
//!
//! The crash tests (`crate::crashtest`, run by `tests/crashpoints.rs` and
//! `crates/shardwise-hf/tests/crashpoints.rs`) install a hook that names each point by its step
//! ([`step_of`], the table [`STEPS`]: docs/guarantees.md's table of crash points mirrors it),
//! ends the process at one (process death) and derives every state a power loss may leave there.

use std::path::Path;

/// An operation that changes durable state, announced to [`hit`] right before it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op<'a> {
    /// `mkdir` of the path and any missing parent.
    CreateDir,
    /// A file created, or truncated when it exists.
    Create,
    /// Bytes written into the file, its length changed or its blocks allocated.
    Write,
    /// `fsync`/`fdatasync` of the file: its bytes are durable afterwards.
    Fsync,
    /// `fsync` of the directory: the entries created, renamed and removed in it are durable.
    FsyncDir,
    /// `rename(from, path)`, replacing `path`.
    Rename {
        /// The file renamed.
        from: &'a Path,
    },
    /// `link(from, path)`: `path` created as a second name of `from`, only if absent.
    Link {
        /// The existing name.
        from: &'a Path,
    },
    /// `unlink` of the file.
    Unlink,
    /// The directory and everything under it removed (`rmdir` of an empty one too).
    RemoveTree,
    /// An object written whole, replacing any (object stores; also a completed multipart upload).
    Put,
    /// An object created only if absent (object stores).
    PutIfAbsent,
    /// An object, or every object under a prefix, deleted (object stores).
    Delete,
}

impl Op<'_> {
    /// The operation's name in crash-point listings.
    pub fn name(&self) -> &'static str {
        match self {
            Op::CreateDir => "mkdir",
            Op::Create => "create",
            Op::Write => "write",
            Op::Fsync => "fsync",
            Op::FsyncDir => "fsync-dir",
            Op::Rename { .. } => "rename",
            Op::Link { .. } => "link",
            Op::Unlink => "unlink",
            Op::RemoveTree => "rmtree",
            Op::Put => "put",
            Op::PutIfAbsent => "put-if-absent",
            Op::Delete => "delete",
        }
    }
}

/// Announces `op` on `path`, right before it runs. Nothing outside the crash tests.
#[inline(always)]
pub fn hit(op: Op<'_>, path: &Path) {
    #[cfg(any(test, feature = "failpoints"))]
    armed::hit(op, path);
    #[cfg(not(any(test, feature = "failpoints")))]
    let _ = (op, path);
}

#[cfg(any(test, feature = "failpoints"))]
pub use armed::{set_hook, step_of, Hook, STEPS};

#[cfg(any(test, feature = "failpoints"))]
mod armed {
    use std::path::Path;
    use std::sync::Mutex;

    use super::Op;

    /// What the crash tests run at every point.
    pub type Hook = Box<dyn Fn(Op<'_>, &Path) + Send + Sync>;

    /// Held while a hook runs, so points of concurrent threads are seen one at a time (and the
    /// hook may read files without another thread's operation running meanwhile).
    static HOOK: Mutex<Option<Hook>> = Mutex::new(None);

    /// Installs `hook` (or removes it with `None`) for every thread of the process.
    pub fn set_hook(hook: Option<Hook>) {
        *HOOK.lock().unwrap_or_else(|e| e.into_inner()) = hook;
    }

    pub(super) fn hit(op: Op<'_>, path: &Path) {
        let hook = HOOK.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = hook.as_ref() {
            h(op, path);
        }
    }

    /// The steps that change durable state, by the file they change (`*` stands for any part of
    /// one path component; matched against the last components of the path, after a temporary
    /// name is mapped to the file it becomes). The first match names the step. The numbers are
    /// those of docs/guarantees.md's steps table.
    pub const STEPS: &[(&str, &str)] = &[
        ("__*_*.distcp", "1-2 data file"),
        (".shardwise/*/common.pt", "3 common.pt (staged)"),
        (".shardwise/*/*.part", "3 part"),
        (".shardwise/*/COMMITTING", "5 COMMITTING lock"),
        (".shardwise/*/FAILED", "5' FAILED marker"),
        (".shardwise/*/checksums", "6 checksum sidecar"),
        ("common.pt", "6 common.pt"),
        (".metadata", "6 .metadata"),
        ("metadata.json", "7 metadata.json"),
        ("integrity.json", "7 integrity.json"),
        (".shardwise/*/COMMITTED", "8 COMMITTED record"),
        (
            ".shardwise/*",
            "3 a save's state folder (8: other saves' removed)",
        ),
        (".shardwise", "3 state folder"),
        ("latest_checkpointed_iteration.txt", "9 tracker"),
        (".to-hf-staging/*", "to-hf shard (staged)"),
        (".to-hf-staging", "to-hf staging folder"),
        (".to-hf-parts/*", "to-hf part marker"),
        (".to-hf-parts", "to-hf part markers folder"),
        ("model.safetensors.index.json", "to-hf index"),
        ("*.safetensors", "to-hf shard"),
        ("config.json", "to-hf config.json"),
        ("*", "0 checkpoint or output folder"),
    ];

    /// The step of [`STEPS`] that an operation on `path` belongs to.
    pub fn step_of(path: &Path) -> &'static str {
        let parts: Vec<String> = path
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let Some((last, dirs)) = parts.split_last() else {
            return "?";
        };
        let last = final_name(last);
        STEPS
            .iter()
            .find(|(pattern, _)| {
                let want: Vec<&str> = pattern.split('/').collect();
                let (want_last, want_dirs) = want.split_last().expect("a pattern");
                want_dirs.len() <= dirs.len()
                    && glob(want_last, &last)
                    && want_dirs
                        .iter()
                        .rev()
                        .zip(dirs.iter().rev())
                        .all(|(w, d)| glob(w, d))
            })
            .map_or("?", |(_, step)| step)
    }

    /// The file a temporary name becomes: `.<name>.tmp.<pid>.<n>` (storage's atomic writes) and
    /// `.<name>.to-hf-part<i>` (to-hf's parts) are `<name>`.
    fn final_name(name: &str) -> String {
        let Some(hidden) = name.strip_prefix('.') else {
            return name.to_string();
        };
        for infix in [".tmp.", ".to-hf-part"] {
            if let Some((stem, _)) = hidden.rsplit_once(infix) {
                return stem.to_string();
            }
        }
        name.to_string()
    }

    /// `pattern` with `*` for any run of characters matches `s`.
    fn glob(pattern: &str, s: &str) -> bool {
        match pattern.split_once('*') {
            None => pattern == s,
            Some((head, tail)) => {
                let Some(rest) = s.strip_prefix(head) else {
                    return false;
                };
                (0..=rest.len())
                    .filter(|&i| rest.is_char_boundary(i))
                    .any(|i| glob(tail, &rest[i..]))
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn each_file_of_a_save_has_its_step() {
            let step = |p: &str| step_of(Path::new(p));
            assert_eq!(step("/d/__1_0.distcp"), "1-2 data file");
            assert_eq!(step("/d/.shardwise/s.1/common.pt"), "3 common.pt (staged)");
            assert_eq!(step("/d/.shardwise/s.1/.3.part.tmp.77.0"), "3 part");
            assert_eq!(step("/d/..metadata.tmp.77.4"), "6 .metadata");
            assert_eq!(step("/d/common.pt"), "6 common.pt");
            assert_eq!(step("/d/.shardwise/s/COMMITTED"), "8 COMMITTED record");
            assert_eq!(
                step("/d/.shardwise/old"),
                "3 a save's state folder (8: other saves' removed)"
            );
            assert_eq!(
                step("/r/.latest_checkpointed_iteration.txt.tmp.1.2"),
                "9 tracker"
            );
            assert_eq!(
                step("/o/.to-hf-staging/model.safetensors"),
                "to-hf shard (staged)"
            );
            assert_eq!(step("/o/.model.safetensors.to-hf-part1"), "to-hf shard");
            assert_eq!(step("/o/model.safetensors.index.json"), "to-hf index");
            assert_eq!(step("/o/iter_0000001"), "0 checkpoint or output folder");
        }
    }
}
