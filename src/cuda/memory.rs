//! hivemesh's own device and pinned host memory: allocated once and reused, freed off the
//! data path.
//!
//! `cuMemFree` and `cuMemFreeHost` synchronize the whole device, and `cuMemHostAlloc` is slow;
//! on the training thread, or on a runtime worker that happens to drop a round's last
//! snapshot handle, either stalls it. So:
//! * a staging's buffers are allocated when it is made and reused every round; the pinned
//!   snapshot buffers form a small pool ([`Pool`]) so that a round still holding last round's
//!   snapshot does not force an allocation each time (a second buffer is made once, then both
//!   alternate);
//! * every free happens on the device's *reaper* thread ([`Reaper`]): a drop hands the
//!   pointer over (after the events still ordering work on it, which the reaper waits for
//!   first), and the dropping thread makes no CUDA call, so its current context is untouched.

use std::sync::Arc;
use std::sync::mpsc::{SyncSender, sync_channel};
use std::thread::JoinHandle;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaEvent, result};

use super::CudaError;

/// How many retirements may wait for the reaper before a drop blocks for room.
const RETIRE_QUEUE: usize = 256;

/// A thread that disposes of what it is handed, in order. Dropping the last handle closes the
/// queue and joins the thread once it has disposed of everything queued.
pub(crate) struct Reaper<T: Send + 'static> {
    tx: Option<SyncSender<T>>,
    thread: Option<JoinHandle<()>>,
}

impl<T: Send + 'static> Reaper<T> {
    /// Starts the thread `name`, which calls `dispose` on every item handed over.
    pub(crate) fn start(
        name: &str,
        mut dispose: impl FnMut(T) + Send + 'static,
    ) -> std::io::Result<Arc<Self>> {
        let (tx, rx) = sync_channel::<T>(RETIRE_QUEUE);
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                for item in rx {
                    dispose(item);
                }
            })?;
        Ok(Arc::new(Self {
            tx: Some(tx),
            thread: Some(thread),
        }))
    }

    /// Hands `item` over (blocking only while the queue is full). Should the thread be gone
    /// (a panic in `dispose`), the item is leaked rather than disposed of here.
    pub(crate) fn retire(&self, item: T) {
        if let Some(tx) = &self.tx
            && let Err(e) = tx.send(item)
        {
            std::mem::forget(e.0);
        }
    }
}

impl<T: Send + 'static> Drop for Reaper<T> {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take()
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
    }
}

/// A pointer the reaper frees.
#[derive(Debug)]
pub(crate) enum Memory {
    /// From `cuMemAlloc`.
    Device(CUdeviceptr),
    /// From `cuMemHostAlloc`.
    Pinned(*mut u8),
}

/// What a drop hands to the reaper: events to wait for (and destroy), then memory to free,
/// in `ctx`.
pub(crate) struct Retired {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) after: Vec<Arc<CudaEvent>>,
    pub(crate) memory: Option<Memory>,
}

// SAFETY: the raw pointer is memory nobody else uses any more (handed over by its last owner).
unsafe impl Send for Retired {}

/// The device's reaper of CUDA memory.
pub(crate) type CudaReaper = Reaper<Retired>;

/// The reaper's work: wait for the events, then free.
pub(crate) fn dispose(r: Retired) {
    if r.ctx.bind_to_thread().is_err() {
        return;
    }
    for e in &r.after {
        let _ = e.synchronize();
    }
    // SAFETY: the memory came from the matching allocation, is freed once, and the work that
    // used it is complete (the events above, and the owners' guarantees).
    match r.memory {
        Some(Memory::Device(p)) => {
            let _ = unsafe { result::free_sync(p) };
        }
        Some(Memory::Pinned(p)) => {
            let _ = unsafe { result::free_host(p.cast()) };
        }
        None => {}
    }
}

/// Starts a device's reaper thread.
pub(crate) fn start_reaper(ordinal: usize) -> Result<Arc<CudaReaper>, CudaError> {
    Reaper::start(&format!("hivemesh-cuda{ordinal}-free"), dispose).map_err(CudaError::Reaper)
}

/// What an allocation needs to be freed by the reaper: its context and the reaper.
struct Freer {
    ctx: Arc<CudaContext>,
    reaper: Arc<CudaReaper>,
}

impl Freer {
    /// Binds `ctx` to the calling thread for the allocation (callers restore theirs).
    fn bind(ctx: &Arc<CudaContext>, reaper: &Arc<CudaReaper>) -> Result<Self, CudaError> {
        ctx.bind_to_thread()?;
        Ok(Self {
            ctx: ctx.clone(),
            reaper: reaper.clone(),
        })
    }

    fn free(&self, memory: Memory) {
        self.reaper.retire(Retired {
            ctx: self.ctx.clone(),
            after: Vec::new(),
            memory: Some(memory),
        });
    }
}

/// Device memory hivemesh allocated; freed by the reaper.
pub(crate) struct DeviceAlloc {
    freer: Freer,
    pub(crate) ptr: CUdeviceptr,
}

impl DeviceAlloc {
    /// `bytes` (at least 1) of device memory. Binds `ctx` to the calling thread (callers
    /// restore theirs).
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        reaper: &Arc<CudaReaper>,
        bytes: usize,
    ) -> Result<Self, CudaError> {
        let freer = Freer::bind(ctx, reaper)?;
        // SAFETY: a plain allocation of `bytes.max(1)` bytes in the bound context.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }?;
        Ok(Self { freer, ptr })
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        self.freer.free(Memory::Device(self.ptr));
    }
}

