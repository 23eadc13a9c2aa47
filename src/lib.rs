//! shardwise: collective-free writer for Megatron-Core `torch_dist` (PyTorch DCP) checkpoints.
//!
//! Each rank writes its own main-replica chunks ([`writer`]), publishes a metadata part, and a
//! merging rank commits the global `.metadata` through a file-based rendezvous ([`commit`]).
pub mod blockcrc;
pub mod cli;
pub mod commit;
pub mod dcp_local;
pub mod diff;
pub mod error;
pub mod format;
pub mod fuzzing;
pub mod gpu;
pub mod hf;
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

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};
