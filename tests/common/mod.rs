//! Shared by the integration tests: where the golden fixtures are.

use std::path::PathBuf;

/// `../shared/fixtures` beside the repository, or `$SHARDWISE_FIXTURES`. Panics when absent: a
/// golden test that cannot find its goldens must fail, not pass vacuously.
pub fn fixtures() -> PathBuf {
    let dir = std::env::var_os("SHARDWISE_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures"));
    assert!(
        dir.join("dcp").is_dir(),
        "golden fixtures not found at {} (set SHARDWISE_FIXTURES)",
        dir.display()
    );
    dir
}
