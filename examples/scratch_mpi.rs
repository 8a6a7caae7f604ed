use dist_tensor::shmem::{GlobalPtr, SignalOp, WaitCmp, WaitSem, consume_token};
use dist_tensor::{World, collectives};
fn main() -> dist_tensor::Result<()> {
    let world = World::from_env()?;
    let out = world.run(|rank| {
        let me = rank.rank();
        let n = rank.num_ranks();
        let t0 = std::time::Instant::now();
        for _ in 0..100 {
            rank.barrier_all()?;
        }
        let bar = t0.elapsed() / 100;
        let buf = rank.alloc::<f32>(n * 4)?;
        let sig = rank.alloc_signals(1)?;
        let mine = vec![me as f32; 4];
        for p in 0..n {
            unsafe {
                rank.put_signal(
                    buf.ptr() + me * 4,
                    p,
                    GlobalPtr::from_slice(&mine),
                    4,
                    (&sig, 0),
                    SignalOp::Add(1),
                )?
            };
        }
        let tok = rank.wait(&sig, 0, WaitCmp::Ge(n as u64), WaitSem::Acquire)?;
        let mut got = vec![0f32; n * 4];
        unsafe {
            dist_tensor::device::tile::load_1d(consume_token(buf.ptr(), tok), &mut got, n * 4, 0.0)
        };
        rank.barrier_all()?;
        let _ = collectives::all_gather::<f32>;
        Ok(format!(
            "rank {me}/{n} nodes {} local {:?} barrier {:?} got {:?}",
            rank.num_nodes(),
            (0..n).map(|p| rank.is_local(p)).collect::<Vec<_>>(),
            bar,
            got
        ))
    })?;
    println!("{}", out[0]);
    Ok(())
}
