//! How the library splits a length between ranks: as `numpy.array_split` does.

/// The lengths of `parts` pieces of `len`: the first `len % parts` pieces get one more.
///
/// # Panics
/// If `parts` is zero.
///
/// # Examples
/// ```
/// use dist_tensor::tensor::array_split;
/// assert_eq!(array_split(10, 4), vec![3, 3, 2, 2]);
/// assert_eq!(array_split(2, 4), vec![1, 1, 0, 0]);
/// ```
#[track_caller]
pub fn array_split(len: usize, parts: usize) -> Vec<usize> {
    assert!(parts > 0, "array_split into zero parts");
    (0..parts).map(|i| len / parts + usize::from(i < len % parts)).collect()
}

/// Where each piece of `counts` starts, and the total at the end (`counts.len() + 1` values).
///
/// # Examples
/// ```
/// use dist_tensor::tensor::split_offsets;
/// assert_eq!(split_offsets(&[3, 0, 2]), vec![0, 3, 3, 5]);
/// ```
pub fn split_offsets(counts: &[usize]) -> Vec<usize> {
    let mut offsets = Vec::with_capacity(counts.len() + 1);
    let mut at = 0;
    offsets.push(0);
    for &c in counts {
        at += c;
        offsets.push(at);
    }
    offsets
}
