//! The `shardwise` command line. `status` and `merge` work from the per-rank parts; reading
//! committed checkpoints (`inspect`, `verify`) comes with the reader.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::error::{fmt_ranks, Error, Result};
use crate::rendezvous::{self, RankPart};

#[derive(Parser, Debug)]
#[command(
    name = "shardwise",
    version,
    about = "Collective-free Megatron torch_dist / PyTorch DCP checkpoints"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Show the saves in a checkpoint directory: per-rank parts, commit state and the tensor layout.
    Status {
        /// Checkpoint directory.
        dir: PathBuf,
        /// Also list every key with its dtype, global shape, chunk count and the ranks that saved it.
        #[arg(long)]
        keys: bool,
    },
    /// Merge the per-rank parts of a save and commit `.metadata` (finishes a save whose merging rank died).
    Merge {
        /// Checkpoint directory.
        dir: PathBuf,
        /// Save id to merge (default: the only save under `.shardwise/`).
        #[arg(long)]
        save_id: Option<String>,
        /// Number of ranks (default: the world_size recorded in the parts).
        #[arg(long)]
        world_size: Option<u32>,
        /// Seconds to wait for missing parts.
        #[arg(long, default_value_t = 0.0)]
        timeout: f64,
    },
}

/// Runs the CLI on `args` (including the program name); returns the process exit code.
pub fn run(args: Vec<String>) -> i32 {
    let cli = match Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    let result = match cli.command {
        Command::Status { dir, keys } => status(&dir, keys),
        Command::Merge {
            dir,
            save_id,
            world_size,
            timeout,
        } => merge(&dir, save_id, world_size, timeout),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("shardwise: error: {e}");
            1
        }
    }
}

fn save_ids(dir: &Path) -> Result<Vec<String>> {
    let state = dir.join(rendezvous::STATE_DIR);
    if !dir.is_dir() {
        return Err(Error::InvalidArgument(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    let mut ids: Vec<String> = match std::fs::read_dir(&state) {
        Ok(rd) => rd
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => Vec::new(),
    };
    ids.sort();
    Ok(ids)
}

fn read_parts(dir: &Path, save_id: &str) -> Vec<(u32, Result<RankPart>)> {
    let sdir = rendezvous::save_dir(dir, save_id);
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(&sdir) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(r) = name
                .strip_suffix(".part")
                .and_then(|r| r.parse::<u32>().ok())
            {
                out.push((r, rendezvous::read_part(&e.path())));
            }
        }
    }
    out.sort_by_key(|(r, _)| *r);
    out
}

fn status(dir: &Path, keys: bool) -> Result<()> {
    let committed_meta = dir.join(".metadata").exists();
    println!(
        "{}: .metadata {}",
        dir.display(),
        if committed_meta {
            "present (committed)"
        } else {
            "absent (not committed)"
        }
    );
    let ids = save_ids(dir)?;
    if ids.is_empty() {
        println!(
            "no shardwise saves (no {} directory)",
            rendezvous::STATE_DIR
        );
    }
    for id in ids {
        let sdir = rendezvous::save_dir(dir, &id);
        let parts = read_parts(dir, &id);
        let world = parts
            .iter()
            .find_map(|(_, p)| p.as_ref().ok().map(|p| p.world_size))
            .unwrap_or(0);
        let state = if sdir.join("COMMITTED").exists() {
            "committed".to_string()
        } else if let Ok(reason) = std::fs::read_to_string(sdir.join("FAILED")) {
            format!("FAILED: {reason}")
        } else {
            "not committed".to_string()
        };
        println!("save {id}: {state}; {} of {world} rank parts", parts.len());
        if world > 0 {
            let missing = rendezvous::missing_ranks(dir, &id, world);
            if !missing.is_empty() {
                println!("  missing ranks: [{}]", fmt_ranks(&missing));
            }
        }
        let mut layout: BTreeMap<String, (String, Vec<u64>, Vec<u32>)> = BTreeMap::new();
        let mut objects = 0usize;
        for (rank, p) in &parts {
            match p {
                Err(e) => println!("  rank {rank}: unreadable part: {e}"),
                Ok(p) => {
                    let bytes: u64 = p.files.iter().map(|f| f.size).sum();
                    let files: Vec<&str> = p.files.iter().map(|f| f.name.as_str()).collect();
                    println!(
                        "  rank {rank}: {} tensor chunks, {} byte objects, {bytes} bytes in [{}]{}",
                        p.tensors.len(),
                        p.objects.len(),
                        files.join(", "),
                        if p.common.is_some() {
                            " + common.pt"
                        } else {
                            ""
                        }
                    );
                    objects += p.objects.len();
                    for t in &p.tensors {
                        let e = layout.entry(t.fqn.clone()).or_insert_with(|| {
                            (t.dtype.clone(), t.global_shape.clone(), Vec::new())
                        });
                        e.2.push(*rank);
                    }
                }
            }
        }
        println!("  {} tensor keys, {objects} byte objects", layout.len());
        if keys {
            for (fqn, (dtype, shape, chunk_ranks)) in &layout {
                let mut ranks = chunk_ranks.clone();
                ranks.dedup();
                println!(
                    "  {fqn}  {dtype} {shape:?}: {} chunks from ranks [{}]",
                    chunk_ranks.len(),
                    fmt_ranks(&ranks)
                );
            }
        }
    }
    Ok(())
}

fn merge(dir: &Path, save_id: Option<String>, world_size: Option<u32>, timeout: f64) -> Result<()> {
    let save_id = match save_id {
        Some(s) => s,
        None => {
            let ids: Vec<String> = save_ids(dir)?
                .into_iter()
                .filter(|id| !rendezvous::save_dir(dir, id).join("COMMITTED").exists())
                .collect();
            match ids.as_slice() {
                [one] => one.clone(),
                [] => {
                    return Err(Error::InvalidArgument(format!(
                        "no uncommitted save in {}",
                        dir.display()
                    )))
                }
                many => {
                    return Err(Error::InvalidArgument(format!(
                        "several uncommitted saves in {}: {}; pick one with --save-id",
                        dir.display(),
                        many.join(", ")
                    )))
                }
            }
        }
    };
    let world_size = match world_size {
        Some(w) => w,
        None => read_parts(dir, &save_id)
            .into_iter()
            .find_map(|(_, p)| p.ok().map(|p| p.world_size))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "save {save_id} has no readable part; pass --world-size"
                ))
            })?,
    };
    let summary = rendezvous::merge(
        dir,
        &save_id,
        world_size,
        Duration::from_secs_f64(timeout.max(0.0)),
    )?;
    println!(
        "committed save {save_id}: {} keys, {} tensor chunks, {} byte objects, {} data bytes, .metadata {} bytes",
        summary.keys, summary.tensor_chunks, summary.byte_objects, summary.data_bytes, summary.metadata_bytes
    );
    Ok(())
}
