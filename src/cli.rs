//! The `shardwise` command line: inspect, verify, status and merge checkpoints.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Parser, Subcommand};
use serde::Serialize;

use crate::error::{fmt_ranks, Error, Result};
use crate::format::metadata::Entry;
use crate::reader::Checkpoint;
use crate::rendezvous::{self, RankPart};
use crate::storage::Location;

const EXIT_CODES: &str = "Exit codes:\n  0  success (verify: no problem found)\n  1  the operation failed, or verify found problems\n  2  bad command line";

#[derive(Parser, Debug)]
#[command(name = "shardwise", version, about = "Collective-free Megatron torch_dist / PyTorch DCP checkpoints", after_help = EXIT_CODES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Table of the tensors and byte objects of a committed checkpoint (key, dtype, global shape, chunks, bytes).
    #[command(after_help = EXIT_CODES)]
    Inspect {
        /// Checkpoint directory or URL (s3://, gs://, az://); torch DCP or Megatron torch_dist, written by anyone.
        dir: String,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Check that a checkpoint is whole: layout, item bounds, decoding, zip CRCs and shardwise's per-item CRCs.
    #[command(after_help = EXIT_CODES)]
    Verify {
        /// Checkpoint directory or URL.
        dir: String,
        #[arg(long)]
        json: bool,
    },
    /// Saves in a directory: save id, rank parts and their age, missing ranks, commit state, layout.
    #[command(after_help = EXIT_CODES)]
    Status {
        /// Checkpoint directory or URL.
        dir: String,
        /// Also list every key with its dtype, global shape, chunk count and the ranks that saved it.
        #[arg(long)]
        keys: bool,
        #[arg(long)]
        json: bool,
    },
    /// Convert a checkpoint to Hugging Face safetensors, streaming: only the byte ranges each HF tensor
    /// needs are read, and memory stays at about threads x the largest HF tensor.
    #[command(name = "to-hf", after_help = EXIT_CODES)]
    ToHf {
        /// Checkpoint directory or URL (torch_dist / DCP).
        dir: String,
        /// Output directory for model-0000k-of-0000n.safetensors and model.safetensors.index.json.
        out: PathBuf,
        /// HF config.json: hyperparameters (checked against common.pt args) and copied to the output.
        #[arg(long)]
        hf_config: Option<PathBuf>,
        /// Architecture (llama, qwen2, qwen3, qwen3_moe, mixtral); default: the config's model_type.
        #[arg(long)]
        arch: Option<String>,
        /// Output dtype: bf16, fp16 or fp32 (default: as stored).
        #[arg(long)]
        dtype: Option<String>,
        /// Largest output file, e.g. 5GB.
        #[arg(long, default_value = "5GB")]
        max_shard_size: String,
        /// Worker threads (default: the number of CPUs).
        #[arg(long)]
        threads: Option<usize>,
        /// Skip checkpoint keys that no rule maps instead of failing.
        #[arg(long)]
        allow_unmapped: bool,
        #[arg(long)]
        json: bool,
    },
    /// Merge the per-rank parts of a save and commit `.metadata` (finishes a save whose merging rank died).
    /// Idempotent; when two mergers race, one commits and both succeed.
    #[command(after_help = EXIT_CODES)]
    Merge {
        /// Checkpoint directory or URL.
        dir: String,
        /// Save id to merge (default: the only uncommitted save under `.shardwise/`).
        #[arg(long)]
        save_id: Option<String>,
        /// Number of ranks (default: the world_size recorded in the parts).
        #[arg(long)]
        world_size: Option<u32>,
        /// Seconds to wait for missing parts.
        #[arg(long, default_value_t = 0.0)]
        timeout: f64,
        #[arg(long)]
        json: bool,
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
    let result = (|| match cli.command {
        Command::Inspect { dir, json } => inspect(&Location::parse(&dir)?, json),
        Command::Verify { dir, json } => verify(&Location::parse(&dir)?, json),
        Command::Status { dir, keys, json } => status(&Location::parse(&dir)?, keys, json),
        Command::Merge {
            dir,
            save_id,
            world_size,
            timeout,
            json,
        } => merge(&Location::parse(&dir)?, save_id, world_size, timeout, json),
        Command::ToHf {
            dir,
            out,
            hf_config,
            arch,
            dtype,
            max_shard_size,
            threads,
            allow_unmapped,
            json,
        } => to_hf(
            &Location::parse(&dir)?,
            &out,
            hf_config,
            arch,
            dtype,
            &max_shard_size,
            threads,
            allow_unmapped,
            json,
        ),
    })();
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("shardwise: error: {e}");
            1
        }
    }
}

