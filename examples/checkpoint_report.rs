//! Checkpoint throughput: saves and loads a model of `--gib` GiB (f32, 8 tensors sharded by
//! rows) on `--ranks` ranks (threads), and measures in the same run a plain sequential write
//! (then `fsync`) and read of the same bytes from one file, the disk's own figure to compare with.
//!
//! Every write is synced (`fsync`) before its clock stops. Reads are measured twice: *cold*, after
//! the files' pages were dropped from the page cache (`posix_fadvise(DONTNEED)` once they were
//! synced), so the bytes come from the disk; and *warm*, from the page cache. It also prints how
//! many bytes each load read against the bytes of the parts it made (a load into 8 ranks of a
//! checkpoint of 4 reads half of each file, a resharded load reads its columns' chunks).
//!
//! Run: `cargo run --release --example checkpoint_report [-- --gib 2 --ranks 4 --dir /tmp/ck-report]`

use std::fs::File;
use std::io::{Read, Write};
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::time::Instant;

use dist_tensor::checkpoint::{self, Checkpoint, Entry};
use dist_tensor::{DistTensor, Error, Placement, Tensor, World};

const TENSORS: usize = 8;

/// Drops a synced file's pages from the page cache, so the next read comes from the disk.
fn drop_cache(path: &Path) -> std::io::Result<()> {
    let f = File::open(path)?;
    let len = NonZeroU64::new(f.metadata()?.len());
    rustix::fs::fadvise(&f, 0, len, rustix::fs::Advice::DontNeed)?;
    Ok(())
}

fn drop_dir_cache(dir: &Path) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        drop_cache(&e?.path())?;
    }
    Ok(())
}

