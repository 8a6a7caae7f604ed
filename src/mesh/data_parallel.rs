//! Data parallelism: the gradients of parameters replicated over a data-parallel group are
//! averaged over it, in buckets sent while the backward pass goes on (as PyTorch's DDP does).
//!
//! [`overlapped`] runs the caller's backward pass with a [`GradBuckets`]: each gradient handed
//! to [`GradBuckets::ready`] joins the current bucket, and a full bucket goes at once to a
//! thread of this rank that all-reduces it over the data-parallel group while the backward pass
//! computes the next layer's gradients. A layer's `backward_hooked` (the buckets are its
//! [`GradHook`]) hands in each parameter's gradient the moment it is complete, within the
//! layer's own pass: a column-parallel layer's weight before its input gradient's exchange and
//! product, which then hide its all-reduce; [`GradBuckets::ready_all`] after a layer's
//! `backward` hands them in once the whole layer is done. The group is a world of its own (see
//! [`Rank::split`](crate::Rank::split)), so its all-reduce runs beside the tensor-parallel
//! group's fused ops of the same rank without meeting them. [`all_reduce_mean`] is the same
//! averaging after the backward pass, in the same buckets (the baseline the overlap is measured
//! against; the sums are the same, bit for bit).
//!
//! The average of the replicas' gradients, each of the mean loss over its equal share of the
//! batch, is the gradient of the mean loss over the whole batch: training on a `dp x tp` mesh is
//! training on the global batch.

use std::sync::mpsc;

use super::Averager;
use crate::nn::{GradHook, Module};
use crate::{Element, Error, Result, Tensor};

/// Bytes a bucket holds before it is sent (PyTorch's DDP uses 25 MiB; the models here are small).
pub const DEFAULT_BUCKET_BYTES: usize = 1 << 20;

/// Gradients collected in buckets during a backward pass (see [`overlapped`]).
pub struct GradBuckets<T: Element> {
    send: Option<mpsc::Sender<Vec<T>>>,
    bucket_elems: usize,
    pending: Vec<T>,
    /// Every gradient handed in: its shape, its bucket and its offset there.
    placed: Vec<Placed>,
    buckets: usize,
    /// The full buckets, when nothing reduces them during the pass ([`all_reduce_mean`]).
    kept: Vec<Vec<T>>,
    /// This rank's index in the data-parallel group (0 for [`GradBuckets::collect`]), for errors.
    rank: usize,
    /// The layer whose gradients come in through [`GradHook`] now: each of its parameters'
    /// place, by index, once handed in.
    layer: Vec<Option<Placed>>,
}

/// A gradient's shape, its bucket and its offset there.
type Placed = (Vec<usize>, usize, usize);

impl<T: Element> GradBuckets<T> {
    fn new(send: Option<mpsc::Sender<Vec<T>>>, bucket_bytes: usize, rank: usize) -> Self {
        GradBuckets {
            rank,
            send,
            bucket_elems: (bucket_bytes / size_of::<T>()).max(1),
            pending: Vec::new(),
            placed: Vec::new(),
            buckets: 0,
            kept: Vec::new(),
            layer: Vec::new(),
        }
    }

    /// Puts `grad` in the current bucket, sending the bucket once full; where it went.
    fn place(&mut self, grad: &Tensor<T>) -> Placed {
        let at = (grad.shape().to_vec(), self.buckets, self.pending.len());
        self.pending.extend_from_slice(grad.as_slice());
        if self.pending.len() >= self.bucket_elems {
            self.flush();
        }
        at
    }

    /// Hands in a gradient whose backward is done: it joins the current bucket, which is sent
    /// to be all-reduced once it holds at least the bucket's bytes. Every rank of the group must
    /// hand in gradients of the same shapes in the same order.
    pub fn ready(&mut self, grad: &Tensor<T>) {
        let at = self.place(grad);
        self.placed.push(at);
    }

