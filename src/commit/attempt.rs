//! Which attempt of a derived save id a rank joins ([`join`]), whether one rank's save attempt may
//! start in a checkpoint directory, and under which names it writes ([`begin`]); then its part's
//! publication ([`Attempt::publish`]).
//!
//! A derived save id (`shardwise.save.default_save_id`) is a base every rank of a launch computes
//! alike; the attempt is `<base>.<n>`, numbered from what the directory holds, so that ranks agree
//! on it whatever they did before (how often their process saved, when it started):
//! - no attempt of the base yet: `n` = 1;
//! - the newest attempt ended (its `FAILED` or `COMMITTED` marker is there): `n` + 1. A failure
//!   belongs to the attempt that wrote it; a rank that comes after it never takes it for its own;
//! - otherwise the newest attempt is still open (its ranks save, or its merger died without a
//!   word) and the rank joins it; [`super::wait::Freshness`] and the storage stamps keep an earlier
//!   launch's parts of it out of the merge, as for any repeated id.
//!
//! The rules, checked before the rank writes anything:
//! - a committed checkpoint is replaced only with `overwrite`, only where a commit can replace it
//!   atomically (local filesystems: `.metadata` is renamed over; object stores cannot switch a
//!   prefix from one checkpoint to another), and only by another save id;
//! - a damaged checkpoint is replaced only with `overwrite` (`shardwise merge --repair` rebuilds it);
//! - a `.metadata` without a commit record (a merger died mid-commit) is no checkpoint: removed;
//! - this rank's part of an earlier attempt with the same save id is removed, unless a live process
//!   published it ([`publisher_is_live`]): two processes would then save as the same rank;
//! - the data file is `__{rank}_{n}.distcp` (torch's `FileSystemWriter` names) with the smallest `n`
//!   the committed checkpoint does not read, so an `overwrite` never touches the old checkpoint's
//!   files before the new commit;
//! - `common.pt` waits under the save's state directory where the commit can rename it into place
//!   (the old checkpoint's stays until then), and is written in place on object stores.

use super::liveness::{process_start_ns, publisher, publisher_alive, publisher_on_this_host};
use super::part::{marker_rel, part_rel, read_part, write_part, Marker, RankPart};
use super::state::{checkpoint_state, files_in_use, save_ids, CheckpointState};
use crate::error::{Error, Result};
use crate::format::METADATA_FILE;
use crate::format::{COMMON_FILE, METADATA_JSON_FILE};
use crate::storage::Location;

/// A rank's attempt at a save, allowed to write.
#[derive(Clone, Debug)]
pub struct Attempt {
    loc: Location,
    /// This rank's data file (name inside the checkpoint).
    pub data_file: String,
    /// Where this rank writes `common.pt` when it has the common state (path inside the
    /// checkpoint).
    pub common_file: String,
}

/// The save id of attempt `n` of the derived save id `base`.
pub fn attempt_id(base: &str, n: u32) -> String {
    format!("{base}.{n}")
}

/// The save id of the attempt of derived save id `base` that this rank joins in `loc` (see the
/// module docs for the rule): one listing of `.shardwise/`, then a look for the newest attempt's
/// markers. Ranks that call it after an attempt ended all get the next one; a rank that calls it
/// while the merger is writing `FAILED` may still join the failing attempt, and gets its error.
///
/// Errors: storage errors when `loc` cannot be created as a directory or `.shardwise/` cannot be
/// listed.
pub fn join(loc: &Location, base: &str) -> Result<String> {
    // As `begin` does first: a path that cannot be a directory is reported as such, not as a state
    // directory that cannot be listed.
    loc.create_dir()?;
    let newest = save_ids(loc)?
        .iter()
        .filter_map(|id| attempt_number(base, id))
        .max();
    let ended = |n: u32| {
        let id = attempt_id(base, n);
        loc.exists(&Marker::Failed.rel(&id)) || loc.exists(&Marker::Committed.rel(&id))
    };
    Ok(attempt_id(base, attempt_to_join(newest, ended)))
}

