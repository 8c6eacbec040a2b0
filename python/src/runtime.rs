//! The process's tokio runtime, and waiting on it from Python.
//!
//! One multi-threaded runtime per process, started on first use. After `fork` the child has
//! the parent's memory but none of its threads: the parent's runtime is unusable there, so a
//! child that uses hivemesh starts a runtime of its own (the old one is leaked, never dropped:
//! dropping it would wait for threads that do not exist). Objects made before the fork belong
//! to the parent; in a child they refuse every call ([`Owner::check`]).

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use tokio::runtime::{Handle, Runtime};

use crate::ShutdownError;

/// How often a wait wakes up to let Python run its signal handlers (Ctrl-C).
const SIGNAL_CHECK: Duration = Duration::from_millis(50);

static RUNTIME: Mutex<Option<(u32, Runtime)>> = Mutex::new(None);

/// The runtime of this process (started now if there is none, or only the parent's).
pub(crate) fn handle() -> PyResult<Handle> {
    let mut slot = RUNTIME.lock().unwrap_or_else(|e| e.into_inner());
    let pid = std::process::id();
    if let Some((owner, rt)) = slot.as_ref()
        && *owner == pid
    {
        return Ok(rt.handle().clone());
    }
    if let Some((_, parents)) = slot.take() {
        // Forked: the parent's worker threads do not exist here.
        std::mem::forget(parents);
    }
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(2, 8);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("hivemesh")
        .enable_all()
        .build()
        .map_err(|e| ShutdownError::new_err(format!("cannot start the async runtime: {e}")))?;
    let handle = rt.handle().clone();
    *slot = Some((pid, rt));
    Ok(handle)
}

/// The process an object was made in: in a forked child, the object's tasks do not exist.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Owner(u32);

impl Owner {
    pub(crate) fn here() -> Self {
        Self(std::process::id())
    }

    /// Whether this is the process the object was made in.
    pub(crate) fn is_here(self) -> bool {
        self.0 == std::process::id()
    }

    /// Fails in a process other than the one the object was made in.
    pub(crate) fn check(self, what: &str) -> PyResult<()> {
        if self.is_here() {
            Ok(())
        } else {
            Err(ShutdownError::new_err(format!(
                "this {what} was created in process {} and cannot be used after fork() in \
                 process {}; create a new one in this process",
                self.0,
                std::process::id()
            )))
        }
    }
}

/// What a wait does when a Python signal handler raises (Ctrl-C: `KeyboardInterrupt`).
pub(crate) enum OnInterrupt<F: FnOnce()> {
    /// Drop the future.
    Abort,
    /// Run this (e.g. cancel a step), then let the future end (at most 30 s).
    Finish(F),
}

/// Runs `fut` on the runtime and waits for it with the GIL released, waking every
/// [`SIGNAL_CHECK`] to run Python's signal handlers; if one raises, does what `on_interrupt`
/// says and returns the handler's exception. `Ok(None)`: `timeout` passed first (the future
/// keeps running on the runtime).
pub(crate) fn wait<T, F, I>(
    py: Python<'_>,
    fut: F,
    on_interrupt: OnInterrupt<I>,
    timeout: Option<Duration>,
) -> PyResult<Option<T>>
where
    T: Send + 'static,
    F: Future<Output = T> + Send + 'static,
    I: FnOnce(),
{
    let rt = handle()?;
    let mut task = rt.spawn(fut);
    // A timeout past what an instant holds (timeout=1e19) is no deadline.
    let deadline = timeout.and_then(|t| std::time::Instant::now().checked_add(t));
    loop {
        let step = match deadline {
            Some(d) => SIGNAL_CHECK.min(d.saturating_duration_since(std::time::Instant::now())),
            None => SIGNAL_CHECK,
        };
        let polled =
            py.detach(|| rt.block_on(async { tokio::time::timeout(step, &mut task).await }));
        match polled {
            Ok(Ok(out)) => return Ok(Some(out)),
            Ok(Err(e)) => {
                return Err(ShutdownError::new_err(format!(
                    "a hivemesh task failed: {e}"
                )));
            }
            Err(_) => {}
        }
        if let Err(interrupt) = py.check_signals() {
            match on_interrupt {
                OnInterrupt::Abort => task.abort(),
                OnInterrupt::Finish(f) => {
                    f();
                    let _ = py.detach(|| {
                        rt.block_on(async {
                            tokio::time::timeout(Duration::from_secs(30), task).await
                        })
                    });
                }
            }
            return Err(interrupt);
        }
        if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            return Ok(None);
        }
    }
}

/// [`wait`] with no timeout, dropping the future on Ctrl-C.
pub(crate) fn block_on<T, F>(py: Python<'_>, fut: F) -> PyResult<T>
where
    T: Send + 'static,
    F: Future<Output = T> + Send + 'static,
{
    let out = wait(py, fut, OnInterrupt::<fn()>::Abort, None)?;
    out.ok_or_else(|| ShutdownError::new_err("a wait without a timeout timed out"))
}