    /// Hands in the gradient of every parameter of `layer`, once the layer's backward is done:
    /// [`GradBuckets::ready`] for each, last parameter first (as PyTorch's DDP buckets them), and
    /// the averaged gradients come back in [`Module::parameters`]' order all the same. Last
    /// first, a layer's bias goes into the bucket before its weight, so a weight that fills the
    /// bucket sends the bias with it: weight first, the bias waited for the next layer, and the
    /// first layer's bias (the last gradient of the pass) went alone in a bucket of its own after
    /// the pass, an all-reduce of a few hundred elements whose latency nothing hid (1 to 3 ms of
    /// the 2 x 2 mesh's step in `perf_report --mesh` on a throttled network).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first parameter without a gradient (its backward
    /// has not run), and this rank's index in the data-parallel group; nothing of the layer is
    /// handed in then.
    pub fn ready_all<M: Module<T> + ?Sized>(&mut self, layer: &M) -> Result<()> {
        let grads = layer
            .parameters()
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                p.grad().ok_or_else(|| Error::InvalidArgument {
                    op: "GradBuckets::ready_all",
                    rank: self.rank,
                    reason: format!(
                        "parameter {i} of the layer has no gradient: run its backward first"
                    ),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let first = self.placed.len();
        for grad in grads.iter().rev() {
            self.ready(grad);
        }
        // Where each went, in the parameters' order: the order the gradients come back in.
        self.placed[first..].reverse();
        Ok(())
    }

    /// Elements handed in that wait in the current bucket, not sent yet (they go when the bucket
    /// fills, or after the backward pass).
    pub fn unsent(&self) -> usize {
        self.pending.len()
    }

    fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let bucket = std::mem::take(&mut self.pending);
        self.buckets += 1;
        match &self.send {
            // A closed channel means the reducing thread stopped on an error, which `overlapped`
            // returns.
            Some(send) => drop(send.send(bucket)),
            None => self.kept.push(bucket),
        }
    }

    /// Buckets that only collect the gradients handed in, for [`all_reduce_mean`] after the
    /// backward pass (see [`GradBuckets::into_grads`]).
    pub fn collect() -> Self {
        GradBuckets::new(None, usize::MAX, 0)
    }

    /// The gradients handed in, as they were (unreduced), in order (of a layer that handed in
    /// only some of its gradients through [`GradHook`], none).
    pub fn into_grads(mut self) -> Vec<Tensor<T>> {
        self.flush();
        let kept = std::mem::take(&mut self.kept);
        self.unpack(&kept).expect("each gradient is whole in the kept buckets")
    }

    /// An error if a layer's backward pass handed in only some of its gradients.
    fn check_layer_done(&self, op: &'static str) -> Result<()> {
        if self.layer.is_empty() {
            return Ok(());
        }
        let done = self.layer.iter().flatten().count();
        Err(Error::InvalidArgument {
            op,
            rank: self.rank,
            reason: format!(
                "a layer handed in {done} of its {} parameters' gradients through GradHook: \
                 its backward pass did not end",
                self.layer.len()
            ),
        })
    }

    /// The gradients, averaged, from the reduced buckets.
    fn unpack(&self, reduced: &[Vec<T>]) -> Result<Vec<Tensor<T>>> {
        self.placed
            .iter()
            .map(|(shape, bucket, at)| {
                let len = shape.iter().product::<usize>();
                Tensor::from_shape_vec(shape, reduced[*bucket][*at..*at + len].to_vec())
            })
            .collect()
    }
}

/// A layer's `backward_hooked` hands each parameter's gradient in as soon as it is complete, in
/// the order they complete (the same on every rank); the layer's gradients come back together
/// in its parameters' order all the same (as with [`GradBuckets::ready_all`]), at the place of
/// the last one handed in.
///
/// # Errors
/// [`Error::InvalidArgument`] when `index` is not below `count`, was handed in already in this
/// layer's pass, or `count` is not that of the layer whose pass is under way.
///
/// # Examples
/// ```
/// use dist_tensor::mesh::{data_parallel, DeviceMesh};
/// use dist_tensor::nn::ColumnParallelLinear;
/// use dist_tensor::{DistTensor, Placement, Split, Tensor, World};
/// let (x, w, b) = (Tensor::<f64>::random(&[6, 4], 1), Tensor::random(&[4, 6], 2), Tensor::random(&[6], 3));
/// World::threads(4)?.run(|rank| {
///     let mesh = DeviceMesh::new(rank, &[("dp", 2), ("tp", 2)])?;
///     let (tp, dp) = (mesh.rank_of("tp")?, mesh.averager("dp")?);
///     let mut fc = ColumnParallelLinear::from_global(&tp, &w, Some(&b), Split::Even)?;
///     let xs = DistTensor::from_global(&tp, &(&x * (1.0 + mesh.coord("dp")? as f64)), Placement::Shard(0))?;
///     let (y, saved) = fc.forward(&xs)?;
///     // The weight's gradient goes to be averaged before the input gradient is computed.
///     let (dx, mean) = data_parallel::overlapped(&dp, 1 << 20, |buckets| {
///         fc.backward_hooked(saved, &y, buckets)
///     })?;
///     assert_eq!(dx.local().shape(), xs.local().shape());
///     // In the parameters' order: the weight's columns, then the bias's part.
///     assert_eq!(mean[0].shape(), fc.weight().value().shape());
///     assert_eq!(mean[1].shape(), fc.bias().unwrap().value().shape());
///     Ok(())
/// })?;
/// # Ok::<(), dist_tensor::Error>(())
/// ```
impl<T: Element> GradHook<T> for GradBuckets<T> {
    fn grad_ready(&mut self, index: usize, count: usize, grad: &Tensor<T>) -> Result<()> {
        let open = !self.layer.is_empty();
        if index >= count || (open && (count != self.layer.len() || self.layer[index].is_some())) {
            return Err(Error::InvalidArgument {
                op: "GradBuckets::grad_ready",
                rank: self.rank,
                reason: format!(
                    "parameter {index} of a layer of {count} handed in, where {}",
                    if open {
                        format!(
                            "a layer of {} is under way ({} handed in)",
                            self.layer.len(),
                            self.layer.iter().flatten().count()
                        )
                    } else {
                        "no layer is under way".to_string()
                    }
                ),
            });
        }
        if !open {
            self.layer = vec![None; count];
        }
        let at = self.place(grad);
        self.layer[index] = Some(at);
        if self.layer.iter().all(Option::is_some) {
            let layer = std::mem::take(&mut self.layer);
            self.placed.extend(layer.into_iter().flatten());
        }
        Ok(())
    }
}

/// Runs `backward` (a backward pass that hands each gradient to [`GradBuckets::ready`] as soon
/// as it is computed) while a thread of this rank averages the full buckets over the
/// data-parallel group `dp`; returns what `backward` returned and the averaged gradients, in the
/// order they were handed in. Collective over `dp`.
///
/// # Errors
/// What `backward` returned, or else what the all-reduce did (as
/// [`Averager::mean`]); [`Error::System`] when the thread cannot start.
///
/// # Examples
/// ```
/// use dist_tensor::{mesh::{data_parallel, DeviceMesh}, Tensor, World};
///
/// let grads = World::threads(4)?.run(|rank| {
///     let mesh = DeviceMesh::new(rank, &[("dp", 2), ("tp", 2)])?;
///     let dp = mesh.averager("dp")?;
///     let mine = Tensor::from(vec![rank.rank() as f64; 3]);
///     let ((), mean) = data_parallel::overlapped(&dp, 1 << 20, |buckets| {
///         buckets.ready(&mine); // in a real pass: layer after layer
///         Ok(())
///     })?;
///     Ok(mean[0].as_slice().to_vec())
/// })?;
/// assert_eq!(grads[0], vec![1.0; 3]); // ranks 0 and 2
/// assert_eq!(grads[3], vec![2.0; 3]); // ranks 1 and 3
/// # Ok::<(), dist_tensor::Error>(())
/// ```
pub fn overlapped<T, R>(
    dp: &Averager<'_>,
    bucket_bytes: usize,
    backward: impl FnOnce(&mut GradBuckets<T>) -> Result<R>,
) -> Result<(R, Vec<Tensor<T>>)>
where
    T: Element,
{
    let (send, receive) = mpsc::channel::<Vec<T>>();
    std::thread::scope(|scope| {
        let reducer = std::thread::Builder::new()
            .name(format!("dp-rank-{}", dp.rank()))
            .spawn_scoped(scope, move || -> Result<Vec<Vec<T>>> {
                crate::shmem::latency::prompt_wakeups();
                receive.iter().map(|bucket| dp.mean(&bucket)).collect()
            })
            .map_err(|e| Error::System {
                op: "data_parallel::overlapped",
                rank: dp.rank(),
                what: "cannot start the thread that reduces the buckets".into(),
                source: std::sync::Arc::new(e),
            })?;
        let mut buckets = GradBuckets::new(Some(send), bucket_bytes, dp.rank());
        let outcome = backward(&mut buckets);
        buckets.flush();
        buckets.send = None; // the reducing thread ends once it has the last bucket
        let reduced = reducer.join().unwrap_or_else(|panic| {
            Err(Error::Panicked { rank: dp.rank(), message: crate::shmem::panic_message(&*panic) })
        });
        let value = outcome?;
        buckets.check_layer_done("data_parallel::overlapped")?;
        Ok((value, buckets.unpack(&reduced?)?))
    })
}

/// Averages `grads` over the data-parallel group `dp` after the backward pass, in buckets of
/// `bucket_bytes` (the same buckets and sums as [`overlapped`], none of it hidden). Collective
/// over `dp`.
///
/// # Errors
/// As [`Averager::mean`].
pub fn all_reduce_mean<T: Element>(
    dp: &Averager<'_>,
    bucket_bytes: usize,
    grads: &[Tensor<T>],
) -> Result<Vec<Tensor<T>>> {
    let mut buckets = GradBuckets::new(None, bucket_bytes, dp.rank());
    for g in grads {
        buckets.ready(g);
    }
    buckets.flush();
    let reduced = buckets.kept.iter().map(|b| dp.mean(b)).collect::<Result<Vec<_>>>()?;
    buckets.unpack(&reduced)
}
