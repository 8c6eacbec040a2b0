//! `hivemesh._hivemesh`: the native half of the Python package (`python/hivemesh/` is the
//! other half, with hivemind's names and signatures on top of these classes).
//!
//! * [`runtime`]: one tokio runtime per process (a new one after `fork`), and the one way
//!   Python waits for Rust: with the GIL released, checking for signals between short waits,
//!   so that other Python threads run and Ctrl-C interrupts.
//! * [`node`]: `Node`, a hivemesh node (swarm, DHT, link hub) with the DHT's store/get.
//! * [`averager`]: `Averager` over tensors shared with Python (PyTorch or numpy memory, not
//!   copied), `StepControl`, `TensorLock`.
//! * [`progress`]: `ProgressTracker`, the Rust progress tracker of collaborative training.
//!
//! Every error reaches Python as an exception under `HivemeshError` carrying the Rust error's
//! message.

use pyo3::create_exception;
use pyo3::prelude::*;

mod averager;
#[cfg(feature = "cuda")]
mod cuda;
mod monitor;
mod node;
mod progress;
mod runtime;

create_exception!(
    _hivemesh,
    HivemeshError,
    pyo3::exceptions::PyException,
    "Base of every hivemesh error."
);
create_exception!(
    _hivemesh,
    DHTError,
    HivemeshError,
    "The swarm or DHT failed (starting, storing, reading)."
);
create_exception!(
    _hivemesh,
    AveragingError,
    HivemeshError,
    "A step failed: linking, the all-reduce, an unreachable group."
);
create_exception!(
    _hivemesh,
    MatchmakingError,
    AveragingError,
    "No group formed in time."
);
create_exception!(
    _hivemesh,
    StateError,
    HivemeshError,
    "Downloading or serving the averager's state failed."
);
create_exception!(
    _hivemesh,
    ShutdownError,
    HivemeshError,
    "The node or averager has shut down (or was created in a parent process before a fork)."
);

/// The native module.
#[pymodule]
fn _hivemesh(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("HivemeshError", py.get_type::<HivemeshError>())?;
    m.add("DHTError", py.get_type::<DHTError>())?;
    m.add("AveragingError", py.get_type::<AveragingError>())?;
    m.add("MatchmakingError", py.get_type::<MatchmakingError>())?;
    m.add("StateError", py.get_type::<StateError>())?;
    m.add("ShutdownError", py.get_type::<ShutdownError>())?;
    m.add_class::<node::Node>()?;
    m.add_class::<averager::Averager>()?;
    m.add_class::<averager::StepControl>()?;
    m.add_class::<averager::TensorLock>()?;
    m.add_class::<progress::ProgressTracker>()?;
    m.add_class::<monitor::Monitor>()?;
    m.add_class::<monitor::MetricsPublisher>()?;
    m.add_function(wrap_pyfunction!(node::get_dht_time, m)?)?;
    m.add_function(wrap_pyfunction!(node::peer_id_to_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(node::peer_id_to_base58, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Whether CUDA tensors can be averaged (an extension built with `--features cuda`).
    m.add("CUDA", cfg!(feature = "cuda"))?;
    Ok(())
}