fn print_json<T: Serialize>(value: &T) {
    println!(
        "{}",
        serde_json::to_string_pretty(value).expect("serializable")
    );
}

#[derive(Serialize)]
struct KeyRow {
    key: String,
    kind: &'static str,
    dtype: Option<&'static str>,
    global_shape: Option<Vec<u64>>,
    chunks: usize,
    bytes: u64,
}

fn inspect(dir: &Location, json: bool) -> Result<i32> {
    let ckpt = Checkpoint::open(dir)?;
    let rows: Vec<KeyRow> = ckpt
        .metadata
        .entries
        .iter()
        .map(|(k, e)| match e {
            Entry::Tensor {
                dtype,
                global_shape,
                chunks,
            } => KeyRow {
                key: k.clone(),
                kind: "tensor",
                dtype: Some(dtype.torch_name()),
                global_shape: Some(global_shape.clone()),
                chunks: chunks.len(),
                bytes: chunks.iter().map(|c| c.storage.length).sum(),
            },
            Entry::Bytes { storage } => KeyRow {
                key: k.clone(),
                kind: "object",
                dtype: None,
                global_shape: None,
                chunks: 1,
                bytes: storage.length,
            },
        })
        .collect();
    let tensors = rows.iter().filter(|r| r.kind == "tensor").count();
    let total: u64 = rows.iter().map(|r| r.bytes).sum();
    if json {
        #[derive(Serialize)]
        struct Out<'a> {
            dir: String,
            metadata_class: &'a str,
            tensors: usize,
            objects: usize,
            bytes: u64,
            keys: &'a [KeyRow],
        }
        print_json(&Out {
            dir: dir.to_string(),
            metadata_class: &ckpt.metadata.class,
            tensors,
            objects: rows.len() - tensors,
            bytes: total,
            keys: &rows,
        });
        return Ok(0);
    }
    let width = rows.iter().map(|r| r.key.len()).max().unwrap_or(3).max(3);
    println!(
        "{:<width$}  {:<6}  {:<13}  {:<20}  {:>6}  {:>12}",
        "key", "kind", "dtype", "global shape", "chunks", "bytes"
    );
    for r in &rows {
        let shape = r
            .global_shape
            .as_ref()
            .map(|s| format!("{s:?}"))
            .unwrap_or_default();
        println!(
            "{:<width$}  {:<6}  {:<13}  {:<20}  {:>6}  {:>12}",
            r.key,
            r.kind,
            r.dtype.unwrap_or("-"),
            shape,
            r.chunks,
            r.bytes
        );
    }
    println!(
        "{} tensors, {} objects, {} bytes in items ({})",
        tensors,
        rows.len() - tensors,
        total,
        ckpt.metadata.class
    );
    Ok(0)
}

fn verify(dir: &Location, json: bool) -> Result<i32> {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("verify {bar:40} {pos}/{len} items {elapsed}")
            .expect("template"),
    );
    if json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    // The item count is known only once .metadata is read; verify() reports progress per item.
    let ckpt_items = Checkpoint::open(dir)?
        .metadata
        .entries
        .values()
        .map(|e| match e {
            Entry::Tensor { chunks, .. } => chunks.len() as u64,
            Entry::Bytes { .. } => 1,
        })
        .sum();
    bar.set_length(ckpt_items);
    let report = crate::verify::verify(dir, &|n| bar.inc(n))?;
    bar.finish_and_clear();
    if json {
        print_json(&report);
    } else {
        for p in &report.problems {
            let at = match (&p.file, p.offset) {
                (Some(f), Some(o)) => format!(" [{f} @ {o}]"),
                _ => String::new(),
            };
            println!("PROBLEM {}{at}: {}", p.key, p.message);
        }
        println!(
            "{}: {} keys, {} items, {} checked against save-time CRC-32s: {}",
            dir,
            report.keys,
            report.items,
            report.sidecar_checked,
            if report.problems.is_empty() {
                "OK".to_string()
            } else {
                format!("{} PROBLEMS", report.problems.len())
            }
        );
    }
    Ok(if report.problems.is_empty() { 0 } else { 1 })
}

