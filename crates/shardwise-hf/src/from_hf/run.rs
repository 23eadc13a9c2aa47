//! Running the reverse plan: each job's HF tensors read (converted or dequantized into the
//! output dtype), their value transform inverted, and their rows scattered back into the Megatron
//! source tensor; jobs gathered into groups, one data file each (the caller converts a group per
//! worker and writes one at a time).

use std::sync::atomic::{AtomicBool, Ordering};

use super::super::plan::invert_post;
use super::plan::{Chunk, Job};
use super::source::HfSource;
use crate::finite::NonFinite;
use shardwise::error::{Error, Result, Stopped};
use shardwise::format::dtype::DType;

/// The HF tensors a job read that hold NaN or infinities, with what they hold.
pub(crate) type Found = Vec<(String, NonFinite)>;

/// The Megatron source tensor of job `j` in `dtype` (`experts x rows x rest`, C order), and the
/// non-finite values of each HF tensor it reads that holds any (counted as read into `dtype`,
/// dequantized when quantized: what the checkpoint will hold); `stop` (Ctrl-C) is checked before
/// each HF tensor is read.
///
/// Errors: [`Error::Interrupted`] when `stop` is set; the reader's and [`invert_post`]'s.
pub(crate) fn run_job(
    src: &HfSource,
    j: &Job,
    dtype: DType,
    stop: &AtomicBool,
) -> Result<(Vec<u8>, Found)> {
    let item = dtype.itemsize() as usize;
    let row = j.rest.iter().product::<u64>() as usize * item;
    let rows = j.rows as usize;
    let mut buf = vec![0u8; j.numel() as usize * item];
    let mut nonfinite = Vec::new();
    for input in &j.inputs {
        if stop.load(Ordering::Relaxed) {
            return Err(Error::Interrupted(Stopped::Commit));
        }
        let n = input.shape.iter().product::<u64>() as usize;
        let mut tmp = vec![0u8; n * item];
        src.read(&input.name, dtype, &mut tmp)?;
        let found = crate::finite::count(&tmp, dtype);
        if found.total() > 0 {
            nonfinite.push((input.name.clone(), found));
        }
        invert_post(j.post, dtype, &input.shape, &mut tmp)?;
        let per_expert = tmp.len() / j.experts as usize;
        for e in 0..j.experts as usize {
            let from = &tmp[e * per_expert..(e + 1) * per_expert];
            let mut at = 0;
            for &(r0, n) in &input.ranges {
                let (r0, n) = (r0 as usize, n as usize);
                let to = (e * rows + r0) * row;
                buf[to..to + n * row].copy_from_slice(&from[at..at + n * row]);
                at += n * row;
            }
        }
    }
    if let Some(v) = j.pad_from {
        let v = v as usize;
        for e in 0..j.experts as usize {
            let last = (e * rows + v - 1) * row;
            for r in v..rows {
                buf.copy_within(last..last + row, (e * rows + r) * row);
            }
        }
    }
    Ok((buf, nonfinite))
}

/// Chunk `c`'s bytes in its job's buffer.
pub(crate) fn chunk_bytes<'a>(buf: &'a [u8], c: &Chunk, dtype: DType) -> &'a [u8] {
    let item = dtype.itemsize();
    let n: u64 = c.sizes.iter().product();
    &buf[(c.start * item) as usize..((c.start + n) * item) as usize]
}

/// Jobs in groups of consecutive jobs, each at most `budget` bytes of output (a larger job alone):
/// a pure function of the plan, so every part of a split conversion computes the same groups.
pub(crate) fn groups(jobs: &[Job], item: u64, budget: u64) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut size) = (0usize, 0u64);
    for (i, j) in jobs.iter().enumerate() {
        let n = j.numel() * item;
        if i > start && size + n > budget {
            out.push(start..i);
            (start, size) = (i, 0);
        }
        size += n;
    }
    if start < jobs.len() {
        out.push(start..jobs.len());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Post;

    fn job(n: u64) -> Job {
        Job {
            post: Post::None,
            inputs: Vec::new(),
            experts: 1,
            rows: n,
            rest: vec![1],
            pad_from: None,
            chunks: Vec::new(),
        }
    }

    #[test]
    fn groups_are_consecutive_and_bounded() {
        let jobs: Vec<Job> = [4, 4, 4, 20, 1, 1].into_iter().map(job).collect();
        assert_eq!(groups(&jobs, 1, 8), vec![0..2, 2..3, 3..4, 4..6]);
        assert_eq!(groups(&jobs, 1, 100), vec![0..6]);
        assert!(groups(&[], 1, 8).is_empty());
    }
}
