//! `perf_report --all-reduce`: the latency of an all_reduce per message size (1 KiB to 1 MiB of
//! f32 per rank) on 2, 4 and 8 ranks (threads), one-shot (each rank reads every peer's whole
//! input and sums it: one round), two-shot (reduce_scatter then all_gather: two rounds) and
//! `all_reduce` (which picks one of them by the bytes the ranks would read one-shot:
//! `collectives::ONE_SHOT_MAX_READ_BYTES`).
//! `--quick`: fewer repetitions.

use dist_tensor::{Result, World, collectives};

use super::machine::Cpu;
use super::measure::{load, median, together};

pub fn main(quick: bool) -> Result<()> {
    println!("CPU: {}; load {}", Cpu::read().describe(), load());
    println!(
        "all_reduce of f32, medians of {} calls (each from a barrier to a barrier), microseconds; \
         all_reduce goes one-shot while ranks x ranks x bytes <= {} MiB\n",
        if quick { 21 } else { 101 },
        collectives::ONE_SHOT_MAX_READ_BYTES >> 20
    );
    println!("| ranks | bytes per rank | one-shot us | two-shot us | all_reduce us | one / two |");
    println!("| --- | --- | --- | --- | --- | --- |");
    let reps = if quick { 21 } else { 101 };
    for ranks in [2, 4, 8] {
        for kib in [1usize, 4, 16, 64, 256, 1024] {
            let len = kib * 1024 / 4;
            let times = World::threads(ranks)?.run(|rank| {
                let x: Vec<f32> =
                    (0..len).map(|i| (i % 97) as f32 * 0.01 + rank.rank() as f32).collect();
                let time = |f: &dyn Fn() -> Result<Vec<f32>>| -> Result<f64> {
                    let mut op = || f().map(drop);
                    together(rank, &mut op)?; // warm: workspaces sized
                    let v: Vec<f64> =
                        (0..reps).map(|_| together(rank, &mut op)).collect::<Result<_>>()?;
                    Ok(median(v))
                };
                let one = time(&|| collectives::all_reduce_one_shot(rank, &x))?;
                let two = time(&|| collectives::all_reduce_two_shot(rank, &x))?;
                let auto = time(&|| collectives::all_reduce(rank, &x))?;
                Ok((one, two, auto))
            })?;
            let (one, two, auto) = times[0];
            println!(
                "| {ranks} | {} KiB | {:.1} | {:.1} | {:.1} | {:.2} |",
                kib,
                one * 1e6,
                two * 1e6,
                auto * 1e6,
                one / two
            );
        }
    }
    Ok(())
}
