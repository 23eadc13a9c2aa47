//! Worker thread counts of the tools (`to-hf`, `from-hf`, `diff`): one rule for every
//! `--workers` / `--threads` flag and its Python keyword.

use crate::error::{Error, Result};

/// The most worker threads per CPU. The tools' work is reading, converting and writing tensors:
/// a few threads per core keep the disk busy, and each thread holds a tensor or a slab in memory,
/// so thousands of them only add memory and scheduling (`--workers 100000` drove a 2-core
/// machine's load average past 2,000).
const PER_CPU: usize = 8;

/// The CPUs this process may use (4 when the OS does not say).
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get())
}

/// `requested` worker threads (None: `default`), checked: at least 1 and at most [`PER_CPU`] x
/// [`cpus`].
///
/// Errors: [`Error::InvalidArgument`] naming `flag` and the bound.
pub fn count(flag: &str, requested: Option<usize>, default: usize) -> Result<usize> {
    let max = PER_CPU * cpus();
    match requested.unwrap_or(default) {
        0 => Err(Error::InvalidArgument(format!(
            "{flag} 0: at least one worker thread is needed"
        ))),
        n if n > max => Err(Error::InvalidArgument(format!(
            "{flag} {n}: at most {max} ({PER_CPU} per CPU, {} CPUs here)",
            cpus()
        ))),
        n => Ok(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_bounded_on_both_sides() {
        assert_eq!(count("--workers", None, 3).unwrap(), 3);
        assert_eq!(count("--workers", Some(1), 3).unwrap(), 1);
        let e = count("--threads", Some(0), 3).unwrap_err().to_string();
        assert!(e.contains("--threads 0"), "{e}");
        let e = count("--workers", Some(100_000), 3)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--workers 100000: at most"), "{e}");
        assert!(count("--workers", Some(PER_CPU * cpus()), 1).is_ok());
    }
}
