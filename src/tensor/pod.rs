//! [`Pod`]: the element types symmetric memory may hold.

mod sealed {
    pub trait Sealed {}
}

/// Plain data that may live in symmetric memory: every bit pattern is a valid value, so memory
/// reused from an earlier allocation, or written by a peer, is always safe to read.
///
/// Implemented for the tensor element types (f32, f64, f16, bf16) and the integer types a kernel
/// uses for metadata.
pub trait Pod: Copy + Send + Sync + 'static + sealed::Sealed {}

macro_rules! pod {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl Pod for $t {}
    )*};
}

pod!(f32, f64, half::f16, half::bf16, u8, u16, u32, u64, i32, i64, usize);
