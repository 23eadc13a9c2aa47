//! Bounded waits: the merger's wait for every rank's part, the other ranks' wait for the commit,
//! and which parts and markers belong to the attempt that waits ([`Freshness`]).
//!
//! Every wait polls with a backoff of at most 500 ms, ends at its deadline with an error naming what
//! is missing, and stops at the next poll when the user interrupts (Ctrl-C): see
//! [`crate::interrupt`].

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use super::liveness::process_start_ns;
use super::part::{
    decode_part_items, listed_parts, part_rel, read_failed, read_part_bytes, PartItems, RankPart,
};
use super::record::{not_committed, read_commit_record};
use crate::error::{fmt_ranks, Error, Result, Stopped};
use crate::format::COMMON_FILE;
use crate::interrupt::interrupted;
use crate::storage::Location;

/// The largest bound accepted, in seconds (10^9 s, about 31.7 years). Every wait is bounded (a
/// hang is a failure mode, never a setting), so a larger value is a typo or a stand-in for
/// "forever"; it is refused rather than carried into deadline arithmetic, where `Instant +
/// Duration` panics on overflow (a `timeout_s` of 1e19 did, in the merge).
pub const MAX_TIMEOUT_S: f64 = 1e9;

/// A bound in seconds as a [`Duration`].
///
/// Errors: [`Error::InvalidArgument`] naming `what` for a negative, NaN or infinite value, or one
/// above [`MAX_TIMEOUT_S`] (`Duration::from_secs_f64` would panic on most of them).
pub fn timeout_from_secs(what: &str, secs: f64) -> Result<Duration> {
    let refused = || {
        Error::InvalidArgument(format!(
            "{what} must be a finite number of seconds in 0..={MAX_TIMEOUT_S:e}, got {secs}"
        ))
    };
    if !(0.0..=MAX_TIMEOUT_S).contains(&secs) {
        return Err(refused());
    }
    Duration::try_from_secs_f64(secs).map_err(|_| refused())
}

/// Polling schedule: exponential backoff from 2 ms to 500 ms, interruptible.
pub(crate) struct Backoff(Duration);
impl Backoff {
    pub(crate) fn new() -> Self {
        Backoff(Duration::from_millis(2))
    }
    /// Sleeps until the next poll (never past `deadline`).
    ///
    /// Errors: [`Error::Interrupted`] when the interrupt check fires.
    pub(crate) fn sleep(&mut self, deadline: Instant) -> Result<()> {
        if interrupted() {
            return Err(Error::Interrupted(Stopped::Commit));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        std::thread::sleep(self.0.min(left));
        self.0 = (self.0 * 2).min(Duration::from_millis(500));
        if interrupted() {
            return Err(Error::Interrupted(Stopped::Commit));
        }
        Ok(())
    }
}

/// Which parts and markers belong to the attempt that is waiting.
///
/// The ranks of one save cannot agree on a fresh id without talking, and a default save id
/// repeats when a job is relaunched with the same environment. What tells attempts apart without
/// talking is time: a launcher (torchrun, Slurm) ends every process of a launch before it starts
/// the next, and no rank of a launch can reach a save before every process of that launch exists
/// (they first form a process group). So a part or marker written before this process started
/// is an earlier launch's, and one written after it is this launch's (`this_launch`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Freshness {
    /// Parts published, and `COMMITTED` markers written, before this instant (ns since the Unix
    /// epoch) belong to an earlier attempt; `None`: any part counts (checked against its files).
    pub since_ns: Option<u64>,
    /// `FAILED` markers written before this instant belong to an earlier attempt or merge.
    pub failed_since_ns: u64,
}

impl Freshness {
    /// For a save with a derived id: this launch began when this process started.
    pub fn this_launch() -> Self {
        let t = process_start_ns();
        Freshness {
            since_ns: Some(t),
            failed_since_ns: t,
        }
    }

    /// For an explicit save id or a `shardwise merge`: any part counts (checked against its
    /// files), and `FAILED` markers written since this process started. (A `FAILED` left by an
    /// earlier attempt of the same explicit id in this same process can end a wait early: give
    /// every attempt its own id.)
    pub fn any_part() -> Self {
        Freshness {
            since_ns: None,
            failed_since_ns: process_start_ns(),
        }
    }

    fn part_is_current(&self, p: &RankPart) -> bool {
        self.since_ns.is_none_or(|t| p.published_at_ns >= t)
    }

    pub(super) fn commit_is_current(&self, committed_at_ns: u64) -> bool {
        committed_at_ns >= self.since_ns.unwrap_or(0)
    }
}

/// Ranks in `0..world_size` with no part yet.
///
/// Errors: storage errors when the save's directory cannot be listed (object store unreachable).
pub fn missing_ranks(loc: &Location, save_id: &str, world_size: u32) -> Result<Vec<u32>> {
    let mut present = vec![false; world_size as usize];
    for (r, _) in listed_parts(loc, save_id)? {
        if r < world_size {
            present[r as usize] = true;
        }
    }
    Ok((0..world_size).filter(|&r| !present[r as usize]).collect())
}

