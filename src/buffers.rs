//! A pool of reusable buffers for the data path.
//!
//! A round moves the whole tensor through memory several times: encoded parts going out,
//! frames coming in, decoded contributions and averages in the reducer. Allocating those
//! buffers fresh for every part and every round costs more than moving the bytes: a fresh
//! 512 KiB allocation is usually a fresh `mmap`, and every one of its pages is then faulted in
//! and zeroed by the kernel (measured at ~18 % of a 4-peer round's CPU before this pool,
//! `hivemesh bench allreduce`). The pool keeps buffers that were used and hands them out
//! again, across parts and across rounds (the runner holds one pool per
//! [`crate::runner::RunnerConfig`]).
//!
//! * Byte buffers ([`BufferPool::take_bytes`]) back outgoing payloads and incoming frames.
//!   [`BufferPool::freeze`] turns one into a [`Bytes`] whose last clone, when dropped (by a
//!   writer task once the frame is on the wire, or by the decoder once the payload is
//!   consumed), gives the buffer back: zero copies, no per-part allocation.
//! * f32 buffers ([`BufferPool::take_f32`]) back decoded parts and averages in the reducer.
//!   They come back with unspecified contents (no zeroing): callers overwrite them.
//!
//! The pool is bounded: it retains at most [`BufferPool::new`]'s `retain_bytes` of capacity
//! and [`MAX_RETAINED_BUFFERS`] buffers; anything beyond is freed. It is cheap to clone (one
//! `Arc`) and safe to share between threads; a dropped pool turns outstanding [`Bytes`] back
//! into plain allocations that are freed normally.

use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;

/// At most this many buffers of each kind are retained.
pub const MAX_RETAINED_BUFFERS: usize = 256;

/// Default bound on retained capacity (64 MiB).
pub const DEFAULT_RETAIN_BYTES: usize = 64 << 20;

#[derive(Debug, Default)]
struct Inner {
    bytes: Vec<Vec<u8>>,
    floats: Vec<Vec<f32>>,
    retained: usize,
    limit: usize,
}

impl Inner {
    fn admit(&mut self, capacity_bytes: usize) -> bool {
        if capacity_bytes == 0 || self.retained + capacity_bytes > self.limit {
            return false;
        }
        self.retained += capacity_bytes;
        true
    }
}

/// A bounded, shareable pool of byte and f32 buffers (see the module docs).
#[derive(Clone, Debug)]
pub struct BufferPool {
    inner: Arc<Mutex<Inner>>,
}

impl Default for BufferPool {
    fn default() -> Self {
        Self::new(DEFAULT_RETAIN_BYTES)
    }
}

/// Fresh allocations are rounded up to a multiple of this many bytes, so that a buffer serves
/// later requests a little larger than the first (frames of one part size differ by a few
/// header bytes; without this, nearly every frame missed the pool and paid for fresh,
/// page-faulting memory: 6 % of a round's CPU in `hivemesh bench allreduce`).
const GRANULE: usize = 4096;

/// `bytes` rounded up to a multiple of [`GRANULE`].
fn rounded(bytes: usize) -> usize {
    bytes.checked_next_multiple_of(GRANULE).unwrap_or(bytes)
}

/// Index of the smallest buffer whose capacity is at least `want` (best fit), if any.
fn best_fit<T>(bufs: &[Vec<T>], want: usize) -> Option<usize> {
    bufs.iter()
        .enumerate()
        .filter(|(_, b)| b.capacity() >= want)
        .min_by_key(|(_, b)| b.capacity())
        .map(|(i, _)| i)
}