fn save_ids(dir: &Location) -> Result<Vec<String>> {
    if let Some(d) = dir.as_local().filter(|d| !d.is_dir()) {
        return Err(Error::InvalidArgument(format!(
            "{} is not a directory",
            d.display()
        )));
    }
    let (_, mut ids) = dir.list(rendezvous::STATE_DIR)?;
    ids.sort();
    Ok(ids)
}

/// `(rank, part or error, age in seconds)` of every part file of a save.
fn read_parts(dir: &Location, save_id: &str) -> Vec<(u32, Result<RankPart>, f64)> {
    let listed = rendezvous::listed_parts(dir, save_id).unwrap_or_default();
    let mut out: Vec<_> = listed
        .into_iter()
        .map(|(r, f)| {
            let rel = format!("{}/{}", rendezvous::save_rel(save_id), f.name);
            (r, rendezvous::read_part(dir, &rel), f.age_s)
        })
        .collect();
    out.sort_by_key(|(r, _, _)| *r);
    out
}

#[derive(Serialize)]
struct RankStatus {
    rank: u32,
    age_s: f64,
    tensor_chunks: usize,
    byte_objects: usize,
    bytes: u64,
    files: Vec<String>,
    common: bool,
    error: Option<String>,
}

#[derive(Serialize)]
struct SaveStatus {
    save_id: String,
    state: String,
    world_size: u32,
    present: usize,
    missing: Vec<u32>,
    ranks: Vec<RankStatus>,
    keys: BTreeMap<String, (String, Vec<u64>, Vec<u32>)>,
}

