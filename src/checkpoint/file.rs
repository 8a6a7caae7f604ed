//! A safetensors file, memory-mapped, and the copy of a box of one of its tensors into a rank's
//! part: only the pages of the box (and of the checksum chunks it touches) are read.

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::SafeTensors;
use safetensors::tensor::{Metadata, TensorInfo};

use super::index::{dtype_size, from_st};
use crate::error::{CheckpointError, CheckpointErrorKind};
use crate::tensor::{DType, Element};
use crate::{Error, Result};

/// A safetensors file, mapped, its header parsed and checked against the file's length.
pub(crate) struct MappedFile {
    pub path: PathBuf,
    map: Option<Mmap>,
    /// Where the tensors' data starts (after the length word and the header).
    data_start: usize,
    pub meta: Metadata,
}

impl MappedFile {
    /// Opens and maps `path`; `expected_len`, when given, is the length the index recorded.
    pub fn open(
        op: &'static str,
        rank: usize,
        path: &Path,
        expected_len: Option<u64>,
    ) -> Result<MappedFile> {
        let fail = |kind| Error::from(CheckpointError::new(op, rank, path, None, kind));
        let file = File::open(path)
            .map_err(|e| Error::from(CheckpointError::io(op, rank, path, None, "open", &e)))?;
        let len = file
            .metadata()
            .map_err(|e| Error::from(CheckpointError::io(op, rank, path, None, "stat", &e)))?
            .len();
        if let Some(expected) = expected_len
            && expected != len
        {
            return Err(fail(CheckpointErrorKind::Truncated { expected, found: len }));
        }
        if len < 8 {
            return Err(fail(CheckpointErrorKind::Truncated { expected: 8, found: len }));
        }
        // SAFETY: the file is mapped read-only; a checkpoint's files are never written again once
        // renamed into place (a later save writes new names), so the mapping does not change
        // under us unless someone else modifies it, which the checksums then report.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| Error::from(CheckpointError::io(op, rank, path, None, "map", &e)))?;
        let (n, meta) = SafeTensors::read_metadata(&map).map_err(|e| match e {
            safetensors::SafeTensorError::MetadataIncompleteBuffer
            | safetensors::SafeTensorError::InvalidHeaderLength => {
                fail(CheckpointErrorKind::Malformed {
                    reason: format!(
                        "{e:?}: the header and the file's length disagree (truncated?)"
                    ),
                })
            }
            other => fail(CheckpointErrorKind::Malformed {
                reason: format!("not a safetensors file: {other:?}"),
            }),
        })?;
        Ok(MappedFile { path: path.to_path_buf(), map: Some(map), data_start: 8 + n, meta })
    }

    /// The header's entry for `name`.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.meta.info(name)
    }

    fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
}

/// A box to copy: from a stored tensor of shape `src_shape` at `src_lo`, into a part of shape
/// `dst_shape` at `dst_lo`, `extent` long in each dimension.
pub(crate) struct BoxCopy<'a> {
    pub src_shape: &'a [usize],
    pub src_lo: Vec<usize>,
    pub dst_shape: &'a [usize],
    pub dst_lo: Vec<usize>,
    pub extent: Vec<usize>,
}