impl BufferPool {
    /// A pool that retains at most `retain_bytes` of buffer capacity.
    pub fn new(retain_bytes: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                limit: retain_bytes,
                ..Inner::default()
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the pool inconsistent in a way that
        // matters (at worst a miscounted byte total), so poisoning is ignored.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An empty byte buffer with at least `capacity` bytes of capacity.
    pub fn take_bytes(&self, capacity: usize) -> Vec<u8> {
        let mut b = self.take_bytes_keeping(capacity);
        b.clear();
        b
    }

    /// A byte buffer of exactly `len` initialized bytes with unspecified contents: a reused
    /// buffer keeps what it held (only bytes beyond its old length are zeroed), so reading
    /// into it costs no zeroing pass.
    pub fn take_filled(&self, len: usize) -> Vec<u8> {
        let mut b = self.take_bytes_keeping(len);
        b.resize(len, 0);
        b
    }

    fn take_bytes_keeping(&self, capacity: usize) -> Vec<u8> {
        let reused = {
            let mut inner = self.lock();
            best_fit(&inner.bytes, capacity).map(|i| {
                let b = inner.bytes.swap_remove(i);
                inner.retained -= b.capacity();
                b
            })
        };
        reused.unwrap_or_else(|| Vec::with_capacity(rounded(capacity)))
    }

    /// Gives a byte buffer back (freed instead if the pool is full).
    pub fn put_bytes(&self, buf: Vec<u8>) {
        put_bytes(&self.inner, buf);
    }

    /// `buf` as [`Bytes`], without copying; the buffer returns to this pool when the last
    /// clone of the result is dropped.
    pub fn freeze(&self, buf: Vec<u8>) -> Bytes {
        Bytes::from_owner(Pooled {
            buf,
            pool: Arc::downgrade(&self.inner),
        })
    }

    /// An f32 buffer of exactly `len` elements with unspecified contents.
    pub fn take_f32(&self, len: usize) -> Vec<f32> {
        let reused = {
            let mut inner = self.lock();
            best_fit(&inner.floats, len).map(|i| {
                let b = inner.floats.swap_remove(i);
                inner.retained -= b.capacity() * 4;
                b
            })
        };
        match reused {
            Some(mut v) => {
                // Only elements beyond the buffer's previous length are written here.
                v.resize(len, 0.0);
                v
            }
            // Zeroed by the allocator (fresh pages come zeroed; no pass over them here).
            None => vec![0.0; len],
        }
    }

    /// Gives an f32 buffer back (freed instead if the pool is full).
    pub fn put_f32(&self, buf: Vec<f32>) {
        put_f32(&self.inner, buf);
    }

    /// `buf`'s values as little-endian f32 [`Bytes`] without copying (on little-endian
    /// targets; elsewhere the values are encoded into a pooled byte buffer). The buffer
    /// returns to this pool when the last clone of the result is dropped.
    pub fn freeze_f32(&self, buf: Vec<f32>) -> Bytes {
        if cfg!(target_endian = "little") {
            Bytes::from_owner(PooledF32 {
                buf,
                pool: Arc::downgrade(&self.inner),
            })
        } else {
            let mut bytes = self.take_bytes(buf.len() * 4);
            bytes.extend(buf.iter().flat_map(|v| v.to_le_bytes()));
            self.put_f32(buf);
            self.freeze(bytes)
        }
    }

    /// Capacity currently retained, in bytes.
    pub fn retained_bytes(&self) -> usize {
        self.lock().retained
    }
}

fn put_bytes(inner: &Mutex<Inner>, buf: Vec<u8>) {
    let mut inner = inner.lock().unwrap_or_else(|e| e.into_inner());
    if inner.bytes.len() < MAX_RETAINED_BUFFERS && inner.admit(buf.capacity()) {
        inner.bytes.push(buf);
    }
}

fn put_f32(inner: &Mutex<Inner>, buf: Vec<f32>) {
    let mut inner = inner.lock().unwrap_or_else(|e| e.into_inner());
    if inner.floats.len() < MAX_RETAINED_BUFFERS && inner.admit(buf.capacity() * 4) {
        inner.floats.push(buf);
    }
}

/// The owner behind a pooled [`Bytes`].
struct Pooled {
    buf: Vec<u8>,
    pool: Weak<Mutex<Inner>>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            put_bytes(&pool, std::mem::take(&mut self.buf));
        }
    }
}

/// The owner behind [`BufferPool::freeze_f32`]'s [`Bytes`] (little-endian targets only: the
/// in-memory bytes of the values are then their little-endian encoding).
struct PooledF32 {
    buf: Vec<f32>,
    pool: Weak<Mutex<Inner>>,
}

impl AsRef<[u8]> for PooledF32 {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.buf)
    }
}

