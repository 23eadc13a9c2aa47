//! Every crash point of a save, a merge, an overwrite and a repair, as a process death and as a
//! power loss (`shardwise::crashtest`): each state leaves the checkpoint committed and whole, or
//! not committed with a cause (`status` and `verify` agree), the earlier checkpoint and the
//! tracker byte-identical, and a rerun commits. The counts and times are in docs/guarantees.md
//! ("Every crash point"); `cargo test --release --test crashpoints -- --nocapture` prints them.

use std::path::Path;
use std::time::Duration;

use shardwise::commit::state::{checkpoint_state, CheckpointState};
use shardwise::crashtest::{
    committed_and_whole, enumerate, status_and_verify_agree, Scenario, Summary,
};
use shardwise::format::dtype::DType;
use shardwise::save::{save_rank, ObjectItem, SaveOptions};
use shardwise::storage::Location;
use shardwise::writer::{ByteObject, Payload, TensorChunk};
use shardwise::Error;

const EARLIER: &str = "save_root/iter_0000001";
const NEXT: &str = "save_root/iter_0000002";
const TRACKER: &str = "save_root/latest_checkpointed_iteration.txt";
/// The save id's base, as `shardwise.save.default_save_id` derives one: every save is an attempt
/// `crash.<n>` of it.
const BASE: &str = "crash";

/// Rank `rank`'s rows of `w` (float32, 4 x 4, two rows per rank), different per `iteration`.
fn rows(rank: u32, iteration: u8) -> Vec<u8> {
    (0..8u32)
        .flat_map(|i| (iteration as f32 * 100.0 + (rank * 8 + i) as f32).to_le_bytes())
        .collect()
}

/// A torch.save archive of `[iteration, rank]`: a byte object, and (rank 0's) `common.pt`, which
/// differs from iteration to iteration as Megatron's does.
fn archive(rank: u32, iteration: u8) -> Vec<u8> {
    let mut p = shardwise::format::pickle::Pickler::new(false);
    p.empty_list();
    p.put();
    p.mark();
    p.int(iteration.into());
    p.int(rank.into());
    p.appends();
    shardwise::format::zip::object_archive(&p.finish(), "0000000000000000000000000000000000000000")
}

/// One rank's save of `iteration` into `dir`: rank 0 merges, rank 1 does not wait.
fn save(dir: &Path, rank: u32, iteration: u8, overwrite: bool) -> shardwise::Result<()> {
    let data = rows(rank, iteration);
    let tensors = [TensorChunk {
        fqn: "w".into(),
        dtype: DType::F32,
        global_shape: vec![4, 4],
        offsets: vec![2 * rank as u64, 0],
        sizes: vec![2, 4],
        data: Payload::Host(&data),
    }];
    let rng = archive(rank, iteration);
    let objects = [ObjectItem {
        object: ByteObject {
            fqn: format!("rng/shard_{rank}"),
            bytes: &rng,
        },
        shard: None,
    }];
    let common = archive(u32::MAX, iteration);
    let opts = SaveOptions {
        location: Location::local(dir),
        rank,
        world_size: 2,
        save_id: BASE.into(),
        megatron: true,
        merge_rank: Some(0),
        timeout: Duration::from_secs(5),
        wait_for_commit: rank == 0,
        overwrite,
        derived_save_id: true,
        integrity: false,
    };
    let common = (rank == 0).then_some(common.as_slice());
    save_rank(&opts, &tensors, &objects, common, None).map(|_| ())
}

/// Both ranks' saves, as a job's ranks would: rank 1 publishes, rank 0 publishes and merges.
fn save_both(dir: &Path, iteration: u8, overwrite: bool) -> shardwise::Result<()> {
    save(dir, 1, iteration, overwrite)?;
    save(dir, 0, iteration, overwrite)
}

/// The earlier checkpoint (iteration 1) and the tracker naming it.
fn earlier(root: &Path) {
    save_both(&root.join(EARLIER), 1, false).expect("the earlier save");
    std::fs::write(root.join(TRACKER), b"1").expect("the tracker");
}

/// The checks of a save into a new directory `dir`, and its rerun: a save with the same inputs
/// commits, or is refused as committed already.
fn check_save(dir: &Path, iteration: u8, overwrite: bool, done: bool) -> Vec<String> {
    let (mut v, committed) = status_and_verify_agree(dir);
    if done && !committed {
        v.push("not committed although the save returned: a power loss lost its commit".into());
    }
    rerun(dir, iteration, overwrite, committed, &mut v);
    v
}