/// Page-locked host memory, for asynchronous copies; freed by the reaper.
pub(crate) struct PinnedAlloc {
    freer: Freer,
    pub(crate) ptr: *mut u8,
    bytes: usize,
}

// SAFETY: plain memory; who reads or writes it is governed by `&`/`&mut` as for a `Vec`.
unsafe impl Send for PinnedAlloc {}
// SAFETY: see `Send`.
unsafe impl Sync for PinnedAlloc {}

impl PinnedAlloc {
    /// `bytes` of pinned memory. Binds `ctx` to the calling thread (callers restore theirs).
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        reaper: &Arc<CudaReaper>,
        bytes: usize,
    ) -> Result<Self, CudaError> {
        let freer = Freer::bind(ctx, reaper)?;
        // SAFETY: a plain page-locked allocation in the bound context.
        let ptr = unsafe { result::malloc_host(bytes.max(4), 0) }?.cast::<u8>();
        Ok(Self { freer, ptr, bytes })
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `bytes` bytes allocated above, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }
}

impl Drop for PinnedAlloc {
    fn drop(&mut self) {
        self.freer.free(Memory::Pinned(self.ptr));
    }
}

/// Buffers shared with whoever reads them (a round's snapshot tensor holds an `Arc`), reused
/// once nobody else holds them; at most `cap` of them.
pub(crate) struct Pool<T> {
    items: Vec<Arc<T>>,
    cap: usize,
}

impl<T> Pool<T> {
    /// A pool holding `first`, growing to at most `cap` buffers.
    pub(crate) fn new(first: T, cap: usize) -> Self {
        Self {
            items: vec![Arc::new(first)],
            cap: cap.max(1),
        }
    }

    /// The index of a buffer nobody else holds: the first such, else a new one from `make`
    /// (kept for later rounds) while there are fewer than `cap`; `Ok(None)` when all `cap`
    /// are held.
    pub(crate) fn pick<E>(
        &mut self,
        make: impl FnOnce() -> Result<T, E>,
    ) -> Result<Option<usize>, E> {
        if let Some(i) = self.items.iter().position(|b| Arc::strong_count(b) == 1) {
            return Ok(Some(i));
        }
        if self.items.len() >= self.cap {
            return Ok(None);
        }
        self.items.push(Arc::new(make()?));
        Ok(Some(self.items.len() - 1))
    }

    /// Buffer `i`.
    pub(crate) fn get(&self, i: usize) -> &Arc<T> {
        &self.items[i]
    }

    /// Buffer `i`, writable where nobody else holds it.
    pub(crate) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        Arc::get_mut(&mut self.items[i])
    }

    /// How many buffers there are.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::mpsc::channel;

    use super::*;

    #[test]
    fn the_pool_reuses_free_buffers_and_grows_only_while_all_are_held() {
        let mut made = 0;
        let mut pool = Pool::new(0u32, 3);
        let mut make = || -> Result<u32, ()> {
            made += 1;
            Ok(made)
        };
        // Nobody holds the first: reused, every time.
        assert_eq!(pool.pick(&mut make), Ok(Some(0)));
        assert_eq!(pool.pick(&mut make), Ok(Some(0)));
        assert!(pool.get_mut(0).is_some());
        // A round holds it: a second buffer, made once.
        let held = pool.get(0).clone();
        assert!(pool.get_mut(0).is_none());
        assert_eq!(pool.pick(&mut make), Ok(Some(1)));
        assert_eq!(pool.pick(&mut make), Ok(Some(1)));
        // Released: the first is reused, nothing made.
        drop(held);
        assert_eq!(pool.pick(&mut make), Ok(Some(0)));
        assert_eq!(pool.len(), 2);
        // Every buffer held, at the cap: none.
        let held: Vec<_> = (0..2).map(|i| pool.get(i).clone()).collect();
        assert_eq!(pool.pick(&mut make), Ok(Some(2)));
        let third = pool.get(2).clone();
        assert_eq!(pool.pick(&mut make), Ok(None));
        assert_eq!(pool.len(), 3);
        drop((held, third));
        assert_eq!(pool.pick(&mut make), Ok(Some(0)));
        // An allocation failure is the caller's error.
        let mut one = Pool::new(0u32, 2);
        let _h = one.get(0).clone();
        assert_eq!(one.pick(|| Err::<u32, _>("full")), Err("full"));
    }

    #[test]
    fn the_reaper_disposes_on_its_own_thread_in_order_and_drains_before_it_ends() {
        let (tx, rx) = channel();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        let reaper = Reaper::start("test-reaper", move |item: u32| {
            record.lock().unwrap().push(item);
            tx.send(std::thread::current().id()).unwrap();
        })
        .unwrap();
        // Handed over from several threads, disposed of on the reaper's thread.
        let here = std::thread::current().id();
        let other = {
            let reaper = reaper.clone();
            std::thread::spawn(move || {
                reaper.retire(1);
                std::thread::current().id()
            })
            .join()
            .unwrap()
        };
        reaper.retire(2);
        for _ in 0..(2 * RETIRE_QUEUE) {
            reaper.retire(3); // more than the queue holds: the drop waits for room
        }
        // The last handle's drop joins the thread after everything queued was disposed of.
        drop(reaper);
        let threads: Vec<_> = rx.iter().collect();
        assert_eq!(threads.len(), 2 + 2 * RETIRE_QUEUE);
        assert!(threads.iter().all(|t| *t != here && *t != other));
        let seen = seen.lock().unwrap();
        assert_eq!(seen[..2], [1, 2]);
        assert!(seen[2..].iter().all(|&v| v == 3));
    }
}
