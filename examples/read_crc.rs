//! Cost of the CRC-32 check on reads, in Rust (no Python in the loop): the same checkpoint read
//! through [`read_region`] / [`Checkpoint::read_bytes`] with shardwise's checksum
//! sidecar (every item checked) and through a twin directory whose data files are hard links to
//! the same inodes but which has no sidecar (read unchecked, as a torch- or Megatron-written
//! checkpoint). The page cache is warm and shared by both: the worst case for the check.
//!
//! Run: cargo run --release --example read_crc -- DIR [BIG_COUNT BIG_MIB SMALL_COUNT SMALL_KIB REPS]

use std::time::{Duration, Instant};

use shardwise::format::dtype::DType;
use shardwise::load::read_region;
use shardwise::reader::Checkpoint;
use shardwise::save::{save_rank, ObjectItem, SaveOptions};
use shardwise::storage::Location;
use shardwise::writer::{ByteObject, Payload, TensorChunk};

fn arg(i: usize, default: u64) -> u64 {
    std::env::args()
        .nth(i)
        .map_or(default, |s| s.parse().expect("a number"))
}

fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn main() {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).expect("DIR"));
    let (big, big_mib, small, small_kib, reps) =
        (arg(2, 16), arg(3, 64), arg(4, 4000), arg(5, 16), arg(6, 7));
    let _ = std::fs::remove_dir_all(&dir);
    let (checked, unchecked) = (dir.join("checked"), dir.join("unchecked"));
    let big_data: Vec<Vec<u8>> = (0..big)
        .map(|i| noise((big_mib << 20) as usize, i + 1))
        .collect();
    let small_data: Vec<Vec<u8>> = (0..small)
        .map(|i| noise((small_kib << 10) as usize, i + 1000))
        .collect();
    let obj_data = noise(600, 7);
    let mut tensors = Vec::new();
    for (i, d) in big_data.iter().enumerate() {
        let rows = d.len() as u64 / 4 / 1024;
        tensors.push(TensorChunk {
            fqn: format!("big.{i}"),
            dtype: DType::F32,
            global_shape: vec![rows, 1024],
            offsets: vec![0, 0],
            sizes: vec![rows, 1024],
            data: Payload::Host(d),
        });
    }
    for (i, d) in small_data.iter().enumerate() {
        let n = d.len() as u64 / 4;
        tensors.push(TensorChunk {
            fqn: format!("small.{i}"),
            dtype: DType::F32,
            global_shape: vec![n],
            offsets: vec![0],
            sizes: vec![n],
            data: Payload::Host(d),
        });
    }
    let objects: Vec<ObjectItem> = (0..small / 10)
        .map(|i| ObjectItem {
            object: ByteObject {
                fqn: format!("obj.{i}"),
                bytes: &obj_data,
            },
            shard: None,
        })
        .collect();
    let opts = SaveOptions {
        location: Location::local(&checked),
        rank: 0,
        world_size: 1,
        save_id: "bench".into(),
        megatron: false,
        merge_rank: Some(0),
        timeout: Duration::from_secs(60),
        wait_for_commit: true,
        overwrite: false,
        derived_save_id: false,
        integrity: false,
    };
    save_rank(&opts, &tensors, &objects, None, None).expect("save");
    drop((big_data, small_data));
    std::fs::create_dir_all(&unchecked).unwrap();
    for e in std::fs::read_dir(&checked).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::hard_link(&p, unchecked.join(p.file_name().unwrap())).unwrap();
        }
    }
    let mut buf = vec![0u8; (big_mib << 20) as usize];
    let run = |path: &std::path::Path, buf: &mut Vec<u8>| -> [f64; 3] {
        let ckpt = Checkpoint::open(&Location::local(path)).unwrap();
        let t0 = Instant::now();
        for i in 0..big {
            let rows = (big_mib << 20) / 4 / 1024;
            read_region(&ckpt, &format!("big.{i}"), &[0, 0], &[rows, 1024], buf).unwrap();
        }
        let t_big = t0.elapsed().as_secs_f64();
        let n = (small_kib << 10) / 4;
        let t0 = Instant::now();
        for i in 0..small {
            let out = &mut buf[..(small_kib << 10) as usize];
            read_region(&ckpt, &format!("small.{i}"), &[0], &[n], out).unwrap();
        }
        let t_small = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        for i in 0..small / 10 {
            ckpt.read_bytes(&format!("obj.{i}"), 1 << 20).unwrap();
        }
        let t_obj = t0.elapsed().as_secs_f64();
        [
            (big * (big_mib << 20)) as f64 / t_big / 1e9,
            small as f64 / t_small,
            (small / 10) as f64 / t_obj,
        ]
    };
    run(&unchecked, &mut buf); // warm the page cache
    let mut res: [Vec<[f64; 3]>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..reps {
        res[0].push(run(&unchecked, &mut buf));
        res[1].push(run(&checked, &mut buf));
    }
    let med = |v: &Vec<[f64; 3]>, m: usize| {
        let mut x: Vec<f64> = v.iter().map(|r| r[m]).collect();
        x.sort_by(f64::total_cmp);
        x[x.len() / 2]
    };
    println!(
        "cpus {}; {big} x {big_mib} MiB, {small} x {small_kib} KiB tensors, {} objects of 600 B; medians of {reps}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        small / 10
    );
    println!(
        "{:<28} {:>12} {:>12} {:>8}",
        "metric", "unchecked", "checked", "ratio"
    );
    for (m, name) in [
        "large tensors GB/s",
        "small tensor reads/s",
        "object reads/s",
    ]
    .iter()
    .enumerate()
    {
        let (u, c) = (med(&res[0], m), med(&res[1], m));
        println!("{name:<28} {u:>12.2} {c:>12.2} {:>8.3}", c / u);
    }
}