impl BoxCopy<'_> {
    /// The contiguous runs of the box: `(source element offset, destination element offset,
    /// elements)`, in order.
    fn runs(&self) -> Vec<(usize, usize, usize)> {
        let nd = self.extent.len();
        if self.extent.contains(&0) {
            return Vec::new();
        }
        // The innermost dimensions the box covers whole on both sides join one run.
        let mut k = nd;
        while k > 0
            && self.extent[k - 1] == self.src_shape[k - 1]
            && self.extent[k - 1] == self.dst_shape[k - 1]
        {
            k -= 1;
        }
        // Dimension k - 1 (if any) is the last partial one: its extent is part of every run.
        let (outer, run) = if k == 0 {
            (0, self.extent.iter().product())
        } else {
            (k - 1, self.extent[k - 1..].iter().product())
        };
        let strides = |shape: &[usize]| {
            let mut s = vec![1usize; nd];
            for d in (0..nd.saturating_sub(1)).rev() {
                s[d] = s[d + 1] * shape[d + 1];
            }
            s
        };
        let (ss, ds) = (strides(self.src_shape), strides(self.dst_shape));
        let mut idx = vec![0usize; outer];
        let mut out = Vec::new();
        loop {
            let mut so = 0;
            let mut doff = 0;
            for d in 0..nd {
                let i = if d < outer { idx[d] } else { 0 };
                so += (self.src_lo[d] + i) * ss[d];
                doff += (self.dst_lo[d] + i) * ds[d];
            }
            out.push((so, doff, run));
            // Next index of the outer dimensions, last fastest.
            let mut d = outer;
            loop {
                if d == 0 {
                    return out;
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < self.extent[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }
}

/// Copies box `b` of tensor `name` of `file` into `dst` (the rank's part, element type `T`),
/// converting from the stored type; `crcs` are the chunk checksums of the stored tensor's bytes
/// (every chunk the box touches is checked first). Returns the bytes read from the file.
pub(crate) fn copy_box<T: Element>(
    op: &'static str,
    rank: usize,
    file: &MappedFile,
    name: &str,
    b: &BoxCopy<'_>,
    crcs: Option<(&[u32], usize)>,
    dst: &mut [T],
) -> Result<u64> {
    let fail = |kind| Error::from(CheckpointError::new(op, rank, &file.path, Some(name), kind));
    let info = file.info(name).ok_or_else(|| fail(CheckpointErrorKind::TensorNotFound))?;
    let stored = from_st(info.dtype).ok_or_else(|| {
        fail(CheckpointErrorKind::DtypeMismatch {
            expected: T::DTYPE.to_string(),
            found: format!("{:?}", info.dtype),
        })
    })?;
    if info.shape != b.src_shape {
        return Err(fail(CheckpointErrorKind::Malformed {
            reason: format!(
                "the file holds shape {:?}, the index says {:?}",
                info.shape, b.src_shape
            ),
        }));
    }
    let esize = dtype_size(stored);
    let (start, end) = info.data_offsets;
    let data = &file.bytes()[file.data_start + start..file.data_start + end];
    let runs = b.runs();
    let mut read = 0u64;
    if let Some((crcs, chunk)) = crcs {
        let mut touched = BTreeSet::new();
        for &(so, _, n) in &runs {
            let (lo, hi) = (so * esize, (so + n) * esize);
            touched.extend(lo / chunk..hi.div_ceil(chunk));
        }
        if crcs.len() != data.len().div_ceil(chunk) {
            return Err(fail(CheckpointErrorKind::Malformed {
                reason: format!(
                    "{} checksums for {} bytes in chunks of {chunk}",
                    crcs.len(),
                    data.len()
                ),
            }));
        }
        for c in touched {
            let (lo, hi) = (c * chunk, ((c + 1) * chunk).min(data.len()));
            // Read ahead exactly this chunk (the kernel's own read-ahead does not know where a
            // rank's part ends).
            if let Some(map) = &file.map {
                let _ = map.advise_range(
                    memmap2::Advice::WillNeed,
                    file.data_start + start + lo,
                    hi - lo,
                );
            }
            let bytes = &data[lo..hi];
            let found = crc32fast::hash(bytes);
            read += bytes.len() as u64;
            if found != crcs[c] {
                return Err(fail(CheckpointErrorKind::ChecksumMismatch {
                    offset: (file.data_start + start + c * chunk) as u64,
                    expected: crcs[c],
                    found,
                }));
            }
        }
    }
    let mut copied = 0u64;
    for (so, doff, n) in runs {
        let src = &data[so * esize..(so + n) * esize];
        decode(stored, src, &mut dst[doff..doff + n]);
        copied += src.len() as u64;
    }
    Ok(read.max(copied))
}

/// `src` (little-endian elements of `stored`) into `dst`, converted to `T` when the types differ
/// (through f64, which holds every value of the four types exactly, rounded once into `T`).
pub(crate) fn decode<T: Element>(stored: DType, src: &[u8], dst: &mut [T]) {
    if stored == T::DTYPE {
        // SAFETY: `T` is the stored type (f32, f64, f16 or bf16: plain little-endian numbers of
        // `size_of::<T>()` bytes, every bit pattern a value), and `src` has `dst.len()` of them;
        // the copy is bytewise, so `src` needs no alignment.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                dst.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(dst),
            )
        }
        return;
    }
    let size = dtype_size(stored);
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(size)) {
        let v = match stored {
            DType::F32 => f64::from(f32::from_le_bytes(c.try_into().expect("4 bytes"))),
            DType::F64 => f64::from_le_bytes(c.try_into().expect("8 bytes")),
            DType::F16 => half::f16::from_le_bytes(c.try_into().expect("2 bytes")).to_f64(),
            DType::BF16 => half::bf16::from_le_bytes(c.try_into().expect("2 bytes")).to_f64(),
        };
        *d = T::from_f64(v);
    }
}

/// The bytes of a host tensor's elements.
pub(crate) fn as_bytes<T: Element>(values: &[T]) -> &[u8] {
    // SAFETY: `T` is f32, f64, f16 or bf16: no padding, every byte initialised; the slice lives
    // as long as `values`.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}

#[cfg(test)]
mod tests {
    use super::BoxCopy;

    #[test]
    fn a_box_is_cut_into_its_contiguous_runs() {
        // Columns 1..3 of a [3, 4] source into a [3, 2] part: one run per row.
        let b = BoxCopy {
            src_shape: &[3, 4],
            src_lo: vec![0, 1],
            dst_shape: &[3, 2],
            dst_lo: vec![0, 0],
            extent: vec![3, 2],
        };
        assert_eq!(b.runs(), vec![(1, 0, 2), (5, 2, 2), (9, 4, 2)]);
        // Rows 1..3 whole: one run.
        let b = BoxCopy {
            src_shape: &[4, 3],
            src_lo: vec![1, 0],
            dst_shape: &[5, 3],
            dst_lo: vec![2, 0],
            extent: vec![2, 3],
        };
        assert_eq!(b.runs(), vec![(3, 6, 6)]);
        // An empty box, and a scalar.
        let e = BoxCopy {
            src_shape: &[0, 3],
            src_lo: vec![0, 0],
            dst_shape: &[0, 3],
            dst_lo: vec![0, 0],
            extent: vec![0, 3],
        };
        assert!(e.runs().is_empty());
        let s = BoxCopy {
            src_shape: &[],
            src_lo: vec![],
            dst_shape: &[],
            dst_lo: vec![],
            extent: vec![],
        };
        assert_eq!(s.runs(), vec![(0, 0, 1)]);
        // The middle dimension partial in a 3-D box.
        let b = BoxCopy {
            src_shape: &[2, 3, 2],
            src_lo: vec![0, 1, 0],
            dst_shape: &[2, 1, 2],
            dst_lo: vec![0, 0, 0],
            extent: vec![2, 1, 2],
        };
        assert_eq!(b.runs(), vec![(2, 0, 2), (8, 2, 2)]);
    }
}
