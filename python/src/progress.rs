//! `ProgressTracker`: the Rust progress tracker (`hivemesh::train`) for Python. Its background
//! loops run on the process's tokio runtime and never take the GIL; every method here takes
//! the core's lock for microseconds, and the only waits (`wait_fetched`, `shutdown`) release
//! the GIL.

use std::sync::Arc;
use std::time::Duration;

use hivemesh::train::{
    ProgressConfig, ProgressLimits, ProgressTracker as RustTracker, TrackerError,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::DHTError;
use crate::node::Node;
use crate::runtime::{self, OnInterrupt, Owner};

/// `secs` as a duration, or a `ValueError` naming `what` if it is negative or not finite.
pub(crate) fn seconds(what: &str, secs: f64) -> PyResult<Duration> {
    if secs.is_finite() && secs >= 0.0 {
        Ok(Duration::from_secs_f64(secs))
    } else {
        Err(PyValueError::new_err(format!(
            "{what} must be a finite non-negative number of seconds, not {secs}"
        )))
    }
}

fn tracker_error(e: TrackerError) -> PyErr {
    match e {
        TrackerError::Config(e) => PyValueError::new_err(e.to_string()),
        e => DHTError::new_err(e.to_string()),
    }
}

/// Tracks this peer's and the swarm's training progress through the DHT (the Rust
/// `hivemesh::train::ProgressTracker`). See `hivemesh.optim.progress_tracker` for the Python
/// API built on this class.
#[pyclass(module = "hivemesh._hivemesh")]
pub(crate) struct ProgressTracker {
    inner: Arc<RustTracker>,
    owner: Owner,
    peer_id: Vec<u8>,
}

#[pymethods]
impl ProgressTracker {
    /// A tracker of the run `prefix` on `node`; fetches the swarm's progress once (under
    /// `request_timeout`) and, with `start`, starts publishing and fetching in the background.
    #[new]
    #[pyo3(signature = (node, prefix, target_batch_size, *, client_mode=false, min_refresh_period=0.5, max_refresh_period=10.0, default_refresh_period=3.0, expected_drift_peers=3.0, expected_drift_rate=0.2, performance_ema_alpha=0.1, metadata_expiration=60.0, request_timeout=30.0, start=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        node: &Node,
        prefix: String,
        target_batch_size: u64,
        client_mode: bool,
        min_refresh_period: f64,
        max_refresh_period: f64,
        default_refresh_period: f64,
        expected_drift_peers: f64,
        expected_drift_rate: f64,
        performance_ema_alpha: f64,
        metadata_expiration: f64,
        request_timeout: f64,
        start: bool,
    ) -> PyResult<Self> {
        let config = ProgressConfig {
            target_batch_size,
            client_mode,
            min_refresh_period: seconds("min_refresh_period", min_refresh_period)?,
            max_refresh_period: seconds("max_refresh_period", max_refresh_period)?,
            default_refresh_period: seconds("default_refresh_period", default_refresh_period)?,
            expected_drift_peers,
            expected_drift_rate,
            performance_ema_alpha,
            metadata_expiration: seconds("metadata_expiration", metadata_expiration)?,
            request_timeout: seconds("request_timeout", request_timeout)?,
            limits: ProgressLimits::default(),
        };
        config
            .validate()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let dht = node.parts()?.dht;
        let peer_id = dht.p2p().peer_id().to_bytes();
        let tracker = runtime::block_on(py, async move {
            let tracker = RustTracker::new(dht, &prefix, config).await?;
            if start {
                tracker.start();
            }
            Ok::<_, TrackerError>(tracker)
        })?
        .map_err(tracker_error)?;
        Ok(Self {
            inner: Arc::new(tracker),
            owner: Owner::here(),
            peer_id,
        })
    }

    /// Starts the background loops (a no-op if running or shut down).
    fn start(&self) -> PyResult<()> {
        self.owner.check("ProgressTracker")?;
        let _runtime = runtime::handle()?.enter();
        self.inner.start();
        Ok(())
    }

    /// Whether the background loops run.
    #[getter]
    fn is_alive(&self) -> bool {
        self.owner.is_here() && self.inner.is_running()
    }

    /// `(epoch, samples_accumulated, target_batch_size, num_peers, num_clients,
    /// eta_next_epoch, next_fetch_time)`.
    fn global_progress(&self) -> (u64, u64, u64, usize, usize, f64, f64) {
        let g = self.inner.global_progress();
        (
            g.epoch,
            g.samples_accumulated,
            g.target_batch_size,
            g.num_peers,
            g.num_clients,
            g.eta_next_epoch,
            g.next_fetch_time,
        )
    }

    /// `(peer_id bytes, epoch, samples_accumulated, samples_per_second, time, client_mode)`.
    #[allow(clippy::type_complexity)]
    fn local_progress<'py>(
        &self,
        py: Python<'py>,
    ) -> (Bound<'py, PyBytes>, u64, u64, f64, f64, bool) {
        let l = self.inner.local_progress();
        (
            PyBytes::new(py, &self.peer_id),
            l.epoch,
            l.samples_accumulated,
            l.samples_per_second,
            l.time,
            l.client_mode,
        )
    }

    /// The global epoch.
    #[getter]
    fn global_epoch(&self) -> u64 {
        self.inner.global_epoch()
    }

    /// Whether this peer may end its epoch now.
    #[getter]
    fn ready_to_update_epoch(&self) -> bool {
        self.inner.ready_to_update_epoch()
    }

    /// When this peer should end its epoch (DHT time).
    #[getter]
    fn estimated_next_update_time(&self) -> f64 {
        self.inner.estimated_next_update_time()
    }

    /// Reports `samples_accumulated` samples toward the end of `local_epoch`.
    #[pyo3(signature = (local_epoch, samples_accumulated, update_global_samples=true))]
    fn report_local_progress(
        &self,
        local_epoch: u64,
        samples_accumulated: u64,
        update_global_samples: bool,
    ) {
        self.inner
            .report_local_progress(local_epoch, samples_accumulated, update_global_samples);
    }

    /// Moves this peer to `new_epoch` (default: its epoch + 1); returns it.
    #[pyo3(signature = (new_epoch=None))]
    fn update_epoch(&self, new_epoch: Option<u64>) -> u64 {
        self.inner.update_epoch(new_epoch)
    }

    /// Pauses updates of the global progress and the throughput clock (pair with `resume`).
    fn pause(&self) {
        self.inner.pause();
    }

    /// Ends one `pause`.
    fn resume(&self) {
        self.inner.resume();
    }

    /// The local throughput estimate (samples per second).
    #[getter]
    fn samples_per_second(&self) -> f64 {
        self.inner
            .with_core(|c| c.performance_ema().samples_per_second())
    }

    /// Registers `task_size` samples in the throughput estimate (processed in `interval`
    /// seconds, or since the last update); returns the new estimate.
    #[pyo3(signature = (task_size, interval=None))]
    fn ema_update(&self, task_size: f64, interval: Option<f64>) -> PyResult<f64> {
        let now = hivemesh::dht::DhtTime::now().as_secs();
        self.inner
            .with_core(|c| c.performance_ema_mut().update(task_size, interval, now))
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Pauses the throughput estimate alone (time passing stops counting).
    fn ema_pause(&self) {
        self.inner.with_core(|c| c.performance_ema_mut().pause());
    }

    /// Resumes the throughput estimate alone, its timer restarting now.
    fn ema_resume(&self) {
        let now = hivemesh::dht::DhtTime::now().as_secs();
        self.inner
            .with_core(|c| c.performance_ema_mut().resume(now));
    }

    /// Restarts the throughput estimate's timer.
    fn ema_reset_timer(&self) {
        let now = hivemesh::dht::DhtTime::now().as_secs();
        self.inner
            .with_core(|c| c.performance_ema_mut().reset_timer(now));
    }

    /// Whether a fetch was applied since the epoch last changed here.
    fn fetched_this_epoch(&self) -> bool {
        self.inner.with_core(|c| c.fetched_this_epoch())
    }

    /// Marks the global progress as not fetched since.
    fn clear_fetched(&self) {
        self.inner.with_core(|c| c.clear_fetched());
    }

    /// Waits (GIL released) until a fetch is applied after the last epoch change, at most
    /// `timeout` seconds (default: forever); returns whether one was.
    #[pyo3(signature = (timeout=None))]
    fn wait_fetched(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        self.owner.check("ProgressTracker")?;
        let limit = match timeout {
            Some(t) => seconds("timeout", t)?,
            None => Duration::from_secs(365 * 24 * 3600),
        };
        let inner = self.inner.clone();
        let done = runtime::wait(
            py,
            async move { inner.wait_fetched(limit).await },
            OnInterrupt::<fn()>::Abort,
            None,
        )?;
        Ok(done.unwrap_or(false))
    }

    /// Stops the background loops (at most `timeout` seconds, default 10) and withdraws this
    /// peer's record. Idempotent.
    #[pyo3(signature = (timeout=None))]
    fn shutdown(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        if !self.owner.is_here() {
            return Ok(());
        }
        let limit = seconds("timeout", timeout.unwrap_or(10.0))?;
        let inner = self.inner.clone();
        runtime::block_on(py, async move { inner.shutdown(limit).await })?.map_err(tracker_error)
    }
}

impl Drop for ProgressTracker {
    fn drop(&mut self) {
        if !self.owner.is_here() {
            // A forked child: the tracker's task lives only in the parent. Leaking one
            // reference keeps the tracker's own drop (which touches that task) from running.
            std::mem::forget(self.inner.clone());
        }
    }
}
