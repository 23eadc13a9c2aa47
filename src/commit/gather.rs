//! Step 5 of the commit (docs/guarantees.md, "The steps of one save"): a current part of every
//! rank, each folded into the global index as it is read, and every check a merge makes before it
//! writes anything. The merge runs it ([`collect_and_validate`]); `shardwise status` runs the same
//! checks on a save that failed, so that it recommends `shardwise merge` only when the merge
//! would commit ([`merge_problem`]).

use std::collections::BTreeMap;
use std::time::Duration;

use super::manifest::Manifest;
use super::part::{FileRecord, RankPart};
use super::validate;
use super::wait::{collect_parts, stale_reason, Freshness};
use crate::error::{Error, Result};
use crate::storage::Location;

/// Step 5's outcome: a current part of every rank, folded into the global index and validated.
pub(crate) struct Validated {
    pub(crate) parts: Vec<RankPart>,
    /// Each rank's (tensor chunks, byte objects), for the record's layout.
    pub(crate) counts: BTreeMap<u32, (usize, usize)>,
    pub(crate) global: validate::Global,
    /// A Megatron save (the first part says).
    pub(crate) megatron: bool,
    /// The `common.pt` a rank wrote ([`common_state`]).
    pub(crate) common: Option<FileRecord>,
    /// The integrity manifest of the ranks' files, when the save asked for one.
    pub(crate) integrity: Option<Manifest>,
}

/// Step 5: waits up to `timeout` for a current part of every rank, folds each into the index as
/// it is read (then drops its items), validates the whole, checks that no data file changed since
/// its part, that a Megatron save has its `common.pt` ([`common_state`]) and that the ranks agree
/// on the integrity manifest.
///
/// Errors: as [`collect_parts`], [`validate::Fold::finish`], [`common_state`] and
/// [`Manifest::of_parts`]; [`Error::Validation`] naming the rank whose data file changed.
pub(crate) fn collect_and_validate(
    loc: &Location,
    save_id: &str,
    world_size: u32,
    timeout: Duration,
    fresh: &Freshness,
) -> Result<Validated> {
    // Each part is folded into the index as it is read, then dropped; its item counts are kept
    // for the record's layout.
    let fold = validate::Fold::default();
    let counts = std::sync::Mutex::new(BTreeMap::new());
    let parts = collect_parts(loc, save_id, world_size, timeout, fresh, &|p, items| {
        let n = (items.0.len(), items.1.len());
        counts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(p.rank, n);
        fold.add_part(p, items)
    })?;
    let counts = counts.into_inner().unwrap_or_else(|e| e.into_inner());
    let global = fold.finish(&parts)?;
    check_data_files_unchanged(loc, &parts)?;
    let CommonState { megatron, common } = common_state(&parts)?;
    let common = common.cloned();
    let integrity = Manifest::of_parts(&parts)?;
    Ok(Validated {
        parts,
        counts,
        global,
        megatron,
        common,
        integrity,
    })
}

/// Why a merge of save `save_id` (`world_size` ranks) would not commit now, or None when it would:
/// [`collect_and_validate`]'s checks on the parts there, without waiting and without writing.
/// Reads every part.
///
/// Errors: storage errors listing or reading the save (a part that cannot be decoded, a missing
/// rank or a failed check is the answer, not an error); [`Error::Interrupted`].
pub(crate) fn merge_problem(
    loc: &Location,
    save_id: &str,
    world_size: u32,
) -> Result<Option<String>> {
    match collect_and_validate(
        loc,
        save_id,
        world_size,
        Duration::ZERO,
        &Freshness::any_part(),
    ) {
        Ok(_) => Ok(None),
        Err(e @ (Error::Validation(_) | Error::MissingRanks { .. } | Error::Corrupt { .. })) => {
            Ok(Some(e.to_string()))
        }
        Err(e) => Err(e),
    }
}

/// A data file may have been rewritten while the merger waited for the last part: each part's
/// files must still be the ones it published (whatever the part's age).
///
/// Errors: [`Error::Validation`] naming the rank and why; storage errors.
fn check_data_files_unchanged(loc: &Location, parts: &[RankPart]) -> Result<()> {
    use rayon::prelude::*;

    let any = Freshness {
        since_ns: None,
        failed_since_ns: 0,
    };
    parts
        .par_iter()
        .try_for_each(|p| match stale_reason(loc, p, &any)? {
            None => Ok(()),
            Some(why) => Err(Error::Validation(format!("rank {}: {why}", p.rank))),
        })
}

/// Whether the parts are a Megatron save, and the `common.pt` one of them wrote.
#[derive(Debug, PartialEq)]
pub(crate) struct CommonState<'p> {
    pub(crate) megatron: bool,
    pub(crate) common: Option<&'p FileRecord>,
}

/// The common state the commit publishes: a Megatron save (the first part says) must have one.
/// Pure.
///
/// Errors: [`Error::Validation`] for a Megatron save without `common.pt`.
pub(crate) fn common_state(parts: &[RankPart]) -> Result<CommonState<'_>> {
    let megatron = parts.first().is_some_and(|p| p.megatron);
    let common = parts.iter().find_map(|p| p.common.as_ref());
    if megatron && common.is_none() {
        return Err(Error::Validation(
            "no rank wrote common.pt (Megatron loaders require it)".into(),
        ));
    }
    Ok(CommonState { megatron, common })
}