/// Why `p` cannot be merged by an attempt with freshness `fresh`, or `None` when it can: it was
/// published before this attempt, or a file it describes is missing or not the one it recorded
/// (its size, or its storage stamp: a rerun or a second process saving as the same rank, or a
/// copy).
///
/// Errors: storage errors when a file cannot be checked.
pub(super) fn stale_reason(
    loc: &Location,
    p: &RankPart,
    fresh: &Freshness,
) -> Result<Option<String>> {
    if !fresh.part_is_current(p) {
        return Ok(Some(
            "its part was published before this process started (an earlier attempt's)".into(),
        ));
    }
    for f in p.files.iter().chain(p.common.iter()) {
        let mut rel = f.name.as_str();
        let mut now = loc.stamp(rel)?;
        if now.is_none() && p.common.as_ref() == Some(f) {
            // A merger that died after renaming the staged common state into place.
            rel = COMMON_FILE;
            now = loc.stamp(rel)?;
        }
        if now.as_deref() != Some(f.stamp.as_str()) {
            let what = match now {
                None => "is missing",
                // The stamp holds the modification time, which a copy (`cp -r`) renews as a
                // rewrite does: with the size unchanged, nothing says the bytes changed, only
                // that the file is not the one the part vouches for.
                Some(_) if loc.size(rel)? == Some(f.size) => {
                    "has the size the part recorded but a new modification time (ETag on an \
                     object store): it was copied (`cp -r` gives new modification times; `cp -a` \
                     and `rsync -a` keep them) or rewritten"
                }
                Some(_) => "was replaced or changed",
            };
            return Ok(Some(format!(
                "its data file {} {what} since the part was published",
                f.name
            )));
        }
    }
    Ok(None)
}

