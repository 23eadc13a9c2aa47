//! The DCP / torch_dist on-disk format: dtypes, the pickle emitter, the torch.save zip container
//! and the global `.metadata`.
pub mod archive;
pub mod dtype;
pub mod fuzzing;
pub mod metadata;
pub mod pickle;
pub mod read_metadata;
pub mod unpickle;
pub mod zip;