/// The checks of an overwrite of the committed `dir`: committed and whole (by the old save or the
/// new one) at every point, but for the documented window of an overwrite (docs/guarantees.md,
/// "Limits"): from the rename of the new `common.pt` to the new `COMMITTED` record `status` may
/// say damaged; it then names the command that commits (`shardwise merge --save-id NEW`, or
/// `merge --repair` when the old save's parts rebuild the old checkpoint), and that command
/// commits. Then the rerun.
fn check_overwrite(dir: &Path, done: bool) -> Vec<String> {
    let loc = Location::local(dir);
    let (mut v, committed) = status_and_verify_agree(dir);
    if let (false, Ok(CheckpointState::Damaged { reason, repairable })) =
        (done, checkpoint_state(&loc))
    {
        shardwise::crashtest::after_restart(dir);
        let named = reason
            .split("`shardwise merge --save-id ")
            .nth(1)
            .and_then(|r| r.split('`').next());
        let any = shardwise::commit::wait::Freshness::any_part();
        let fixed = match (repairable, named) {
            (Some(_), _) => shardwise::commit::repair(&loc, Duration::from_secs(5)).map(|_| ()),
            (None, Some(id)) => {
                shardwise::commit::merge(&loc, id, 2, Duration::from_secs(5), &any).map(|_| ())
            }
            (None, None) => {
                return vec![format!("damaged, naming no command that commits: {reason}")]
            }
        };
        return match fixed {
            Ok(()) => committed_and_whole(dir, "after the command status names"),
            Err(e) => vec![format!("the command status names fails: {e} ({reason})")],
        };
    }
    if !committed {
        v.push("not committed: the overwrite lost the checkpoint it replaces".into());
    }
    if let (true, Ok(CheckpointState::Committed { record: Some(r) })) =
        (done, checkpoint_state(&loc))
    {
        if r.save_id != format!("{BASE}.2") {
            v.push(format!(
                "committed by {} although the overwrite returned",
                r.save_id
            ));
        }
    }
    rerun(dir, 2, true, committed, &mut v);
    v
}

/// A rerun of the save of `iteration` into `dir` commits, or (not an overwrite) is refused as
/// committed already when `dir` is; adds what fails to `v`.
fn rerun(dir: &Path, iteration: u8, overwrite: bool, committed: bool, v: &mut Vec<String>) {
    shardwise::crashtest::after_restart(dir);
    match save_both(dir, iteration, overwrite) {
        Ok(()) => v.extend(committed_and_whole(dir, "after the rerun")),
        Err(Error::CheckpointExists(_)) if committed && !overwrite => {}
        Err(e) => v.push(format!("the rerun fails: {e}")),
    }
}

fn report(name: &str, s: &Summary) {
    eprintln!(
        "crashpoints {name}: {} points, {} states ({} power loss), {} violations, {:.1} s",
        s.points,
        s.states,
        s.power_states,
        s.violations.len(),
        s.seconds
    );
    for (step, n) in &s.steps {
        eprintln!("  {step}: {n}");
    }
    let shown: Vec<&String> = s.violations.iter().take(40).collect();
    assert!(
        s.violations.is_empty(),
        "{} violations:\n{}",
        s.violations.len(),
        shown
            .iter()
            .map(|v| v.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(s.points > 10 && s.power_states > 0, "too few points: {s:?}");
}

/// A 2-rank save and its merge into a new iteration, beside a committed one and the tracker.
#[test]
fn save_and_merge() {
    let s = enumerate(&Scenario {
        test: "save_and_merge",
        setup: earlier,
        run: |root| save_both(&root.join(NEXT), 2, false),
        untouched: &[EARLIER, TRACKER],
        check: |root, done| check_save(&root.join(NEXT), 2, false, done),
    });
    report("save and merge", &s);
}

/// `overwrite=True` into the committed iteration: it stays committed (old or new) at every point.
#[test]
fn overwrite() {
    let s = enumerate(&Scenario {
        test: "overwrite",
        setup: earlier,
        run: |root| save_both(&root.join(EARLIER), 2, true),
        untouched: &[TRACKER],
        check: |root, done| check_overwrite(&root.join(EARLIER), done),
    });
    report("overwrite", &s);
}

/// `merge --repair` of a checkpoint whose `.metadata` was removed: repairable or repaired at
/// every point.
#[test]
fn repair() {
    let s = enumerate(&Scenario {
        test: "repair",
        setup: |root| {
            earlier(root);
            std::fs::remove_file(root.join(EARLIER).join(".metadata")).expect("damage");
        },
        run: |root| {
            let loc = Location::local(&root.join(EARLIER));
            shardwise::commit::repair(&loc, Duration::from_secs(5)).map(|_| ())
        },
        untouched: &[TRACKER],
        check: |root, done| {
            let dir = root.join(EARLIER);
            let loc = Location::local(&dir);
            let mut v = Vec::new();
            match checkpoint_state(&loc) {
                Ok(CheckpointState::Damaged {
                    repairable: Some(_),
                    ..
                }) if !done => {}
                _ => v.extend(committed_and_whole(&dir, "repair")),
            }
            shardwise::crashtest::after_restart(&dir);
            match shardwise::commit::repair(&loc, Duration::from_secs(5)) {
                Ok(_) => v.extend(committed_and_whole(&dir, "after the rerun")),
                Err(_) if v.is_empty() && shardwise::commit::state::is_committed(&loc) => {}
                Err(e) => v.push(format!("the rerun fails: {e}")),
            }
            v
        },
    });
    report("repair", &s);
}
