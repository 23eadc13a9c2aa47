//! megatron-core 0.19's integrity manifest, `integrity.json`, written by the commit when the save
//! asked for it (`verify_integrity=True` in the drop-in).
//!
//! Format (megatron-core 0.19.2, `dist_checkpointing/validation.py`, `save_integrity_manifest` and
//! `_verify_integrity_manifest_impl`): `{"algorithm": "sha256", "files": {name: hex digest}}` with
//! `json.dump(..., indent=2)`, one entry per regular file directly in the checkpoint directory
//! (sorted by name, the manifest itself excluded). `load(..., verify_integrity=True)` hashes every
//! listed file again and raises `CheckpointingException` on a missing file or another digest;
//! files it does not list are not checked. Megatron hashes the files after they are written; here
//! every digest comes from the bytes as they were written (data files: [`crate::writer`];
//! `common.pt`, `.metadata`, `metadata.json`: their bytes in memory), so nothing is read back.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use super::part::RankPart;
use crate::error::{Error, Result};
use crate::format::COMMON_FILE;

/// The manifest's name in the checkpoint directory (megatron-core 0.19 `INTEGRITY_FNAME`).
pub const INTEGRITY_FILE: &str = "integrity.json";

/// Lower-case hex of a SHA-256 digest, as Python's `hexdigest()` writes it.
pub fn hex(digest: &[u8; 32]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of `bytes`, in hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes).into())
}

/// The manifest of a commit: file name to SHA-256 hex, sorted by name.
pub struct Manifest(BTreeMap<String, String>);

impl Manifest {
    /// The entries of the ranks' data files and `common.pt` for a commit of `parts`; None when no
    /// rank recorded digests (the save did not ask for a manifest). The commit's own top-level
    /// files (`.metadata`, and `metadata.json` for Megatron saves) are [`Manifest::add`]ed once
    /// written.
    ///
    /// Errors: [`Error::Validation`] when some ranks recorded digests and others did not (the
    /// ranks disagree on `verify_integrity`).
    pub fn of_parts(parts: &[RankPart]) -> Result<Option<Manifest>> {
        let mut files: BTreeMap<String, String> = BTreeMap::new();
        let mut without: Vec<u32> = Vec::new();
        for p in parts {
            let common = p.common.iter().map(|c| (COMMON_FILE, c));
            let data = p.files.iter().map(|f| (f.name.as_str(), f));
            for (name, record) in data.chain(common) {
                match &record.sha256 {
                    Some(d) => {
                        files.insert(name.to_string(), d.clone());
                    }
                    None => without.push(p.rank),
                }
            }
        }
        if files.is_empty() {
            return Ok(None);
        }
        if !without.is_empty() {
            without.dedup();
            return Err(Error::Validation(format!(
                "ranks disagree on verify_integrity: the files of {} carry no SHA-256; nothing committed",
                crate::error::fmt_ranks(&without)
            )));
        }
        Ok(Some(Manifest(files)))
    }

    /// Adds (or replaces) the entry of file `name`, its SHA-256 in hex.
    pub fn add(&mut self, name: &str, sha256_hex: String) {
        self.0.insert(name.to_string(), sha256_hex);
    }

    /// The manifest file's bytes.
    ///
    /// Errors: [`Error::InvalidArgument`] if it cannot be encoded.
    pub fn encode(&self) -> Result<Vec<u8>> {
        #[derive(serde::Serialize)]
        struct Json<'a> {
            algorithm: &'a str,
            files: &'a BTreeMap<String, String>,
        }
        // serde_json's pretty form (2-space indent, ": ") is json.dump(indent=2)'s for these values.
        serde_json::to_vec_pretty(&Json {
            algorithm: "sha256",
            files: &self.0,
        })
        .map_err(|e| Error::InvalidArgument(format!("cannot encode {INTEGRITY_FILE}: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_matches_python_hexdigest() {
        // hashlib.sha256(b"abc").hexdigest()
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
