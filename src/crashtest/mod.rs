//! The crash-test harness (feature `failpoints`, tests only): every point at which an operation
//! changes durable state ([`crate::failpoint`]), ended there as a process death and as a power
//! loss, and each state it leaves checked.
//!
//! [`enumerate`] runs in a `#[test]` and re-runs that test's binary for the one test
//! ([`Scenario::test`], `--exact`) as a child process per point:
//! 1. the scenario's [`Scenario::setup`] makes a template folder (the earlier checkpoint, the
//!    tracker...);
//! 2. a child runs [`Scenario::run`] on a copy of it with a recording hook: the list of points,
//!    each named by its operation, its path (temporary names without their pid) and its
//!    occurrence, so that threads writing at once still name the same points;
//! 3. for each point, and once after the operation returned, a child runs it again on a fresh copy
//!    and, at that point, writes each state a power loss may leave ([`model::Model::states`])
//!    beside it, then ends at once (`_exit`, no destructor or cleanup runs): the copy is what a
//!    process death leaves;
//! 4. each state is checked: every [`Scenario::untouched`] path byte-identical to the template,
//!    then [`Scenario::check`] (the commit state, verify, a rerun).
//!
//! The child is told what to do by `SHARDWISE_CRASH` (`record`, a point, or `end`) and
//! `SHARDWISE_CRASH_DIR` (its folder: `root/` is the copy, states go to `power-<n>/`).

pub mod model;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::commit::state::{checkpoint_state, CheckpointState};
use crate::failpoint::{self, Op};
use crate::storage::Location;
use model::{materialize, walk, Model};

/// One operation whose crash points are enumerated.
pub struct Scenario {
    /// The `#[test]` function that calls [`enumerate`], as `cargo test` names it: the child runs
    /// it alone (`--exact`).
    pub test: &'static str,
    /// Makes what is there before the operation in an empty folder (not enumerated).
    pub setup: fn(&Path),
    /// The operation, in the folder `setup` made.
    pub run: fn(&Path) -> crate::Result<()>,
    /// Paths (relative to the folder) that every state must hold byte for byte as `setup` made
    /// them: the earlier checkpoint, the tracker.
    pub untouched: &'static [&'static str],
    /// The violations of one state (none: it is fine): `done` when the operation had returned
    /// (what it committed must be there). It may change the folder (a rerun).
    pub check: fn(&Path, bool) -> Vec<String>,
}

/// What [`enumerate`] found.
#[derive(Debug, Default)]
pub struct Summary {
    /// Crash points, the one after the operation returned included.
    pub points: usize,
    /// States checked: one process death per point, and the distinct power-loss states.
    pub states: usize,
    /// Power-loss states among them.
    pub power_states: usize,
    /// Points per step and operation (`step: op`).
    pub steps: BTreeMap<String, usize>,
    /// Each violation, naming the point and the state.
    pub violations: Vec<String>,
    /// Wall time in seconds.
    pub seconds: f64,
}

const MODE: &str = "SHARDWISE_CRASH";
const DIR: &str = "SHARDWISE_CRASH_DIR";

