//! Every golden checkpoint in `tests/fixtures/` (torch 2.3.1, 2.5.1, 2.8.0, 2.15.0 and
//! megatron-core 0.13.1, 0.15.0, 0.16.1 incl. MoE) reads back byte-exactly: each tensor's bytes hash
//! to the sha256 in its `expected.json`, and so does each byte object's archive.

mod common;
use common::fixtures;

use sha2::{Digest, Sha256};
use shardwise::format::metadata::Entry;
use shardwise::load::read_region;
use shardwise::reader::Checkpoint;
use shardwise::storage::Location;

fn hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn golden_checkpoints_read_back_byte_exactly() {
    let mut dirs = Vec::new();
    for group in ["dcp", "megatron"] {
        for e in std::fs::read_dir(fixtures().join(group)).unwrap() {
            dirs.push(e.unwrap().path());
        }
    }
    dirs.sort();
    assert!(dirs.len() >= 8, "{dirs:?}");
    for dir in dirs {
        let expected: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
        let ckpt = Checkpoint::open(&Location::local(&dir))
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let keys = expected["keys"].as_object().unwrap();
        assert_eq!(ckpt.metadata.entries.len(), keys.len(), "{}", dir.display());
        for (key, k) in keys {
            let entry = ckpt.entry(key).unwrap();
            match (k["kind"].as_str().unwrap(), entry) {
                (
                    "tensor",
                    Entry::Tensor {
                        dtype,
                        global_shape,
                        ..
                    },
                ) => {
                    assert_eq!(dtype.torch_name(), k["dtype"].as_str().unwrap(), "{key}");
                    let shape: Vec<u64> = k["shape"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|v| v.as_u64().unwrap())
                        .collect();
                    assert_eq!(global_shape, &shape, "{key}");
                    let mut out = vec![0u8; k["nbytes"].as_u64().unwrap() as usize];
                    read_region(&ckpt, key, &vec![0; shape.len()], &shape, &mut out)
                        .unwrap_or_else(|e| panic!("{}: {key}: {e}", dir.display()));
                    assert_eq!(
                        hex(&out),
                        k["sha256"].as_str().unwrap(),
                        "{} {key}",
                        dir.display()
                    );
                }
                ("bytes", Entry::Bytes { .. }) => {
                    let raw = ckpt.read_bytes(key, 1 << 30).unwrap();
                    assert_eq!(
                        hex(&raw),
                        k["storage"]["blob_sha256"].as_str().unwrap(),
                        "{} {key}",
                        dir.display()
                    );
                }
                (kind, _) => panic!("{}: {key}: expected {kind}", dir.display()),
            }
        }
    }
}

#[test]
fn regions_assemble_across_chunks() {
    // megatron fixture: a TP-sharded weight split across ranks; read a box straddling both chunks.
    let dir = fixtures().join("megatron/core-0.16.1_torch-2.15");
    let ckpt = Checkpoint::open(&Location::local(&dir)).unwrap();
    let (key, shape) = ckpt
        .metadata
        .entries
        .iter()
        .find_map(|(k, e)| match e {
            Entry::Tensor {
                global_shape,
                chunks,
                ..
            } if chunks.len() >= 2 && global_shape.len() >= 2 => {
                Some((k.clone(), global_shape.clone()))
            }
            _ => None,
        })
        .unwrap();
    let item = match ckpt.entry(&key).unwrap() {
        Entry::Tensor { dtype, .. } => dtype.itemsize() as usize,
        _ => unreachable!(),
    };
    let n: u64 = shape.iter().product();
    let mut full = vec![0u8; n as usize * item];
    read_region(&ckpt, &key, &vec![0; shape.len()], &shape, &mut full).unwrap();
    // Every 1-element box must equal the matching element of the full read.
    let strides: Vec<u64> = shardwise::format::zip::contiguous_strides(&shape);
    for flat in (0..n).step_by((n / 97).max(1) as usize) {
        let idx: Vec<u64> = (0..shape.len())
            .map(|d| flat / strides[d] % shape[d])
            .collect();
        let mut one = vec![0u8; item];
        read_region(&ckpt, &key, &idx, &vec![1; shape.len()], &mut one).unwrap();
        assert_eq!(
            one,
            full[flat as usize * item..(flat as usize + 1) * item],
            "{key} {idx:?}"
        );
    }
}
