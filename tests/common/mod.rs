//! Shared by the integration tests: where the golden fixtures are.

use std::path::PathBuf;

/// The golden checkpoints that real torch and megatron-core wrote, kept in the repository
/// (`tests/fixtures/`, made by `tools/fixtures/`; tests/fixtures/README.md). Panics when absent: a
/// golden test that cannot find its goldens must fail, not pass vacuously.
pub fn fixtures() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    assert!(
        dir.join("dcp").is_dir(),
        "golden fixtures not found at {}",
        dir.display()
    );
    dir
}
