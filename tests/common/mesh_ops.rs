//! Every collective and fused op over every group of a `dp x tp` mesh, against f64 references
//! built from the members' inputs: what tests/mesh.rs runs on threads and processes and
//! tests/mpi.rs on MPI nodes.

use dist_tensor::collectives::{self, ReduceOp};
use dist_tensor::mesh::DeviceMesh;
use dist_tensor::{Element, Rank, fused};
use half::bf16;
use ndarray::{Array2, concatenate, s};

use super::checks::{off, seeded_matrix, widen};
use super::{array_split, offsets, seeded, tolerance};

/// Checks every collective and both fused ops in `T` on `group` (this rank's handle in it),
/// whose members are the world's ranks `members`; returns what is wrong.
pub fn group_ops<T: Element>(group: &Rank<'_>, members: &[usize], salt: usize) -> Vec<String> {
    let (g, me) = (members.len(), group.rank());
    let world_me = members[me];
    let mut fails = Vec::new();
    let mut check = |what: &str, got: dist_tensor::Result<Vec<T>>, want: Vec<f64>, terms| {
        let tol = tolerance::<T>(terms) * 8.0;
        let scale: Vec<f64> = want.iter().map(|w| w.abs().max(8.0)).collect();
        match got {
            Ok(got) => fails.extend(off(
                &format!("{what} (world rank {world_me}, members {members:?})"),
                &widen(&got),
                &want,
                &scale,
                tol,
            )),
            Err(e) => fails.push(format!("{what} on world rank {world_me}: {e}")),
        }
    };
    let input = |r: usize, len: usize, k: usize| widen(&seeded::<T>(r, len, salt + k));
    // all_reduce: the members' sum.
    let len = 5;
    let want = (0..len).map(|i| members.iter().map(|&m| input(m, len, 0)[i]).sum()).collect();
    check("all_reduce", collectives::all_reduce(group, &seeded::<T>(world_me, len, salt)), want, g);
    // all_gather: uneven pieces, one of them possibly empty.
    let piece = |m: usize| m % 3;
    let want = members.iter().flat_map(|&m| input(m, piece(m), 1)).collect();
    let mine = seeded::<T>(world_me, piece(world_me), salt + 1);
    check("all_gather", collectives::all_gather(group, &mine), want, 1);
    // reduce_scatter: this member's piece of the sum, cut as numpy.array_split cuts 7 * g + 1.
    let len = 7 * g + 1;
    let at = offsets(&array_split(len, g));
    let want =
        (at[me]..at[me + 1]).map(|i| members.iter().map(|&m| input(m, len, 2)[i]).sum()).collect();
    let mine = seeded::<T>(world_me, len, salt + 2);
    check("reduce_scatter", collectives::reduce_scatter(group, &mine, ReduceOp::Sum), want, g);
    // all_to_all: block `me` of every member, in member order.
    let k = 3;
    let want = members.iter().flat_map(|&m| input(m, k * g, 3)[me * k..(me + 1) * k].to_vec());
    let mine = seeded::<T>(world_me, k * g, salt + 3);
    check("all_to_all", collectives::all_to_all(group, &mine), want.collect(), 1);
    // broadcast from the group's last member.
    let root = g - 1;
    let mine = seeded::<T>(world_me, 4, salt + 4);
    check("broadcast", collectives::broadcast(group, &mine, root), input(members[root], 4, 4), 1);

    // all_gather_matmul: the members' rows (1 to 3 each) gathered, times this rank's weight.
    let (kdim, n) = (5, 3);
    let rows = |m: usize| 1 + m % 3;
    let xs: Vec<Array2<f64>> =
        members.iter().map(|&m| seeded_matrix::<T>(m, rows(m), kdim, salt + 5)).collect();
    let w = seeded_matrix::<T>(world_me, kdim, n, salt + 6);
    let views: Vec<_> = xs.iter().map(|x| x.view()).collect();
    let want = concatenate(ndarray::Axis(0), &views).unwrap().dot(&w);
    let x = narrow::<T>(&xs[me]);
    let wt = narrow::<T>(&w);
    let got = fused::all_gather_matmul(group, x.view(), &[wt.view()])
        .map(|o| o.outputs[0].iter().copied().collect());
    check("all_gather_matmul", got, want.iter().copied().collect(), kdim);
    // Its unfused baseline (the gather, then the product) over the group too.
    let got = fused::all_gather_matmul_unfused(group, x.view(), &[wt.view()])
        .map(|o| o.outputs[0].iter().copied().collect());
    check("all_gather_matmul_unfused", got, want.iter().copied().collect(), kdim);
    // matmul_reduce_scatter: the sum of the members' products (inner sizes 1 or 2), this
    // member's rows of it.
    let (m_rows, n) = (2 * g + 1, 4);
    let inner = |m: usize| 1 + m % 2;
    let mut sum = Array2::<f64>::zeros((m_rows, n));
    for &m in members {
        let xm = seeded_matrix::<T>(m, m_rows, inner(m), salt + 7);
        sum = sum + xm.dot(&seeded_matrix::<T>(m, inner(m), n, salt + 8));
    }
    let at = offsets(&array_split(m_rows, g));
    let want: Vec<f64> = sum.slice(s![at[me]..at[me + 1], ..]).iter().copied().collect();
    let x = narrow::<T>(&seeded_matrix::<T>(world_me, m_rows, inner(world_me), salt + 7));
    let w = narrow::<T>(&seeded_matrix::<T>(world_me, inner(world_me), n, salt + 8));
    let got = fused::matmul_reduce_scatter(group, x.view(), w.view())
        .map(|o| o.iter().copied().collect());
    check("matmul_reduce_scatter", got, want.clone(), 2 * g);
    let got = fused::matmul_reduce_scatter_unfused(group, x.view(), w.view())
        .map(|o| o.iter().copied().collect());
    check("matmul_reduce_scatter_unfused", got, want, 2 * g);
    fails
}

fn narrow<T: Element>(a: &Array2<f64>) -> Array2<T> {
    a.mapv(T::from_f64)
}

/// Every op over every group of every dimension of a `dp x tp` mesh on `rank`.
pub fn mesh_ops(rank: &Rank<'_>, dp: usize, tp: usize) -> dist_tensor::Result<Vec<String>> {
    let mesh = DeviceMesh::new(rank, &[("dp", dp), ("tp", tp)])?;
    let mut fails = Vec::new();
    for (d, name) in ["dp", "tp"].into_iter().enumerate() {
        let group = mesh.group(name)?;
        let handle = group.rank();
        fails.extend(group_ops::<f64>(&handle, group.members(), 10 * d));
        fails.extend(group_ops::<f32>(&handle, group.members(), 10 * d + 1));
        fails.extend(group_ops::<bf16>(&handle, group.members(), 10 * d + 2));
        fails.extend(group_ops::<half::f16>(&handle, group.members(), 10 * d + 3));
    }
    // Both dimensions at once: the dp group's all_reduce on a second thread of this rank while
    // the tp group's fused op runs on this one (the groups are worlds of their own).
    let (dp_group, tp_group) = (mesh.group("dp")?, mesh.group("tp")?);
    let (dp_rank, tp_rank) = (dp_group.rank(), tp_group.rank());
    let (a, b) = std::thread::scope(|scope| {
        let other = scope.spawn(|| group_ops::<f64>(&dp_rank, dp_group.members(), 40));
        let here = group_ops::<f64>(&tp_rank, tp_group.members(), 50);
        (other.join().expect("the dp thread"), here)
    });
    fails.extend(a);
    fails.extend(b);
    Ok(fails)
}