fn gbs(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn main() -> Result<(), Error> {
    let mut gib = 2usize;
    let mut ranks = 4usize;
    let mut dir = PathBuf::from("/tmp/dist-tensor-checkpoint-report");
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let value = pair.get(1).cloned().unwrap_or_default();
        match pair[0].as_str() {
            "--gib" => gib = value.parse().expect("--gib N"),
            "--ranks" => ranks = value.parse().expect("--ranks N"),
            "--dir" => dir = value.into(),
            other => panic!("unknown argument {other}; see the file's header"),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let ck = dir.join("checkpoint");
    let plain = dir.join("plain.bin");
    // 8 tensors [rows, 8192] f32 adding up to `gib` GiB.
    let cols = 8192usize;
    let rows = (gib << 30) / 4 / cols / TENSORS;
    let total = (TENSORS * rows * cols * 4) as u64;
    println!(
        "checkpoint_report: {TENSORS} tensors [{rows}, {cols}] f32 sharded by rows on {ranks} \
         ranks (threads): {:.2} GiB; files in {}",
        total as f64 / (1u64 << 30) as f64,
        dir.display()
    );

    // Save, then the plain write of the same bytes.
    let world = World::threads(ranks)?;
    let (save_s, parts_bytes) = {
        let out = world.run(|rank| {
            let sizes = dist_tensor::Split::Even.sizes(rows, rank.num_ranks())?;
            let parts: Vec<DistTensor<'_, f32>> = (0..TENSORS)
                .map(|i| {
                    let local = Tensor::<f32>::try_random(
                        &[sizes[rank.rank()], cols],
                        (i * 64 + rank.rank()) as u64,
                    )?;
                    DistTensor::from_local(rank, local, Placement::Shard(0))
                })
                .collect::<Result<_, _>>()?;
            let entries: Vec<Entry<'_>> = parts
                .iter()
                .enumerate()
                .map(|(i, p)| Entry::new(format!("layer{i}.weight"), p))
                .collect::<Result<_, _>>()?;
            let _ = rank.barrier_all()?;
            let start = Instant::now();
            checkpoint::save(rank, &ck, &entries)?;
            let secs = start.elapsed().as_secs_f64();
            // The plain write of the same bytes, one rank after the other into one file: a
            // sequential writer, synced at the end.
            let _ = rank.barrier_all()?;
            let start = Instant::now();
            for r in 0..rank.num_ranks() {
                if r == rank.rank() {
                    let mut f =
                        std::fs::OpenOptions::new().create(true).append(true).open(&plain)?;
                    for p in &parts {
                        f.write_all(bytemuck_f32(p.local().as_slice()))?;
                    }
                    if r + 1 == rank.num_ranks() {
                        f.sync_all()?;
                    }
                }
                let _ = rank.barrier_all()?;
            }
            let plain_s = start.elapsed().as_secs_f64();
            Ok((secs, plain_s))
        })?;
        let save = out.iter().map(|o| o.0).fold(0.0, f64::max);
        (save, out[0].1)
    };
    let plain_write_s = parts_bytes;
    assert_eq!(std::fs::metadata(&plain)?.len(), total);
    println!(
        "save  (4 files + index, fsync): {save_s:.3} s, {:.2} GB/s | plain write + fsync: {plain_write_s:.3} s, {:.2} GB/s | ratio {:.2}",
        gbs(total, save_s),
        gbs(total, plain_write_s),
        plain_write_s / save_s
    );

    // Loads: cold (pages dropped), then warm; the plain read likewise.
    let load = |world: &World, placement: Placement| -> Result<(f64, u64, u64), Error> {
        let out = world.run(|rank| {
            let _ = rank.barrier_all()?;
            let start = Instant::now();
            let c = Checkpoint::open(rank, &ck)?;
            let mut made = 0u64;
            for i in 0..TENSORS {
                let t = c.load::<f32>(&format!("layer{i}.weight"), placement)?;
                made += (t.local().len() * 4) as u64;
            }
            let secs = start.elapsed().as_secs_f64();
            let _ = rank.barrier_all()?;
            Ok((secs, c.bytes_read(), made))
        })?;
        let secs = out.iter().map(|o| o.0).fold(0.0, f64::max);
        Ok((secs, out.iter().map(|o| o.1).sum(), out.iter().map(|o| o.2).sum()))
    };
    let read_plain = || -> std::io::Result<f64> {
        let start = Instant::now();
        let mut f = File::open(&plain)?;
        // The disk's own figure: sequential reads into one reused 16 MiB buffer (the load, in
        // contrast, makes tensors of all the bytes).
        let mut buf = vec![0u8; 16 << 20];
        let mut got = 0u64;
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            got += n as u64;
        }
        assert_eq!(got, total);
        Ok(start.elapsed().as_secs_f64())
    };
    for cold in [true, false] {
        if cold {
            drop_dir_cache(&ck)?;
            drop_cache(&plain)?;
        }
        let (load_s, read, made) = load(&world, Placement::Shard(0))?;
        if cold {
            drop_cache(&plain)?;
        }
        let plain_s = read_plain()?;
        println!(
            "load {} (same layout, {ranks} ranks): {load_s:.3} s, {:.2} GB/s, read {read} bytes for parts of {made} | plain read: {plain_s:.3} s, {:.2} GB/s | ratio {:.2}",
            if cold { "cold" } else { "warm" },
            gbs(total, load_s),
            gbs(total, plain_s),
            plain_s / load_s
        );
    }
    // Resharded loads (warm): twice the ranks by rows, and half the ranks by columns.
    for (n, placement) in
        [(2 * ranks, Placement::Shard(0)), ((ranks / 2).max(1), Placement::Shard(1))]
    {
        let (s, read, made) = load(&World::threads(n)?, placement)?;
        println!(
            "load warm into {n} ranks as {placement}: {s:.3} s, {:.2} GB/s, read {read} bytes for parts of {made} ({:.3} of them)",
            gbs(total, s),
            read as f64 / made as f64
        );
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// The bytes of f32s.
fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every byte is initialised; the slice lives as long as `v`.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}