/// Enumerates the crash points of `s` (see the module docs). In the child processes it runs the
/// operation and never returns.
pub fn enumerate(s: &Scenario) -> Summary {
    if let (Ok(mode), Ok(dir)) = (std::env::var(MODE), std::env::var(DIR)) {
        child(s, &mode, Path::new(&dir));
    }
    let t0 = Instant::now();
    let base = scratch(s.test);
    let template = base.join("template");
    std::fs::create_dir_all(&template).expect("template folder");
    (s.setup)(&template);
    let record = base.join("record");
    copy_tree(&template, &record.join("root"));
    spawn(s, "record", &record).expect("the recording run");
    let points = std::fs::read_to_string(record.join("points")).expect("the points recorded");
    let points: Vec<&str> = points.lines().collect();
    let mut sum = Summary::default();
    for p in &points {
        let mut f = p.split('\t');
        let (op, step) = (f.next().unwrap_or(""), f.nth(2).unwrap_or(""));
        *sum.steps.entry(format!("{step}: {op}")).or_default() += 1;
    }
    // `SHARDWISE_CRASH_VERBOSE=1`: every point and state with its outcome, on stderr.
    let verbose = std::env::var_os("SHARDWISE_CRASH_VERBOSE").is_some();
    let at = base.join("point");
    for (i, point) in points.iter().map(|p| Some(*p)).chain([None]).enumerate() {
        let _ = std::fs::remove_dir_all(&at);
        copy_tree(&template, &at.join("root"));
        let name = point.map_or("end".to_string(), |p| format!("#{i} {p}"));
        let mode = point.map_or("end".to_string(), |p| {
            let f: Vec<&str> = p.split('\t').collect();
            format!("{}\t{}\t{}", f[0], f[1], f[2])
        });
        sum.points += 1;
        if let Err(e) = spawn(s, &mode, &at) {
            sum.violations.push(format!("{name}: {e}"));
            continue;
        }
        if let Ok(e) = std::fs::read_to_string(at.join("model-error")) {
            sum.violations.push(format!("{name}: harness: {e}"));
        }
        let powers = std::fs::read_to_string(at.join("states")).unwrap_or_default();
        let mut states = vec![("process death".to_string(), at.join("root"))];
        for (n, desc) in powers.lines().filter(|l| !l.is_empty()).enumerate() {
            states.push((format!("power loss {desc}"), at.join(format!("power-{n}"))));
        }
        sum.power_states += states.len() - 1;
        for (desc, dir) in states {
            sum.states += 1;
            let found = check_state(s, &template, &dir, point.is_none());
            if verbose {
                eprintln!(
                    "{name} [{desc}]: {}",
                    if found.is_empty() { "ok" } else { "VIOLATION" }
                );
            }
            for v in found {
                sum.violations.push(format!("{name} [{desc}]: {v}"));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&base);
    sum.seconds = t0.elapsed().as_secs_f64();
    sum
}

/// The untouched paths, then the scenario's own checks.
fn check_state(s: &Scenario, template: &Path, state: &Path, done: bool) -> Vec<String> {
    let mut out = Vec::new();
    for u in s.untouched {
        if tree_bytes(&template.join(u)) != tree_bytes(&state.join(u)) {
            out.push(format!("{u} changed"));
        }
    }
    out.extend((s.check)(state, done));
    out
}

/// A path's files (itself, or everything under it) with their bytes.
fn tree_bytes(path: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    if path.is_file() {
        return BTreeMap::from([(PathBuf::new(), std::fs::read(path).unwrap_or_default())]);
    }
    walk(path)
        .into_iter()
        .filter(|(_, dir)| !dir)
        .map(|(rel, _)| {
            let bytes = std::fs::read(path.join(&rel)).unwrap_or_default();
            (rel, bytes)
        })
        .collect()
}

/// A fresh scratch folder for `test`: in `/dev/shm` where there is one (a tmpfs: thousands of
/// fsyncs cost nothing there, and the model, not the disk, says what is durable).
fn scratch(test: &str) -> PathBuf {
    let shm = Path::new("/dev/shm");
    let parent = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let dir = parent.join(format!("shardwise-crash-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Copies `from` into the new folder `to`, files with their modification times (the parts of a
/// save record them).
pub fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("copy");
    for (rel, is_dir) in walk(from) {
        if is_dir {
            std::fs::create_dir_all(to.join(&rel)).expect("copy");
        } else {
            let content = model::Content::read(&from.join(&rel));
            let tree = BTreeMap::from([(rel, Some(content))]);
            materialize(&tree, to).expect("copy");
        }
    }
}

/// Runs the test's binary for the one test, as a child in `mode` on `dir`.
fn spawn(s: &Scenario, mode: &str, dir: &Path) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = std::process::Command::new(exe)
        .args([s.test, "--exact", "--test-threads=1", "--nocapture"])
        .env(MODE, mode)
        .env(DIR, dir)
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.code() == Some(0) {
        return Ok(());
    }
    Err(format!(
        "the child ended with {}: {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

/// What a child knows while the operation runs.
struct Child {
    root: PathBuf,
    dir: PathBuf,
    model: Model,
    /// Occurrences of each point seen so far.
    seen: BTreeMap<String, usize>,
    /// `op \t path \t occurrence \t step` of each point, in order.
    log: Vec<String>,
    /// The point to end at: `op \t path \t occurrence`.
    target: Option<String>,
}

/// The child process (see the module docs); never returns.
fn child(s: &Scenario, mode: &str, dir: &Path) -> ! {
    let root = dir.join("root");
    let state = Arc::new(Mutex::new(Child {
        root: root.clone(),
        dir: dir.to_path_buf(),
        model: Model::new(&root),
        seen: BTreeMap::new(),
        log: Vec::new(),
        target: (mode != "record" && mode != "end").then(|| mode.to_string()),
    }));
    let hook = state.clone();
    failpoint::set_hook(Some(Box::new(move |op, path| {
        let mut c = hook.lock().unwrap_or_else(|e| e.into_inner());
        c.point(op, path);
    })));
    let result = (s.run)(&root);
    failpoint::set_hook(None);
    let c = state.lock().unwrap_or_else(|e| e.into_inner());
    if let Err(e) = result {
        eprintln!("the operation failed: {e}");
        exit(2);
    }
    match mode {
        "record" => {
            let mut text = c.log.join("\n");
            text.push('\n');
            std::fs::write(dir.join("points"), text).expect("points");
            exit(0)
        }
        "end" => c.crash(),
        _ => {
            eprintln!("point {mode:?} was not reached");
            exit(3)
        }
    }
}

impl Child {
    /// One point: named, recorded, and the end of the process when it is the target.
    fn point(&mut self, op: Op<'_>, path: &Path) {
        let key = format!("{}\t{}", op.name(), self.name(path));
        let n = self.seen.entry(key.clone()).or_default();
        *n += 1;
        let id = format!("{key}\t{n}");
        if self.target.as_deref() == Some(id.as_str()) {
            self.crash();
        }
        self.log.push(format!("{id}\t{}", failpoint::step_of(path)));
        self.model.record(op, path);
    }

    /// `path` relative to the root, temporary names without their pid and sequence number.
    fn name(&self, path: &Path) -> String {
        let rel = path.strip_prefix(&self.root).unwrap_or(path);
        let rel = rel.to_string_lossy();
        match rel.find(".tmp.") {
            Some(at) => format!("{}.tmp.*", &rel[..at]),
            None => rel.into_owned(),
        }
    }

    /// Writes the power-loss states of this point beside the root, then ends the process.
    fn crash(&self) -> ! {
        if let Err(e) = self.model.check_against_disk() {
            let _ = std::fs::write(self.dir.join("model-error"), e);
        }
        let mut seen = HashSet::new();
        seen.insert(fingerprint(
            &self.model.tree(model::Names::All, model::Data::Written),
        ));
        let mut descs = Vec::new();
        for (names, data) in self.model.states() {
            let tree = self.model.tree(names, data);
            if !seen.insert(fingerprint(&tree)) {
                continue;
            }
            let out = self.dir.join(format!("power-{}", descs.len()));
            materialize(&tree, &out).expect("a power-loss state");
            descs.push(self.model.describe(names, data));
        }
        let mut text = descs.join("\n");
        text.push('\n');
        std::fs::write(self.dir.join("states"), text).expect("states");
        exit(0)
    }
}

/// A digest of a state's tree: paths, bytes and modification times.
fn fingerprint(tree: &BTreeMap<PathBuf, Option<model::Content>>) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for (rel, c) in tree {
        rel.hash(&mut h);
        if let Some(c) = c {
            c.data.hash(&mut h);
            c.mtime.hash(&mut h);
        }
    }
    h.finish()
}

/// Ends the process at once: no destructor, no buffered output, no cleanup (a crash).
fn exit(code: i32) -> ! {
    // SAFETY: `_exit` ends the process; nothing after it runs.
    unsafe { libc::_exit(code) }
}

/// What `status` says of `dir` against what `verify` finds: committed and whole, or not committed
/// with a cause; never damaged. Returns the violations and whether it is committed.
pub fn status_and_verify_agree(dir: &Path) -> (Vec<String>, bool) {
    let loc = Location::local(dir);
    let state = checkpoint_state(&loc);
    let verified = crate::verify::verify(&loc, &|_| {}, &|_| {});
    let clean = matches!(&verified, Ok(r) if r.problems.is_empty());
    let v = match &state {
        Ok(CheckpointState::Committed { .. }) if clean => vec![],
        Ok(CheckpointState::Committed { .. }) => {
            vec![format!("status: committed, verify: {verified:?}")]
        }
        Ok(CheckpointState::NotCommitted { reason }) if reason.is_empty() || clean => {
            vec![format!(
                "status: not committed ({reason:?}), verify clean: {clean}"
            )]
        }
        Ok(CheckpointState::NotCommitted { .. }) => vec![],
        Ok(CheckpointState::Damaged { reason, .. }) => vec![format!("damaged: {reason}")],
        Err(e) => vec![format!("status fails: {e}")],
    };
    (v, matches!(state, Ok(CheckpointState::Committed { .. })))
}

/// `dir` is committed and verifies clean.
pub fn committed_and_whole(dir: &Path, what: &str) -> Vec<String> {
    match status_and_verify_agree(dir) {
        (v, true) if v.is_empty() => vec![],
        (v, _) => vec![format!("{what}: not committed and whole: {v:?}")],
    }
}

/// Makes `dir` look as it does when a rerun comes after a restart, at least a minute after the
/// crash: the `COMMITTING` locks there are a minute old (a merger waits up to 10 s on an empty
/// lock of a holder that may be about to record itself). Nothing else changes: the parts record
/// their data files' modification times.
pub fn after_restart(dir: &Path) {
    let past = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
    for (rel, is_dir) in walk(dir) {
        if !is_dir && rel.file_name().is_some_and(|n| n == "COMMITTING") {
            if let Ok(f) = std::fs::File::options().write(true).open(dir.join(&rel)) {
                let _ = f.set_times(std::fs::FileTimes::new().set_modified(past));
            }
        }
    }
}
