//! shardwise: collective-free writer for Megatron-Core `torch_dist` (PyTorch DCP) checkpoints.
//!
//! Each rank writes its own main-replica chunks ([`writer`]), publishes a metadata part, and a
//! merging rank commits the global `.metadata` through a file-based rendezvous ([`commit`]).
//!
//! This is the core crate of the workspace: the format, storage, commit protocol, save and load.
//! The HF converters (`shardwise-hf`), the `shardwise` command (`shardwise-cli`) and the Python
//! binding (`shardwise-py`, built into `shardwise._native` by `shardwise-ext`) build on it
//! (docs/architecture.md, "Layout of the repository").

// Every public item is documented: the crates above build on them (issue 39).
#![deny(missing_docs)]

pub mod blockcrc;
pub mod commit;
#[cfg(feature = "failpoints")]
pub mod crashtest;
pub mod dcp_local;
pub mod error;
pub mod failpoint;
pub mod format;
pub mod fuzzing;
pub mod gpu;
pub mod hints;
pub mod interrupt;
pub mod load;
pub mod reader;
pub mod save;
pub mod staging;
pub mod status;
pub mod storage;
pub mod torch_compat;
pub mod verify;
pub mod workers;
pub mod writer;

pub use error::{Error, Result};

/// The golden checkpoints that real torch and megatron-core wrote, kept in the repository
/// (`tests/fixtures/`, made by `tools/fixtures/`; tests/fixtures/README.md), for the unit tests.
/// Panics when absent: a golden test that cannot find its goldens must fail, not pass vacuously.
#[cfg(test)]
pub(crate) fn golden_fixtures() -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    assert!(
        dir.join("dcp").is_dir(),
        "golden fixtures not found at {}",
        dir.display()
    );
    dir
}