fn status(dir: &Location, keys: bool, json: bool) -> Result<i32> {
    let committed = rendezvous::is_committed(dir);
    let mut saves = Vec::new();
    for id in save_ids(dir)? {
        let parts = read_parts(dir, &id);
        let world_size = parts
            .iter()
            .find_map(|(_, p, _)| p.as_ref().ok().map(|p| p.world_size))
            .unwrap_or(0);
        let marker = |m: &str| rendezvous::marker_rel(&id, m);
        let state = if dir.exists(&marker("COMMITTED")) {
            "committed".to_string()
        } else if let Ok(Some(reason)) = dir.read(&marker("FAILED")) {
            format!("failed: {}", String::from_utf8_lossy(&reason))
        } else if let Some(holder) = rendezvous::dead_merger(dir, &id) {
            format!("interrupted: its merger ({holder}) died holding the lock; `shardwise merge` takes over")
        } else if dir.exists(&marker("COMMITTING")) {
            "merging".to_string()
        } else {
            "not committed".to_string()
        };
        let mut layout: BTreeMap<String, (String, Vec<u64>, Vec<u32>)> = BTreeMap::new();
        let mut ranks = Vec::new();
        for (rank, p, age_s) in &parts {
            match p {
                Err(e) => ranks.push(RankStatus {
                    rank: *rank,
                    age_s: *age_s,
                    tensor_chunks: 0,
                    byte_objects: 0,
                    bytes: 0,
                    files: Vec::new(),
                    common: false,
                    error: Some(e.to_string()),
                }),
                Ok(p) => {
                    for t in &p.tensors {
                        let e = layout.entry(t.fqn.clone()).or_insert_with(|| {
                            (t.dtype.clone(), t.global_shape.clone(), Vec::new())
                        });
                        e.2.push(*rank);
                    }
                    ranks.push(RankStatus {
                        rank: *rank,
                        age_s: *age_s,
                        tensor_chunks: p.tensors.len(),
                        byte_objects: p.objects.len(),
                        bytes: p.files.iter().map(|f| f.size).sum(),
                        files: p.files.iter().map(|f| f.name.clone()).collect(),
                        common: p.common.is_some(),
                        error: None,
                    })
                }
            }
        }
        let missing = if world_size > 0 {
            rendezvous::missing_ranks(dir, &id, world_size)?
        } else {
            Vec::new()
        };
        saves.push(SaveStatus {
            save_id: id,
            state,
            world_size,
            present: parts.len(),
            missing,
            ranks,
            keys: layout,
        });
    }
    if json {
        #[derive(Serialize)]
        struct Out {
            dir: String,
            metadata_present: bool,
            saves: Vec<SaveStatus>,
        }
        print_json(&Out {
            dir: dir.to_string(),
            metadata_present: committed,
            saves,
        });
        return Ok(0);
    }
    println!(
        "{}: .metadata {}",
        dir,
        if committed {
            "present (committed)"
        } else {
            "absent (not committed)"
        }
    );
    if saves.is_empty() {
        println!(
            "no shardwise saves (no {} directory)",
            rendezvous::STATE_DIR
        );
    }
    for s in &saves {
        println!(
            "save {}: {}; {} of {} rank parts",
            s.save_id, s.state, s.present, s.world_size
        );
        if !s.missing.is_empty() {
            println!("  missing ranks: [{}]", fmt_ranks(&s.missing));
        }
        for r in &s.ranks {
            match &r.error {
                Some(e) => println!("  rank {}: unreadable part ({:.0}s old): {e}", r.rank, r.age_s),
                None => println!(
                    "  rank {}: {} tensor chunks, {} byte objects, {} bytes in [{}]{}; part {:.0}s old",
                    r.rank,
                    r.tensor_chunks,
                    r.byte_objects,
                    r.bytes,
                    r.files.join(", "),
                    if r.common { " + common.pt" } else { "" },
                    r.age_s
                ),
            }
        }
        println!("  {} tensor keys", s.keys.len());
        if keys {
            for (fqn, (dtype, shape, chunk_ranks)) in &s.keys {
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
    Ok(0)
}

fn merge(
    dir: &Location,
    save_id: Option<String>,
    world_size: Option<u32>,
    timeout: f64,
    json: bool,
) -> Result<i32> {
    let save_id = match save_id {
        Some(s) => s,
        None => {
            let ids: Vec<String> = save_ids(dir)?
                .into_iter()
                .filter(|id| !dir.exists(&rendezvous::marker_rel(id, "COMMITTED")))
                .collect();
            match ids.as_slice() {
                [one] => one.clone(),
                [] => {
                    let all = save_ids(dir)?;
                    match all.as_slice() {
                        [one] => one.clone(), // committed already: merging again is a no-op
                        _ => {
                            return Err(Error::InvalidArgument(format!(
                                "no uncommitted save in {}",
                                dir
                            )))
                        }
                    }
                }
                many => {
                    return Err(Error::InvalidArgument(format!(
                        "several uncommitted saves in {}: {}; pick one with --save-id",
                        dir,
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
            .find_map(|(_, p, _)| p.ok().map(|p| p.world_size))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "save {save_id} has no readable part; pass --world-size"
                ))
            })?,
    };
    if !(timeout.is_finite() && timeout >= 0.0) {
        return Err(Error::InvalidArgument(format!(
            "--timeout must be a number of seconds >= 0, got {timeout}"
        )));
    }
    let summary = rendezvous::merge(dir, &save_id, world_size, Duration::from_secs_f64(timeout))?;
    if json {
        print_json(&summary);
    } else if summary.already_committed {
        println!("save {save_id} is committed (nothing to do)");
    } else {
        println!(
            "committed save {save_id}: {} keys, {} tensor chunks, {} byte objects, {} data bytes, .metadata {} bytes",
            summary.keys, summary.tensor_chunks, summary.byte_objects, summary.data_bytes, summary.metadata_bytes
        );
    }
    Ok(0)
}

#[allow(clippy::too_many_arguments)]
fn to_hf(
    dir: &Location,
    out: &Path,
    hf_config: Option<PathBuf>,
    arch: Option<String>,
    dtype: Option<String>,
    max_shard_size: &str,
    threads: Option<usize>,
    allow_unmapped: bool,
    json: bool,
) -> Result<i32> {
    let opts = crate::hf::HfOptions::from_user(
        hf_config,
        arch,
        dtype.as_deref(),
        max_shard_size,
        threads,
        allow_unmapped,
    )?;
    let bar = indicatif::ProgressBar::new_spinner();
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "to-hf {spinner} {binary_bytes} written {binary_bytes_per_sec} {elapsed}",
        )
        .expect("template"),
    );
    if json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let summary = crate::hf::to_hf(dir, out, &opts, &|n| bar.inc(n))?;
    bar.finish_and_clear();
    if json {
        print_json(&summary);
    } else {
        println!(
            "wrote {} tensors, {} bytes in {} files to {} in {:.2}s ({:.2} GB/s); {} checkpoint keys skipped (optimizer, extra state, objects)",
            summary.tensors,
            summary.bytes,
            summary.files,
            out.display(),
            summary.seconds,
            summary.gb_per_s,
            summary.skipped_keys
        );
    }
    Ok(0)
}
