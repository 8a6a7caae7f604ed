//! An optimizer's state as checkpoint entries, and back (see `nn::state` for the names).

use std::borrow::Cow;

use super::{Slot, Slots};
use crate::checkpoint::{Checkpoint, Entry, Target};
use crate::nn::join;
use crate::tensor::{Accumulator, Element, Tensor};
use crate::{Placement, Result};

impl<A: Accumulator, const N: usize> Slots<A, N> {
    /// The entries of every parameter's state: `prefix.<param>.<buffer>` for each of `names`,
    /// `.step` and (half types) `.master`, laid out as the parameter.
    pub(crate) fn entries<'a>(
        &'a self,
        params: &[(String, Placement, Vec<usize>)],
        prefix: &str,
        names: [&str; N],
    ) -> Result<Vec<Entry<'a>>> {
        let mut out = Vec::new();
        for (slot, (param, placement, shape)) in self.slots.iter().zip(params) {
            let base = join(prefix, param);
            for (buffer, name) in slot.buffers.iter().zip(names) {
                let values = host_values(buffer)?;
                out.push(Entry::from_values(join(&base, name), values, shape, *placement));
            }
            if let Some(master) = &slot.master {
                let values = host_values(master)?;
                out.push(Entry::from_values(join(&base, "master"), values, shape, *placement));
            }
            // The step count, exact in f64 up to 2^53 steps.
            let step = Cow::Owned(vec![slot.steps as f64]);
            out.push(Entry::from_values(join(&base, "step"), step, &[1], Placement::Replicate));
        }
        Ok(out)
    }

    /// Replaces the state by the checkpoint's for `params` (cut as `targets` say); fresh when
    /// the checkpoint has none for the first parameter.
    pub(crate) fn load(
        &mut self,
        ck: &Checkpoint<'_>,
        params: &[(String, Placement, Vec<usize>)],
        targets: &[Target],
        prefix: &str,
        names: [&str; N],
    ) -> Result<()> {
        let first = params.first().map(|(p, ..)| join(&join(prefix, p), "step"));
        if !first.is_some_and(|f| ck.contains(&f)) {
            self.slots = Vec::new();
            return Ok(());
        }
        let mut slots = Vec::with_capacity(params.len());
        for ((param, _, _), target) in params.iter().zip(targets) {
            let base = join(prefix, param);
            let mut buffers = Vec::with_capacity(N);
            for name in names {
                buffers.push(values::<A>(ck, &join(&base, name), target)?);
            }
            let buffers = buffers.try_into().unwrap_or_else(|_| unreachable!("N names"));
            let master_name = join(&base, "master");
            let master = if ck.contains(&master_name) {
                Some(values::<A>(ck, &master_name, target)?)
            } else {
                None
            };
            let step = ck.load::<f64>(&join(&base, "step"), Placement::Replicate)?;
            let steps = step.local().as_slice().first().copied().unwrap_or(0.0) as u64;
            slots.push(Slot { master, buffers, steps });
        }
        self.slots = slots;
        Ok(())
    }
}

/// Tensor `name` as this rank's part of `target`, its elements (1-D), on the host: the next
/// step moves them where the parameter lives.
fn values<A: Element>(ck: &Checkpoint<'_>, name: &str, target: &Target) -> Result<Tensor<A>> {
    let part: Tensor<A> = ck.load::<A>(name, target.clone())?.into_local();
    let part = part.into_host()?;
    let len = part.len();
    part.reshape(&[len])
}

/// A state tensor's elements on the host: borrowed there, copied from a GPU.
fn host_values<A: Element>(t: &Tensor<A>) -> Result<Cow<'_, [A]>> {
    t.host_elements()
}
