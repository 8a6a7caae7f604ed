use dist_tensor::World;
use dist_tensor::shmem::{GlobalPtr, SignalOp, WaitCmp, WaitSem};
use std::time::Instant;
fn main() -> dist_tensor::Result<()> {
    let world = World::from_env()?;
    let out = world.run(|rank| {
        let me = rank.rank();
        let peer = 1 - me;
        let len = 1 << 24;
        let buf = rank.alloc::<u8>(len)?;
        let sig = rank.alloc_signals(1)?;
        let src = vec![me as u8; len];
        let mut lines = Vec::new();
        for &bytes in &[8usize, 4096, 65536, 1 << 20, 1 << 24] {
            let reps = if bytes >= 1 << 20 { 10 } else { 200 };
            let mut count = 0u64;
            rank.barrier_all()?;
            let t = Instant::now();
            for _ in 0..reps {
                if me == 0 {
                    unsafe {
                        rank.put_signal(
                            buf.ptr(),
                            peer,
                            GlobalPtr::from_slice(&src),
                            bytes,
                            (&sig, 0),
                            SignalOp::Add(1),
                        )?
                    };
                    count += 1;
                    let _ = rank.wait(&sig, 0, WaitCmp::Ge(count), WaitSem::Acquire)?;
                } else {
                    count += 1;
                    let _ = rank.wait(&sig, 0, WaitCmp::Ge(count), WaitSem::Acquire)?;
                    unsafe {
                        rank.put_signal(
                            buf.ptr(),
                            peer,
                            GlobalPtr::from_slice(&src),
                            bytes,
                            (&sig, 0),
                            SignalOp::Add(1),
                        )?
                    };
                }
            }
            let dt = t.elapsed().as_secs_f64() / reps as f64 / 2.0;
            lines.push(format!(
                "{bytes:>9} B: one way {:8.1} us  {:8.3} GB/s",
                dt * 1e6,
                bytes as f64 / dt / 1e9
            ));
            rank.barrier_all()?;
            // reset: both counted `count` arrivals
            let _ = count;
            unsafe {
                rank.put_signal(
                    buf.ptr(),
                    me,
                    GlobalPtr::from_slice(&src),
                    0,
                    (&sig, 0),
                    SignalOp::Set(0),
                )?
            };
            rank.barrier_all()?;
        }
        Ok(lines.join("\n"))
    })?;
    if world.ranks_here().start == 0 {
        println!("{}", out[0]);
    }
    Ok(())
}
