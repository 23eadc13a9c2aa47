//! The DCP / torch_dist on-disk format: dtypes, the pickle emitter, the torch.save zip container,
//! the global `.metadata`, shardwise's checksum sidecar, and the names of the files a checkpoint
//! holds beside its data files.
pub mod archive;
pub mod dtype;
pub mod globals;
pub mod metadata;
pub mod pickle;
pub mod read_metadata;
pub mod sidecar;
pub mod split;
pub mod unpickle;
pub mod zip;

/// DCP's global metadata file (torch 2.3-2.15 `torch/distributed/checkpoint/filesystem.py`,
/// `_metadata_fn`): its name in the checkpoint directory; its presence commits a checkpoint.
pub const METADATA_FILE: &str = ".metadata";

/// The common (non-sharded) state of a Megatron checkpoint of megatron-core <= 0.18, a torch.save
/// archive beside `.metadata` (megatron-core 0.16.1 `dist_checkpointing/strategies/common.py`).
pub const COMMON_FILE: &str = "common.pt";

/// Megatron's `metadata.json`: its name in the checkpoint directory.
pub const METADATA_JSON_FILE: &str = "metadata.json";

/// Megatron's `metadata.json` in the 4-field form that megatron-core ≤0.18 requires and 0.19 accepts
/// (`CheckpointingConfig` in `dist_checkpointing/core.py` of megatron-core 0.16.1 and 0.19.2).
pub const MEGATRON_METADATA_JSON: &str = r#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}"#;

/// An empty vector with room for `n` items if that much memory can be had, else with none (it
/// grows as needed). For capacities estimated from an input's size: a sparse file of terabytes
/// must give a decode error, not abort the process when the estimate cannot be allocated.
pub(crate) fn reserved<T>(n: usize) -> Vec<T> {
    let mut v = Vec::new();
    let _ = v.try_reserve_exact(n);
    v
}