/// Waits up to `timeout` for a current part of every rank in `0..world_size` and reads them. Parts
/// are read as they arrive, in parallel, so a `world_size` or save-id disagreement fails at once
/// instead of at the timeout. A stale part (see [`stale_reason`]) is ignored and waited past: its
/// rank may still publish a current one. Each current part's items are handed to `fold` as soon as
/// it is read (from several threads, in any rank order) and dropped; the parts are returned
/// without their items, in rank order.
///
/// Errors: [`Error::MissingRanks`] at the timeout (naming stale parts too); [`Error::Validation`]
/// when a current part disagrees on `world_size` or lies under another rank's or save's name;
/// [`Error::Corrupt`]/[`Error::Io`] for unreadable parts; `fold`'s errors; [`Error::Interrupted`].
pub fn collect_parts(
    loc: &Location,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
    fresh: &Freshness,
    fold: &(dyn Fn(&RankPart, PartItems<'_>) -> Result<()> + Sync),
) -> Result<Vec<RankPart>> {
    super::part::check_save_id(save_id)?;
    let deadline = Instant::now() + timeout;
    let mut parts: Vec<Option<RankPart>> = vec![None; world_size as usize];
    let mut stale: BTreeMap<u32, String> = BTreeMap::new();
    let mut backoff = Backoff::new();
    loop {
        // An unreachable store is retried by the client; what still fails is reported at once.
        let arrived: Vec<u32> = listed_parts(loc, save_id)?
            .into_iter()
            .map(|(r, _)| r)
            .filter(|&r| r < world_size && parts[r as usize].is_none())
            .collect();
        let read: Vec<std::result::Result<RankPart, (u32, String)>> = arrived
            .par_iter()
            .map(|&r| {
                let rel = part_rel(save_id, r);
                let bytes = read_part_bytes(loc, &rel)?;
                let (p, items) = decode_part_items(&bytes, loc.path_of(&rel))?;
                if let Some(why) = stale_reason(loc, &p, fresh)? {
                    return Ok(Err((p.rank, why)));
                }
                if p.world_size != world_size {
                    return Err(Error::Validation(format!(
                        "world_size disagrees across ranks: rank {} saved with world_size {}, the merger expects {}",
                        p.rank, p.world_size, world_size
                    )));
                }
                if p.save_id != save_id || p.rank != r {
                    return Err(Error::Validation(format!(
                        "part of rank {} carries save id {} but lies under save {save_id} as rank {r}",
                        p.rank, p.save_id
                    )));
                }
                fold(&p, items)?;
                Ok(Ok(p))
            })
            .collect::<Result<_>>()?;
        for p in read {
            match p {
                Err((rank, why)) => {
                    stale.insert(rank, why);
                }
                Ok(p) => {
                    stale.remove(&p.rank);
                    let r = p.rank as usize;
                    parts[r] = Some(p);
                }
            }
        }
        let missing: Vec<u32> = (0..world_size)
            .filter(|&r| parts[r as usize].is_none())
            .collect();
        if missing.is_empty() {
            return Ok(parts.into_iter().flatten().collect());
        }
        if Instant::now() >= deadline {
            return Err(Error::MissingRanks {
                dir: loc.display_path(),
                save_id: save_id.to_string(),
                world_size,
                missing,
                timeout_s: timeout.as_secs_f64(),
                stale: stale.into_iter().collect(),
            });
        }
        backoff.sleep(deadline)?;
    }
}

/// Waits up to `timeout` for the merger to commit `save_id`. Markers of earlier attempts (see
/// [`Freshness`]) are ignored.
///
/// Errors: [`Error::NotCommitted`] with the merger's reason when it published `FAILED`, or with the
/// ranks whose parts are still missing at the timeout; [`Error::Interrupted`].
pub fn wait_for_commit(
    loc: &Location,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
    fresh: &Freshness,
) -> Result<()> {
    super::part::check_save_id(save_id)?;
    let deadline = Instant::now() + timeout;
    let mut backoff = Backoff::new();
    loop {
        if read_commit_record(loc, save_id)
            .is_some_and(|c| fresh.commit_is_current(c.committed_at_ns))
        {
            return Ok(());
        }
        if let Some(f) = read_failed(loc, save_id).filter(|f| f.at_ns >= fresh.failed_since_ns) {
            return Err(not_committed(loc, save_id, f.reason));
        }
        if Instant::now() >= deadline {
            let t = timeout.as_secs_f64();
            let missing = match missing_ranks(loc, save_id, world_size) {
                Ok(m) => m,
                Err(e) => {
                    let reason =
                        format!("no commit within {t:.1}s, and the parts cannot be listed: {e}");
                    return Err(not_committed(loc, save_id, reason));
                }
            };
            let reason = if let Some(holder) = super::lock::dead_merger(loc, save_id) {
                format!(
                    "no commit within {t:.1}s: the merger ({holder}) died while holding the \
                     COMMITTING lock; `shardwise merge` takes it over"
                )
            } else if missing.is_empty() {
                format!("no commit within {t:.1}s although all parts are present (is the merging rank alive?)")
            } else {
                format!(
                    "no commit within {t:.1}s; parts still missing from ranks [{}]",
                    fmt_ranks(&missing)
                )
            };
            return Err(not_committed(loc, save_id, reason));
        }
        backoff.sleep(deadline)?;
    }
}

#[cfg(test)]
mod tests {
    use super::super::part::read_part;
    use super::super::testing::{publish, DATA_BYTES};
    use super::*;

    /// A data file with its recorded size but a new modification time (a `cp -r` copy) is named
    /// as copied or rewritten, never as changed; one of another size as replaced or changed.
    #[test]
    fn a_copied_data_file_is_stale_but_not_said_to_be_changed() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::local(dir.path());
        publish(&loc, "s", 0, 1, false);
        let part = read_part(&loc, &part_rel("s", 0)).unwrap();
        let why = |loc: &Location| stale_reason(loc, &part, &Freshness::any_part()).unwrap();
        assert_eq!(why(&loc), None);
        let data = dir.path().join("__0_0.distcp");
        let mtime = std::fs::metadata(&data).unwrap().modified().unwrap();
        let file = std::fs::File::options().write(true).open(&data).unwrap();
        file.set_modified(mtime + Duration::from_secs(1)).unwrap();
        let copied = why(&loc).unwrap();
        assert_eq!(
            copied,
            "its data file __0_0.distcp has the size the part recorded but a new modification \
             time (ETag on an object store): it was copied (`cp -r` gives new modification \
             times; `cp -a` and `rsync -a` keep them) or rewritten since the part was published"
        );
        loc.write("__0_0.distcp", vec![0; DATA_BYTES + 1]).unwrap();
        assert_eq!(
            why(&loc).unwrap(),
            "its data file __0_0.distcp was replaced or changed since the part was published"
        );
        std::fs::remove_file(&data).unwrap();
        assert_eq!(
            why(&loc).unwrap(),
            "its data file __0_0.distcp is missing since the part was published"
        );
    }

    #[test]
    fn timeouts_out_of_range_are_argument_errors_never_panics() {
        for bad in [
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            -1.0,
            -1e-9,
            1e9 + 1.0,
            1e19,
            1e30,
        ] {
            match timeout_from_secs("timeout_s", bad) {
                Err(Error::InvalidArgument(m)) => {
                    assert!(m.starts_with("timeout_s must be"), "{m}")
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        for (good, expect) in [
            (0.0, Duration::ZERO),
            (-0.0, Duration::ZERO),
            (0.25, Duration::from_millis(250)),
            (MAX_TIMEOUT_S, Duration::from_secs(1_000_000_000)),
        ] {
            assert_eq!(timeout_from_secs("t", good).unwrap(), expect, "{good}");
        }
    }
}
