//! `shardwise verify`: proves a checkpoint whole, or lists every problem with key, file and offset.
//!
//! Checks: the layout of every tensor key (bounds, overlaps, coverage), that every item lies inside
//! its file and decodes (tensor items: dtype and shape as `.metadata` says), the CRC-32 of every zip
//! record that carries one (torch writes real CRCs; its reader never checks them), and, for
//! checkpoints shardwise wrote, the CRC-32 of every item recorded in the checksum sidecar.

use std::collections::HashMap;

use rayon::prelude::*;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::format::archive::records;
use crate::format::metadata::{check_layout, Chunk, Entry, StorageInfo};
use crate::reader::{check_relative_path, Checkpoint};
use crate::rendezvous::read_checksums;

/// One problem found.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Problem {
    pub key: String,
    pub file: Option<String>,
    pub offset: Option<u64>,
    pub message: String,
}

/// What `verify` found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    pub keys: usize,
    pub items: usize,
    /// Items whose CRC-32 was checked against the sidecar.
    pub sidecar_checked: usize,
    pub problems: Vec<Problem>,
}

struct Item<'a> {
    key: &'a str,
    chunk: Option<(usize, &'a Chunk)>,
    path: &'a str,
    offset: u64,
    length: u64,
}

/// Verifies the checkpoint at `loc` (directory or object-store prefix); `progress(n)` is called
/// as items complete.
///
/// Errors: only when `.metadata` itself cannot be read or decoded; every other finding is a
/// [`Problem`] in the report.
pub fn verify(loc: &crate::storage::Location, progress: &(dyn Fn(u64) + Sync)) -> Result<Report> {
    let ckpt = Checkpoint::open(loc)?;
    let mut report = Report {
        keys: ckpt.metadata.entries.len(),
        ..Default::default()
    };
    let mut items = Vec::new();
    for (key, entry) in &ckpt.metadata.entries {
        match entry {
            Entry::Tensor {
                global_shape,
                chunks,
                ..
            } => {
                let refs: Vec<&Chunk> = chunks.iter().collect();
                let origin = |i: usize| {
                    format!(
                        "chunk #{i} ({}@{})",
                        chunks[i].storage.relative_path, chunks[i].storage.offset
                    )
                };
                if let Err(message) = check_layout(key, global_shape, &refs, &origin) {
                    report.problems.push(Problem {
                        key: key.clone(),
                        file: None,
                        offset: None,
                        message,
                    });
                }
                for (i, c) in chunks.iter().enumerate() {
                    items.push(Item {
                        key,
                        chunk: Some((i, c)),
                        path: &c.storage.relative_path,
                        offset: c.storage.offset,
                        length: c.storage.length,
                    });
                }
            }
            Entry::Bytes { storage } => items.push(Item {
                key,
                chunk: None,
                path: &storage.relative_path,
                offset: storage.offset,
                length: storage.length,
            }),
        }
    }
    report.items = items.len();

    let sidecar = read_checksums(ckpt.location())?;
    let sums: HashMap<(&str, Option<&[u64]>), (&str, u64, u64, u32)> = sidecar
        .as_ref()
        .map(|s| {
            s.items
                .iter()
                .map(|i| {
                    (
                        (i.fqn.as_str(), i.offsets.as_deref()),
                        (i.relative_path.as_str(), i.offset, i.length, i.crc32),
                    )
                })
                .collect()
        })
        .unwrap_or_default();

    let results: Vec<(Vec<Problem>, bool)> = items
        .par_iter()
        .map(|it| {
            let r = check_item(&ckpt, it, &sums);
            progress(1);
            r
        })
        .collect();
    for (problems, checked) in results {
        report.problems.extend(problems);
        report.sidecar_checked += checked as usize;
    }
    Ok(report)
}

fn check_item(
    ckpt: &Checkpoint,
    it: &Item,
    sums: &HashMap<(&str, Option<&[u64]>), (&str, u64, u64, u32)>,
) -> (Vec<Problem>, bool) {
    let problem = |message: String| Problem {
        key: it.key.to_string(),
        file: Some(it.path.to_string()),
        offset: Some(it.offset),
        message,
    };
    if it.path.is_empty() {
        let message = "no storage_data entry for this chunk in .metadata".to_string();
        return (
            vec![Problem {
                key: it.key.to_string(),
                file: None,
                offset: None,
                message,
            }],
            false,
        );
    }
    if let Err(message) = check_relative_path(it.path) {
        return (vec![problem(message)], false);
    }
    let mut problems = Vec::new();
    let offsets = it.chunk.map(|(_, c)| c.offsets.as_slice());
    let blob = match it.chunk {
        Some((i, _)) => ckpt.chunk(it.key, i).map(|(d, _)| d.blob),
        None => ckpt.item(
            it.key,
            None,
            &StorageInfo {
                relative_path: it.path.into(),
                offset: it.offset,
                length: it.length,
            },
            1 << 34,
        ),
    };
    let blob = match blob {
        Ok(b) => b,
        Err(e) => return (vec![problem(strip(e))], false),
    };
    match records(&blob) {
        Ok(recs) => {
            for r in recs.iter().filter(|r| r.crc != 0) {
                let got = crc32fast::hash(&blob[r.start..r.start + r.len]);
                if got != r.crc {
                    problems.push(problem(format!(
                        "record {} fails its zip CRC-32 (stored {:08x}, computed {got:08x})",
                        r.name, r.crc
                    )));
                }
            }
        }
        Err(e) => problems.push(problem(format!("not a torch.save archive: {}", e.0))),
    }
    let mut checked = false;
    if let Some(&(path, offset, length, crc)) = sums.get(&(it.key, offsets)) {
        checked = true;
        if (path, offset, length) != (it.path, it.offset, it.length) {
            problems.push(problem(format!("checksum sidecar places this item at {path}@{offset}+{length}, .metadata at {}@{}+{}", it.path, it.offset, it.length)));
        } else {
            // Our writer applies no stream transform, so the item bytes are the stored bytes.
            let got = crc32fast::hash(&blob);
            if got != crc {
                problems.push(problem(format!(
                    "item bytes fail the CRC-32 recorded at save time (recorded {crc:08x}, computed {got:08x})"
                )));
            }
        }
    }
    (problems, checked)
}

fn strip(e: Error) -> String {
    match e {
        Error::Corrupt { reason, .. } => reason,
        other => other.to_string(),
    }
}
