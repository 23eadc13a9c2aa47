//! The DCP / torch_dist on-disk format: dtypes, the pickle emitter, the torch.save zip container
//! and the global `.metadata`.
pub mod dtype;
pub mod metadata;
pub mod pickle;
pub mod zip;
pub mod unpickle;
