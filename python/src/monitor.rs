//! `Monitor` (the `hivemesh monitor` node, run inside the Python process: `python -m
//! hivemesh.monitor`) and `MetricsPublisher` (a peer's metrics record for monitors, published
//! by `hivemesh.optim.Optimizer.report_metrics`). Both run on the process's tokio runtime.

use std::sync::{Arc, Mutex};

use hivemesh::dht::{Dht, DhtTime};
use hivemesh::monitor::{MonitorConfig, MonitorNode, MonitorOptions};
use hivemesh::train::{
    MetricsConfig, MetricsPublisher as RustPublisher, ModeClaim, PeerMetrics, ReachClaim,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::node::Node;
use crate::progress::seconds;
use crate::runtime::{self, Owner};
use crate::{DHTError, ShutdownError};

fn addrs(what: &str, list: Vec<String>) -> PyResult<Vec<libp2p::Multiaddr>> {
    list.into_iter()
        .map(|a| {
            a.parse()
                .map_err(|e| PyValueError::new_err(format!("{what} '{a}': {e}")))
        })
        .collect()
}

/// A monitor node: joins the swarm through `initial_peers` as a DHT client, watches the run
/// `run_id` and serves its page at `http` (`host:port`; port 0 picks one, see `url`);
/// `swarm_key`: a private swarm's key file.
#[pyclass(module = "hivemesh._hivemesh")]
pub(crate) struct Monitor {
    inner: Mutex<Option<MonitorNode>>,
    owner: Owner,
    url: String,
}

#[pymethods]
impl Monitor {
    #[new]
    #[pyo3(signature = (initial_peers, run_id, http="127.0.0.1:8080", *, listen=None, target_batch_size=None, refresh_period=2.0, max_peers=1000, history=900, swarm_key=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        initial_peers: Vec<String>,
        run_id: String,
        http: &str,
        listen: Option<Vec<String>>,
        target_batch_size: Option<u64>,
        refresh_period: f64,
        max_peers: usize,
        history: usize,
        swarm_key: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        let swarm_key = swarm_key
            .map(|path| {
                hivemesh::p2p::SwarmKey::read(&path)
                    .map_err(|e| PyValueError::new_err(e.to_string()))
            })
            .transpose()?;
        let http = http
            .parse()
            .map_err(|e| PyValueError::new_err(format!("http '{http}': {e} (want HOST:PORT)")))?;
        let options = MonitorOptions {
            initial_peers: addrs("initial peer", initial_peers)?,
            run_id,
            http,
            listen: addrs("listen address", listen.unwrap_or_default())?,
            swarm_key,
            config: MonitorConfig {
                refresh_period: seconds("refresh_period", refresh_period)?,
                max_peers,
                history_len: history,
                target_batch_size,
                ..MonitorConfig::default()
            },
        };
        options
            .config
            .validate()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let node = runtime::block_on(py, MonitorNode::start(options))?
            .map_err(|e| DHTError::new_err(e.to_string()))?;
        Ok(Self {
            url: node.url(),
            inner: Mutex::new(Some(node)),
            owner: Owner::here(),
        })
    }

    /// The page's address, `http://HOST:PORT/`.
    #[getter]
    fn url(&self) -> &str {
        &self.url
    }

    /// What `/api/state` returns, as a JSON string.
    fn state_json(&self) -> PyResult<String> {
        self.owner.check("Monitor")?;
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let node = inner
            .as_ref()
            .ok_or_else(|| ShutdownError::new_err("the monitor has shut down"))?;
        serde_json::to_string(&node.monitor().snapshot())
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Stops the server, the monitor and its DHT client. Idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        if !self.owner.is_here() {
            return Ok(());
        }
        let node = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(node) = node {
            runtime::block_on(py, node.shutdown())?
                .map_err(|e| DHTError::new_err(e.to_string()))?;
        }
        Ok(())
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        if !self.owner.is_here() {
            // A forked child: the node's tasks live only in the parent.
            if let Some(node) = self
                .inner
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .take()
            {
                std::mem::forget(node);
            }
        }
    }
}

/// Publishes this peer's metrics record for monitors under `"{prefix}_metrics"` (the Rust
/// `hivemesh::train::MetricsPublisher`).
#[pyclass(module = "hivemesh._hivemesh")]
pub(crate) struct MetricsPublisher {
    inner: Arc<RustPublisher>,
    dht: Dht,
    owner: Owner,
}

#[pymethods]
impl MetricsPublisher {
    #[new]
    #[pyo3(signature = (node, prefix, *, min_period=2.0, expiration=60.0, request_timeout=30.0))]
    fn new(
        node: &Node,
        prefix: String,
        min_period: f64,
        expiration: f64,
        request_timeout: f64,
    ) -> PyResult<Self> {
        let config = MetricsConfig {
            min_period: seconds("min_period", min_period)?,
            expiration: seconds("expiration", expiration)?,
            request_timeout: seconds("request_timeout", request_timeout)?,
        };
        let dht = node.parts()?.dht;
        let _runtime = runtime::handle()?.enter();
        let inner = RustPublisher::start(dht.clone(), &prefix, config)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Self {
            inner: Arc::new(inner),
            dht,
            owner: Owner::here(),
        })
    }

    /// Takes this peer's latest metrics; published soon. `reach`: `public`, `hole-punched`,
    /// `relayed` or `unknown` (default: what the node knows of itself); `mode`: `node`,
    /// `client` or `aux`; `name`: a display name of at most 64 bytes. Raises `ValueError`
    /// for values a monitor would refuse (a NaN or infinite loss, a negative rate, ...).
    #[pyo3(signature = (epoch, samples_per_second, *, loss=None, target_batch_size=0, rounds_ok=0, rounds_failed=0, last_group_size=0, reach=None, mode="node", name=""))]
    #[allow(clippy::too_many_arguments)]
    fn report(
        &self,
        epoch: u64,
        samples_per_second: f64,
        loss: Option<f64>,
        target_batch_size: u64,
        rounds_ok: u32,
        rounds_failed: u32,
        last_group_size: u16,
        reach: Option<&str>,
        mode: &str,
        name: &str,
    ) -> PyResult<()> {
        self.owner.check("MetricsPublisher")?;
        let reach = match reach {
            None => ReachClaim::from_reach(self.dht.p2p().reachability().reach),
            Some(r) => ReachClaim::from_name(r)
                .ok_or_else(|| PyValueError::new_err(format!("unknown reach '{r}'")))?,
        };
        let mode = ModeClaim::from_name(mode)
            .ok_or_else(|| PyValueError::new_err(format!("unknown mode '{mode}'")))?;
        let metrics = PeerMetrics {
            epoch,
            samples_per_second,
            loss,
            time: DhtTime::now().as_secs(),
            target_batch_size,
            rounds_ok,
            rounds_failed,
            last_group_size,
            reach,
            mode,
            name: name.to_owned(),
        };
        self.inner
            .report(metrics)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Stops publishing (at most `timeout` seconds, default 10) and withdraws the record.
    /// Idempotent.
    #[pyo3(signature = (timeout=None))]
    fn shutdown(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        if !self.owner.is_here() {
            return Ok(());
        }
        let limit = seconds("timeout", timeout.unwrap_or(10.0))?;
        let inner = self.inner.clone();
        runtime::block_on(py, async move { inner.shutdown(limit).await })?
            .map_err(|e| DHTError::new_err(e.to_string()))
    }
}

impl Drop for MetricsPublisher {
    fn drop(&mut self) {
        if !self.owner.is_here() {
            std::mem::forget(self.inner.clone());
        }
    }
}