/// The attempt to join, given the `newest` attempt number in the directory (if any) and whether
/// an attempt has `ended`. Pure.
fn attempt_to_join(newest: Option<u32>, ended: impl Fn(u32) -> bool) -> u32 {
    match newest {
        None => 1,
        Some(n) if ended(n) => n.saturating_add(1),
        Some(n) => n,
    }
}

/// `n` when `id` is `attempt_id(base, n)` exactly (no leading zeros, no sign).
fn attempt_number(base: &str, id: &str) -> Option<u32> {
    let n: u32 = id.strip_prefix(base)?.strip_prefix('.')?.parse().ok()?;
    (attempt_id(base, n) == id).then_some(n)
}

/// Checks what `loc` holds before this rank writes anything, clears what an earlier attempt of
/// this rank left, and names the files it writes (see the module docs for the rules).
///
/// Errors: [`Error::CheckpointExists`] for a committed checkpoint without `overwrite`;
/// [`Error::InvalidArgument`] for a refused overwrite or a damaged checkpoint without `overwrite`;
/// [`Error::Validation`] when a live process already published this rank's part; storage errors.
pub fn begin(loc: &Location, save_id: &str, rank: u32, overwrite: bool) -> Result<Attempt> {
    loc.create_dir()?;
    let state = checkpoint_state(loc)?;
    match &state {
        CheckpointState::Committed { record } => {
            if !overwrite {
                return Err(Error::CheckpointExists(loc.display_path()));
            }
            loc.check_replaceable()?;
            if record.as_ref().is_some_and(|r| r.save_id == save_id) {
                return Err(Error::InvalidArgument(format!(
                    "{loc} is committed by save {save_id}: overwriting it needs a different save id"
                )));
            }
        }
        CheckpointState::Damaged { reason, repairable } if !overwrite => {
            let repair = match repairable {
                Some(_) => format!("`shardwise merge --repair {loc}` rebuilds it, "),
                None => String::new(),
            };
            return Err(Error::InvalidArgument(format!(
                "{loc} holds a damaged checkpoint ({reason}); {repair}overwrite=True replaces it"
            )));
        }
        CheckpointState::Damaged { .. } => {}
        CheckpointState::NotCommitted { .. } => {
            // A `.metadata` without a commit record was left by a merger that died mid-commit: it
            // is no checkpoint, and this attempt replaces it like any other leftover.
            loc.remove(METADATA_JSON_FILE)?;
            loc.remove(METADATA_FILE)?;
        }
    }
    let own = part_rel(save_id, rank);
    if let Ok(p) = read_part(loc, &own) {
        if publisher_is_live(&p.publisher, p.published_at_ns) {
            return Err(Error::Validation(format!(
                "rank {rank} already published a part for save {save_id} in {loc} (process {}), \
                 which is still running: two processes save as the same rank",
                p.publisher
            )));
        }
    }
    loc.remove(&own)?;
    let in_use = files_in_use(loc, &state)?;
    Ok(Attempt {
        loc: loc.clone(),
        data_file: data_file_name(rank, &in_use),
        common_file: loc.stage_rel(marker_rel(save_id, COMMON_FILE), COMMON_FILE),
    })
}

impl Attempt {
    /// Publishes this rank's part (create-if-absent, [`write_part`]): from now on a merger counts
    /// the rank. Returns the part's path inside the checkpoint.
    ///
    /// Errors: as [`write_part`].
    pub fn publish(&self, part: &RankPart) -> Result<String> {
        write_part(&self.loc, part)
    }
}