impl Drop for PooledF32 {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            put_f32(&pool, std::mem::take(&mut self.buf));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame a few header bytes longer than the last one still reuses its buffer.
    #[test]
    fn slightly_larger_requests_reuse_a_buffer() {
        let pool = BufferPool::new(4 << 20);
        let first = pool.take_filled((512 << 10) + 30);
        let ptr = first.as_ptr();
        pool.put_bytes(first);
        let second = pool.take_filled((512 << 10) + 41);
        assert_eq!(second.as_ptr(), ptr);
        assert_eq!(second.len(), (512 << 10) + 41);
    }

    #[test]
    fn frozen_f32_values_are_their_le_bytes_and_come_back() {
        let pool = BufferPool::new(1 << 20);
        let mut v = pool.take_f32(3);
        v.copy_from_slice(&[1.5, -2.0, 1e-3]);
        let ptr = v.as_ptr();
        let frozen = pool.freeze_f32(v);
        let want: Vec<u8> = [1.5f32, -2.0, 1e-3]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(&frozen[..], &want[..]);
        if cfg!(target_endian = "little") {
            let tail = frozen.slice(4..);
            drop(frozen);
            assert_eq!(pool.retained_bytes(), 0, "a clone is still alive");
            drop(tail);
            assert!(pool.retained_bytes() >= 12);
            let again = pool.take_f32(2);
            assert_eq!(again.as_ptr(), ptr, "the same allocation again");
        }
    }

    #[test]
    fn frozen_bytes_come_back_when_the_last_clone_drops() {
        let pool = BufferPool::new(1 << 20);
        let mut b = pool.take_bytes(1000);
        b.extend_from_slice(&[7u8; 1000]);
        let ptr = b.as_ptr();
        let frozen = pool.freeze(b);
        let slice = frozen.slice(10..20);
        drop(frozen);
        assert_eq!(pool.retained_bytes(), 0, "a clone is still alive");
        assert_eq!(&slice[..], &[7u8; 10]);
        drop(slice);
        assert!(pool.retained_bytes() >= 1000);
        let again = pool.take_bytes(500);
        assert_eq!(
            again.as_ptr(),
            ptr,
            "the same allocation is handed out again"
        );
        assert!(again.is_empty());
    }

    #[test]
    fn filled_buffers_have_the_asked_length_and_reuse_memory() {
        let pool = BufferPool::new(1 << 20);
        let b = pool.take_filled(1000);
        assert_eq!(b.len(), 1000);
        let ptr = b.as_ptr();
        pool.put_bytes(b);
        let b = pool.take_filled(600);
        assert_eq!((b.len(), b.as_ptr()), (600, ptr));
        pool.put_bytes(b);
        assert_eq!(pool.take_filled(900).len(), 900);
    }

    #[test]
    fn best_fit_and_bounds() {
        let pool = BufferPool::new(10_000);
        pool.put_bytes(Vec::with_capacity(8000));
        pool.put_bytes(Vec::with_capacity(4000)); // would exceed 10 000: freed
        assert_eq!(pool.retained_bytes(), 8000);
        assert!(pool.take_bytes(9000).capacity() >= 9000); // nothing fits: fresh
        assert_eq!(pool.retained_bytes(), 8000);
        assert_eq!(pool.take_bytes(100).capacity(), 8000);
        assert_eq!(pool.retained_bytes(), 0);
    }

    #[test]
    fn f32_buffers_have_the_asked_length() {
        let pool = BufferPool::new(1 << 20);
        let mut v = pool.take_f32(100);
        assert_eq!(v.len(), 100);
        v.iter_mut().for_each(|x| *x = 1.0);
        pool.put_f32(v);
        assert_eq!(pool.take_f32(50).len(), 50);
        assert_eq!(pool.take_f32(200).len(), 200);
    }

    #[test]
    fn bytes_outliving_the_pool_are_freed() {
        let pool = BufferPool::new(1 << 20);
        let frozen = pool.freeze(vec![1, 2, 3]);
        drop(pool);
        assert_eq!(&frozen[..], &[1, 2, 3]);
        drop(frozen); // must not panic or leak into a dead pool
    }
}