/// Whether a part published by `publisher` at `published_at_ns` may belong to a process that still
/// saves (so this process must not replace it): any publisher but this process that is alive on
/// this host, or one on another host that published after this process started (its liveness
/// cannot be seen from here; a launcher ends every process of a launch before the next starts,
/// see [`super::wait::Freshness`]). A publisher on this host that is gone is not, however recently
/// it published: that is a rerun after a failed attempt.
pub fn publisher_is_live(part_publisher: &str, published_at_ns: u64) -> bool {
    if part_publisher == publisher() {
        return false; // this process's own earlier attempt
    }
    if publisher_on_this_host(part_publisher) {
        publisher_alive(part_publisher)
    } else {
        published_at_ns >= process_start_ns()
    }
}

/// `__{rank}_{n}.distcp` with the smallest `n` not in `in_use`.
fn data_file_name(rank: u32, in_use: &[String]) -> String {
    (0..)
        .map(|n| format!("__{rank}_{n}.distcp"))
        .find(|n| !in_use.contains(n))
        .expect("an unused name exists")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commit::liveness::{host_id, now_ns};
    use crate::commit::testing::{committed, memory, publish};

    /// The attempt rule, one case each: none yet, the newest open, the newest ended (failed or
    /// committed, whatever older attempts did).
    #[test]
    fn a_rank_joins_the_newest_open_attempt_or_begins_the_next() {
        assert_eq!(attempt_to_join(None, |_| panic!("nothing to look at")), 1);
        assert_eq!(attempt_to_join(Some(1), |_| false), 1);
        assert_eq!(attempt_to_join(Some(1), |_| true), 2);
        assert_eq!(attempt_to_join(Some(3), |n| n < 3), 3);
        assert_eq!(attempt_to_join(Some(3), |n| n == 3), 4);
        assert_eq!(attempt_number("b", "b.12"), Some(12));
        for other in ["b", "b.", "b.012", "b.+1", "b.-1", "bb.1", "b.1.2", "c.1"] {
            assert_eq!(attempt_number("b", other), None, "{other}");
        }
    }

    /// [`join`] on real state directories: a failed attempt's ranks and a rank that never saw it
    /// all get the next one; an open one is joined; a committed one is followed by the next.
    #[test]
    fn join_reads_the_newest_attempts_markers() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        assert_eq!(join(&loc, "b").unwrap(), "b.1");
        publish(&loc, "b.1", 0, 2, false);
        publish(&loc, "other.7", 0, 2, false);
        assert_eq!(join(&loc, "b").unwrap(), "b.1", "open: joined");
        crate::commit::part::publish_failed(&loc, "b.1", "timed out");
        assert_eq!(join(&loc, "b").unwrap(), "b.2", "failed: the next");
        publish(&loc, "b.2", 1, 2, false);
        assert_eq!(join(&loc, "b").unwrap(), "b.2", "the retry is open: joined");
        publish(&loc, "b.2", 0, 2, false);
        let any = crate::commit::wait::Freshness::any_part();
        crate::commit::merge(&loc, "b.2", 2, std::time::Duration::from_secs(10), &any).unwrap();
        assert_eq!(join(&loc, "b").unwrap(), "b.3", "committed: the next");
    }

    #[test]
    fn the_data_file_is_the_first_name_the_checkpoint_does_not_read() {
        assert_eq!(data_file_name(3, &[]), "__3_0.distcp");
        let used = ["__3_0.distcp", "__3_1.distcp", "__4_2.distcp"].map(String::from);
        assert_eq!(data_file_name(3, &used), "__3_2.distcp");
    }

    /// The rule table: who may still be saving, by where the publisher runs, whether it lives, and
    /// when it published relative to this process's start.
    #[test]
    fn a_part_is_live_only_for_a_live_local_or_a_recent_foreign_publisher() {
        let start = process_start_ns();
        let here = host_id();
        let me = std::process::id();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let child_pub = format!(
            "{here}:{}:{}",
            child.id(),
            crate::commit::liveness::process_start_of(child.id()).unwrap()
        );
        let cases = [
            // (publisher, published_at_ns, live)
            (publisher(), now_ns(), false),
            (child_pub.clone(), now_ns(), true),
            (child_pub.clone(), 1, true),
            // Gone from this host (pid reused by a later process), published after we started.
            (format!("{here}:{me}:1"), now_ns(), false),
            (format!("{here}:{me}:1"), start.saturating_sub(1), false),
            (format!("{here}-elsewhere:1:1"), now_ns(), true),
            (
                format!("{here}-elsewhere:1:1"),
                start.saturating_sub(1_000_000_000),
                false,
            ),
            ("garbage".to_string(), now_ns(), true),
            ("garbage".to_string(), 0, false),
        ];
        for (p, at, live) in &cases {
            assert_eq!(publisher_is_live(p, *at), *live, "{p} at {at}");
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!publisher_is_live(&child_pub, now_ns()), "a dead child");
    }

    /// The directory rules, one case each: what `begin` refuses, and what it clears.
    #[test]
    fn begin_refuses_or_clears_by_what_the_directory_holds() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        committed(&loc, "s", 1, false);
        let e = begin(&loc, "t", 0, false).unwrap_err();
        assert!(matches!(e, Error::CheckpointExists(_)), "{e}");
        let e = begin(&loc, "s", 0, true).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("needs a different save id")),
            "{e}"
        );
        // An overwrite writes beside the committed files, and stages common.pt.
        let a = begin(&loc, "t", 0, true).unwrap();
        assert_eq!(a.data_file, "__0_1.distcp");
        assert_eq!(a.common_file, ".shardwise/t/common.pt");
        // Damaged: only an overwrite may replace it.
        std::fs::write(dir.path().join("__0_0.distcp"), b"short").unwrap();
        let e = begin(&loc, "t", 0, false).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("damaged")),
            "{e}"
        );
        assert!(begin(&loc, "t", 0, true).is_ok());

        // Object stores: no overwrite; common.pt in place.
        let remote = memory("begin");
        committed(&remote, "s", 1, false);
        let e = begin(&remote, "t", 0, true).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("refused on object stores")),
            "{e}"
        );
        let fresh = memory("fresh");
        assert_eq!(
            begin(&fresh, "t", 0, false).unwrap().common_file,
            "common.pt"
        );

        // A merger that died mid-commit left .metadata without a record: cleared.
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        committed(&loc, "s", 1, true);
        std::fs::remove_file(dir.path().join(".shardwise/s/COMMITTED")).unwrap();
        let a = begin(&loc, "s", 0, false).unwrap();
        assert!(!loc.exists(METADATA_FILE) && !loc.exists("metadata.json"));
        assert_eq!(a.data_file, "__0_0.distcp");
    }

    /// This rank's part of an earlier attempt is removed when its publisher is this process or
    /// gone from this host, and refused while its publisher lives.
    #[test]
    fn begin_replaces_this_ranks_part_unless_its_publisher_lives() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        publish(&loc, "s", 1, 2, false);
        begin(&loc, "s", 1, false).unwrap(); // our own: replaced
        assert!(!loc.exists(&part_rel("s", 1)));
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let start = crate::commit::liveness::process_start_of(child.id()).unwrap();
        let child_pub = format!("{}:{}:{start}", host_id(), child.id());
        publish(&loc, "s", 1, 2, false);
        let mut part = read_part(&loc, &part_rel("s", 1)).unwrap();
        part.publisher = child_pub; // as if that live process had published it
        loc.write(
            &part_rel("s", 1),
            crate::commit::part::encode_part(&part).unwrap(),
        )
        .unwrap();
        let e = begin(&loc, "s", 1, false).unwrap_err();
        assert!(
            matches!(&e, Error::Validation(m) if m.contains("two processes save as the same rank")),
            "{e}"
        );
        child.kill().unwrap();
        child.wait().unwrap();
        // Gone now, although it published after this process started: a rerun replaces it.
        begin(&loc, "s", 1, false).unwrap();
        assert!(!loc.exists(&part_rel("s", 1)));
    }
}
