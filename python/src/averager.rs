//! `Averager`, `StepControl` and `TensorLock` for Python.
//!
//! The averager's tensors are the caller's own: a PyTorch tensor's or a numpy array's memory,
//! wrapped as [`Tensor::from_external`] after checking that it is a contiguous, writable CPU
//! buffer of a supported dtype. The wrapper keeps a reference to the Python object (and, for
//! PyTorch, to its storage), so the memory lives as long as the averager. The averager reads
//! and writes that memory only under its tensor lock; Python takes the same lock through
//! `TensorLock` (`DecentralizedAverager.get_tensors()`).
//!
//! With the `cuda` feature, PyTorch CUDA tensors are taken through DLPack (`__dlpack__` with
//! the tensor's current stream handed over): the averager holds the GPU memory itself and
//! orders its work on that stream, which must be the one the training loop uses (see
//! `hivemesh::cuda`); no lock is needed for them.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use hivemesh::allreduce::Mode;
use hivemesh::averager::{
    ApplyGate, AveragedTensor, Averager as RustAverager, AveragerConfig, AveragerError,
    KeySchedule, Stage, StepControl as RustStepControl, StepControlError, StepOptions, StepOutcome,
};
use hivemesh::compression::{Compression, CompressionType};
use hivemesh::dht::{Dht, DhtTime};
use hivemesh::tensor::{DType, MovableMemory, Tensor};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict, PyList};
use tokio::sync::watch;

use crate::node::Node;
use crate::runtime::{self, Owner};
use crate::{AveragingError, MatchmakingError, ShutdownError, StateError};

/// A duration from seconds given by the user.
fn seconds(what: &str, secs: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(secs).map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a non-negative number of seconds, not {secs}"
        ))
    })
}

fn codec(code: u32) -> PyResult<CompressionType> {
    CompressionType::from_code(code)
        .ok_or_else(|| PyValueError::new_err(format!("unknown compression type {code}")))
}

/// The `compression` argument: `(code, threshold, code_at_or_above)`, or a string
/// [`Compression`] parses (`"topk:<density>:<bits>:<chunk>"`, the sparse codec with error
/// feedback).
#[derive(FromPyObject)]
enum CompressionArg {
    Spec(String),
    Codes((u32, usize, u32)),
}

/// A shared tensor's memory, which Python may free or move (`storage.resize_(0)`, as FSDP
/// does, `tensor.resize_()`, `tensor.set_()`, numpy's `resize(refcheck=False)`): checked
/// before every access the averager makes ([`MovableMemory`]).
struct SharedMemory {
    /// The tensor or array.
    obj: Py<PyAny>,
    /// A PyTorch tensor's storage at the start (kept, so that it is not freed while the
    /// averager lives even if the tensor is given another one).
    storage: Option<Py<PyAny>>,
    shape: Vec<usize>,
}

impl SharedMemory {
    /// Whether `nbytes` bytes at `ptr` are still the object's elements, with its shape, in
    /// memory it holds: `Err` says what changed.
    fn check(&self, py: Python<'_>, ptr: usize, nbytes: usize) -> PyResult<Result<(), String>> {
        let obj = self.obj.bind(py);
        let (now, shape): (usize, Vec<usize>) = if self.storage.is_some() {
            if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
                return Ok(Err("the tensor is no longer contiguous".into()));
            }
            let storage = obj.call_method0("untyped_storage")?;
            let start: usize = storage.call_method0("data_ptr")?.extract()?;
            let len: usize = storage.call_method0("nbytes")?.extract()?;
            if len == 0 && nbytes > 0 {
                return Ok(Err("its storage was freed (storage.resize_(0)?)".into()));
            }
            let now: usize = obj.call_method0("data_ptr")?.extract()?;
            if now < start || now - start > len || len - (now - start) < nbytes {
                return Ok(Err(format!(
                    "its storage holds {len} bytes at {start:#x}, not the {nbytes} bytes at \
                     {now:#x} it is averaged over (storage.resize_()?)"
                )));
            }
            (now, obj.getattr("shape")?.extract()?)
        } else {
            let iface = obj.getattr("__array_interface__")?;
            let (now, _readonly): (usize, bool) = iface.get_item("data")?.extract()?;
            (now, iface.get_item("shape")?.extract()?)
        };
        if now != ptr {
            return Ok(Err(format!(
                "its data moved from {ptr:#x} to {now:#x} (resize_() or set_()?)"
            )));
        }
        if shape != self.shape {
            return Ok(Err(format!(
                "its shape changed from {:?} to {shape:?}",
                self.shape
            )));
        }
        Ok(Ok(()))
    }
}

impl MovableMemory for SharedMemory {
    /// Checks with the GIL held and runs `access` before releasing it: no Python code can free
    /// or move the memory between the check and the end of the access (a PyTorch operation
    /// that another thread had already entered, with the GIL released, is not excluded: that
    /// is what the tensor lock, `get_tensors()`, is for).
    fn pinned(
        &self,
        ptr: *const u8,
        nbytes: usize,
        access: &mut dyn FnMut(),
    ) -> Result<(), String> {
        Python::attach(|py| {
            self.check(py, ptr as usize, nbytes)
                .map_err(|e| format!("cannot check it: {e}"))??;
            access();
            Ok(())
        })
    }
}

/// Wraps a PyTorch tensor or numpy array's memory as a [`Tensor`] (a CUDA tensor as a device
/// tensor, with the `cuda` feature), after checking it.
fn shared_tensor(index: usize, obj: &Bound<'_, PyAny>) -> PyResult<AveragedTensor> {
    let bad = |why: String| PyTypeError::new_err(format!("averaged_tensors[{index}]: {why}"));
    let module: String = obj.get_type().getattr("__module__")?.extract()?;
    let (ptr, shape, dtype, storage) = if module.starts_with("torch") {
        let device: String = obj.getattr("device")?.getattr("type")?.extract()?;
        #[cfg(feature = "cuda")]
        if device == "cuda" {
            return crate::cuda::device_tensor(obj)
                .map(AveragedTensor::from)
                .map_err(|e| bad(e.to_string()));
        }
        if device != "cpu" {
            let how = if device == "cuda" {
                "this hivemesh was built without GPU support: rebuild it with \
                 MATURIN_PEP517_ARGS=\"--features cuda\" pip install ., or move the tensor \
                 with .cpu()"
            } else {
                "only CPU (and, in a build with the cuda feature, CUDA) tensors can be \
                 averaged; move it with .cpu()"
            };
            return Err(bad(format!("a {device} tensor; {how}")));
        }
        if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(bad(
                "not contiguous; pass tensor.contiguous() and keep that tensor".into(),
            ));
        }
        let dtype: String = obj.getattr("dtype")?.str()?.extract()?;
        let dtype = match dtype.as_str() {
            "torch.float32" => DType::F32,
            "torch.float16" => DType::F16,
            "torch.bfloat16" => DType::BF16,
            other => {
                return Err(bad(format!(
                    "dtype {other}; supported: float32, float16, bfloat16"
                )));
            }
        };
        let shape: Vec<usize> = obj.getattr("shape")?.extract()?;
        let ptr: usize = obj.call_method0("data_ptr")?.extract()?;
        let storage = obj.call_method0("untyped_storage")?;
        (ptr, shape, dtype, Some(storage.unbind()))
    } else if let Ok(iface) = obj.getattr("__array_interface__") {
        let iface = iface
            .cast_into::<PyDict>()
            .map_err(|_| bad("its __array_interface__ is not a dict".into()))?;
        let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
            iface
                .get_item(k)?
                .ok_or_else(|| bad(format!("__array_interface__ has no {k:?}")))
        };
        if !get("strides").map(|s| s.is_none()).unwrap_or(true) {
            return Err(bad(
                "not C-contiguous; pass numpy.ascontiguousarray(x) and keep that array".into(),
            ));
        }
        let (ptr, readonly): (usize, bool) = get("data")?.extract()?;
        if readonly {
            return Err(bad(
                "read-only; the averager writes the average into it".into()
            ));
        }
        let typestr: String = get("typestr")?.extract()?;
        let dtype = match typestr.as_str() {
            "<f4" => DType::F32,
            "<f2" => DType::F16,
            other => {
                return Err(bad(format!(
                    "dtype {other:?}; supported numpy dtypes: float32, float16"
                )));
            }
        };
        let shape: Vec<usize> = get("shape")?.extract()?;
        (ptr, shape, dtype, None)
    } else {
        return Err(bad(format!(
            "a {}; expected a torch.Tensor or a numpy.ndarray",
            obj.get_type().name()?
        )));
    };
    let memory = Arc::new(SharedMemory {
        obj: obj.clone().unbind(),
        storage,
        shape: shape.clone(),
    });
    // SAFETY: `ptr` is the first element of a live, contiguous, writable CPU buffer of
    // `shape` and `dtype` (checked above through the object's own interface). Python can
    // free or move it (resizing the storage or the tensor, `set_()`), so every access the
    // averager makes goes through `with_memory_checked`: `SharedMemory::pinned` checks, with
    // the GIL held, that the object still has its elements at `ptr`, inside its storage, and
    // keeps the GIL until the access ends. The averager touches the memory only under its
    // tensor lock, which Python takes through `TensorLock` to write the tensors.
    unsafe { Tensor::from_movable_external(&shape, dtype, ptr as *mut u8, memory) }
        .map(AveragedTensor::from)
        .map_err(|e| bad(e.to_string()))
}

fn averaging_error(e: AveragerError) -> PyErr {
    match e {
        AveragerError::Matchmaking(e) => MatchmakingError::new_err(e.to_string()),
        AveragerError::Timeout(t) => MatchmakingError::new_err(format!(
            "the step did not finish within its timeout of {t:?}"
        )),
        AveragerError::Cancelled => Python::attach(|py| {
            match py
                .import("concurrent.futures")
                .and_then(|m| m.getattr("CancelledError"))
                .and_then(|t| Ok(t.cast_into::<pyo3::types::PyType>()?))
            {
                Ok(t) => PyErr::from_type(t, "step cancelled"),
                Err(e) => e,
            }
        }),
        AveragerError::Shutdown => ShutdownError::new_err(e.to_string()),
        AveragerError::Config(m) => PyValueError::new_err(m),
        other => AveragingError::new_err(other.to_string()),
    }
}

/// A step's outcome as a dict for the Python layer.
fn outcome_dict<'py>(py: Python<'py>, o: &StepOutcome) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("group_id", PyBytes::new(py, &o.group_id))?;
    let members: Vec<String> = o.members.iter().map(ToString::to_string).collect();
    d.set_item("members", members)?;
    d.set_item("me", o.me)?;
    let gathered = PyList::empty(py);
    for g in &o.gathered {
        gathered.append(PyBytes::new(py, g))?;
    }
    d.set_item("gathered", gathered)?;
    d.set_item("mode", o.mode.to_string())?;
    d.set_item("reach", o.reach.name())?;
    let links: Vec<Option<String>> = o.links.iter().map(|l| l.map(|l| l.to_string())).collect();
    d.set_item("links", links)?;
    Ok(d)
}

/// A setter's outcome for Python: taken, too late (`False`), or a bad value.
fn taken(r: Result<(), StepControlError>) -> PyResult<bool> {
    match r {
        Ok(()) => Ok(true),
        Err(StepControlError::TooLate) => Ok(false),
        Err(e) => Err(PyValueError::new_err(e.to_string())),
    }
}

fn stage_name(s: Stage) -> &'static str {
    match s {
        Stage::Queued => "queued",
        Stage::Matchmaking => "matchmaking",
        Stage::AwaitingTrigger => "awaiting_trigger",
        Stage::AllReduce => "allreduce",
        Stage::Finished => "finished",
    }
}

/// An averager over tensors shared with Python. See `hivemesh.DecentralizedAverager`.
#[pyclass(module = "hivemesh._hivemesh")]
pub(crate) struct Averager {
    inner: Mutex<Option<Arc<RustAverager>>>,
    dht: Dht,
    config: AveragerConfig,
    owner: Owner,
}

impl Averager {
    fn gate(&self) -> PyResult<ApplyGate> {
        self.config
            .apply_gate
            .clone()
            .ok_or_else(|| PyValueError::new_err("this averager was made without _apply_gate"))
    }

    fn get(&self) -> PyResult<Arc<RustAverager>> {
        self.owner.check("averager")?;
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| ShutdownError::new_err("the averager has shut down"))
    }
}

#[pymethods]
impl Averager {
    /// Starts an averager on `node` over `tensors` (PyTorch CPU tensors or numpy arrays,
    /// shared, not copied). `compression` is `(code, threshold, code_at_or_above)`: one codec
    /// when `threshold` is 0, else hivemind's size-adaptive choice; or a string such as
    /// `"topk:0.02:2:2048"` (sparse top-k with error feedback). `mode`: `"node"`,
    /// `"client"`, `"aux"` or `None` (a client behind a NAT nobody can reach, else a node).
    #[new]
    #[pyo3(signature = (node, tensors, prefix, *, target_group_size=None, min_group_size=2, min_matchmaking_time=5.0, request_timeout=3.0, allreduce_timeout=None, sender_timeout=None, reducer_timeout=None, compression=CompressionArg::Codes((0, 0, 0)), part_size_bytes=None, mode=None, initial_group_bits=String::new(), allow_state_sharing=true, state_priority=0.0, allow_relayed_data=false, bandwidth=None, state_trusted_peers=None, state_min_agreeing=1, centered_clip_tau=None, adaptive_timeouts=None, _apply_gate=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        node: &Node,
        tensors: &Bound<'_, PyList>,
        prefix: String,
        target_group_size: Option<usize>,
        min_group_size: usize,
        min_matchmaking_time: f64,
        request_timeout: f64,
        allreduce_timeout: Option<f64>,
        sender_timeout: Option<f64>,
        reducer_timeout: Option<f64>,
        compression: CompressionArg,
        part_size_bytes: Option<usize>,
        mode: Option<String>,
        initial_group_bits: String,
        allow_state_sharing: bool,
        state_priority: f64,
        allow_relayed_data: bool,
        bandwidth: Option<f64>,
        state_trusted_peers: Option<Vec<String>>,
        state_min_agreeing: usize,
        centered_clip_tau: Option<f64>,
        adaptive_timeouts: Option<(f64, f64, f64)>,
        _apply_gate: bool,
    ) -> PyResult<Self> {
        let parts = node.parts()?;
        let shared: Vec<AveragedTensor> = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| shared_tensor(i, &t))
            .collect::<PyResult<_>>()?;
        let mut config = AveragerConfig::new(prefix);
        config.target_group_size = target_group_size;
        config.min_group_size = min_group_size;
        config.min_matchmaking_time = seconds("min_matchmaking_time", min_matchmaking_time)?;
        config.request_timeout = seconds("request_timeout", request_timeout)?;
        if let Some(t) = allreduce_timeout {
            config.round_timeout = seconds("allreduce_timeout", t)?;
        }
        if let Some(t) = sender_timeout {
            config.sender_timeout = seconds("sender_timeout", t)?;
        }
        if let Some(t) = reducer_timeout {
            config.reducer_timeout = seconds("reducer_timeout", t)?;
        }
        if let Some((min, max, factor)) = adaptive_timeouts {
            let bounds = hivemesh::allreduce::AdaptiveTimeouts {
                min: seconds("adaptive_timeouts' min", min)?,
                max: seconds("adaptive_timeouts' max", max)?,
                factor,
            };
            if !bounds.is_valid() {
                return Err(PyValueError::new_err(format!(
                    "adaptive_timeouts must be (min, max, factor) with 0 < min <= max and a \
                     finite factor >= 1, not ({min}, {max}, {factor})"
                )));
            }
            config.adaptive_timeouts = Some(bounds);
        }
        config.compression = match compression {
            CompressionArg::Spec(spec) => spec
                .parse()
                .map_err(|e| PyValueError::new_err(format!("compression {spec:?}: {e}")))?,
            CompressionArg::Codes((below, 0, _)) => Compression::Fixed(codec(below)?),
            CompressionArg::Codes((below, threshold, above)) => Compression::Adaptive {
                threshold,
                below: codec(below)?,
                at_or_above: codec(above)?,
            },
        };
        if let Some(p) = part_size_bytes {
            config.part_size_bytes = p;
        }
        config.mode = mode
            .map(|m| {
                m.parse::<Mode>()
                    .map_err(|e| PyValueError::new_err(format!("mode {m:?}: {e}")))
            })
            .transpose()?;
        config.keys = KeySchedule::Bits {
            initial_bits: initial_group_bits,
        };
        config.allow_state_sharing = allow_state_sharing;
        if !state_priority.is_finite() {
            return Err(PyValueError::new_err(format!(
                "state_sharing_priority must be finite, not {state_priority}"
            )));
        }
        config.state_priority = state_priority;
        config.allow_relayed_data = allow_relayed_data;
        config.bandwidth = bandwidth;
        if let Some(tau) = centered_clip_tau {
            let clip = hivemesh::allreduce::CenteredClip::new(tau);
            if !clip.is_valid() {
                return Err(PyValueError::new_err(format!(
                    "centered_clip_tau must be positive, not {tau}"
                )));
            }
            config.aggregator = hivemesh::allreduce::Aggregator::CenteredClip(clip);
        }
        if state_min_agreeing == 0 {
            return Err(PyValueError::new_err(
                "state_min_agreeing must be at least 1",
            ));
        }
        config.state.trust.min_agreeing = state_min_agreeing;
        config.state.trust.allow = state_trusted_peers
            .map(|peers| {
                peers
                    .iter()
                    .map(|p| {
                        p.parse::<libp2p::PeerId>().map_err(|e| {
                            PyValueError::new_err(format!("state_trusted_peers: {p:?}: {e}"))
                        })
                    })
                    .collect::<PyResult<_>>()
            })
            .transpose()?;
        // Test hook: steps stop before applying their result (`_apply_gate_reached`).
        config.apply_gate = _apply_gate.then(ApplyGate::default);
        let dht = parts.dht.clone();
        let cfg = config.clone();
        // `start` spawns the averager's tasks: it runs on the runtime.
        let rt = runtime::handle()?;
        let averager = {
            let _entered = rt.enter();
            RustAverager::start(parts.dht, parts.hub, shared, cfg).map_err(averaging_error)?
        };
        Ok(Self {
            inner: Mutex::new(Some(Arc::new(averager))),
            dht,
            config,
            owner: Owner::here(),
        })
    }

    /// `"node"`, `"client"` or `"aux"`: how this averager takes part now (with `mode=None`,
    /// from the node's reachability).
    #[getter]
    fn mode(&self) -> String {
        let reach = self.dht.p2p().reachability().class();
        self.config.resolved_mode(reach).to_string()
    }

    /// Test hook (with `_apply_gate=True`): waits, GIL released, at most `timeout` seconds for
    /// a step to stop before applying its result; returns whether one did.
    fn _apply_gate_reached(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let gate = self.gate()?;
        let reached = runtime::wait(
            py,
            async move { gate.reached.notified().await },
            runtime::OnInterrupt::<fn()>::Abort,
            Some(seconds("timeout", timeout)?),
        )?;
        Ok(reached.is_some())
    }

    /// Test hook (with `_apply_gate=True`): lets the step stopped before its apply go on.
    fn _apply_gate_release(&self) -> PyResult<()> {
        self.gate()?.release.notify_one();
        Ok(())
    }

    /// Schedules a step; returns its `StepControl` at once.
    #[pyo3(signature = (*, weight=1.0, gather=None, timeout=None, allow_retries=true, require_trigger=false, scheduled_in=None))]
    #[allow(clippy::too_many_arguments)]
    fn schedule_step(
        &self,
        py: Python<'_>,
        weight: f64,
        gather: Option<PyBackedBytes>,
        timeout: Option<f64>,
        allow_retries: bool,
        require_trigger: bool,
        scheduled_in: Option<f64>,
    ) -> PyResult<StepControl> {
        if !(weight.is_finite() && weight >= 0.0) {
            return Err(PyValueError::new_err(format!(
                "weight must be a finite non-negative number, not {weight}"
            )));
        }
        let options = StepOptions {
            weight,
            gather: gather.map_or_else(Bytes::new, |g| Bytes::copy_from_slice(&g)),
            timeout: timeout.map(|t| seconds("timeout", t)).transpose()?,
            allow_retries,
            wait_for_trigger: require_trigger,
            scheduled_in: scheduled_in
                .map(|t| seconds("scheduled_time", t))
                .transpose()?,
            round: None,
        };
        let averager = self.get()?;
        let mut control =
            runtime::block_on(py, async move { averager.schedule_step(options).await })?
                .map_err(averaging_error)?;
        let result = control.take_result();
        let slot: Arc<Mutex<Option<Result<StepOutcome, AveragerError>>>> = Arc::default();
        let (done_tx, done) = watch::channel(false);
        let fill = slot.clone();
        runtime::handle()?.spawn(async move {
            let r = result.await;
            *fill.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            let _ = done_tx.send(true);
        });
        Ok(StepControl {
            control: Mutex::new(control),
            done,
            result: slot,
        })
    }

    /// Takes the tensor lock (waiting with the GIL released): the averager neither reads
    /// nor writes the tensors until `TensorLock.release()`.
    fn lock(&self, py: Python<'_>) -> PyResult<TensorLock> {
        let averager = self.get()?;
        let (held_tx, held_rx) = std::sync::mpsc::sync_channel::<()>(1);
        let (release_tx, release_rx) = std::sync::mpsc::sync_channel::<()>(1);
        let thread = std::thread::Builder::new()
            .name("hivemesh-lock".into())
            .spawn(move || {
                // Python writes the tensors while it holds the lock: a change.
                let mut guard = averager.tensors();
                let _changed: &mut Vec<_> = &mut guard;
                let _ = held_tx.send(());
                // Held until released (or the TensorLock is dropped: the sender goes away).
                let _ = release_rx.recv();
            })
            .map_err(|e| ShutdownError::new_err(format!("cannot start a lock thread: {e}")))?;
        py.detach(move || held_rx.recv())
            .map_err(|_| ShutdownError::new_err("the tensor lock could not be taken"))?;
        Ok(TensorLock {
            release: Mutex::new(Some((release_tx, thread))),
        })
    }

    /// Downloads the state from peers without installing it: `None` when no donor is
    /// available, else `(metadata, [(dtype, shape, raw little-endian bytes)])`.
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (timeout=None))]
    fn download_state<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<
        Option<(
            Bound<'py, PyBytes>,
            Vec<(String, Vec<usize>, Bound<'py, PyBytes>)>,
        )>,
    > {
        let averager = self.get()?;
        let timeout = timeout.map(|t| seconds("timeout", t)).transpose()?;
        // The download is dropped when `timeout` passes (or on Ctrl-C), which closes its
        // streams and frees the donors' sessions.
        let got = runtime::block_on(py, async move {
            let download = averager.download_state_from_peers();
            match timeout {
                Some(t) => tokio::time::timeout(t, download).await.ok(),
                None => Some(download.await),
            }
        })?;
        let Some(got) = got else {
            return Ok(None);
        };
        let got = got.map_err(|e| StateError::new_err(e.to_string()))?;
        Ok(got.map(|(state, tensors)| {
            let tensors = tensors
                .iter()
                .map(|t| {
                    (
                        t.dtype().name().to_owned(),
                        t.shape().to_vec(),
                        PyBytes::new(py, t.flat().as_bytes()),
                    )
                })
                .collect();
            (PyBytes::new(py, &state.metadata), tensors)
        }))
    }

    /// The metadata served with the state (bytes).
    #[getter]
    fn get_state_metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &self.get()?.state_metadata()))
    }

    /// Sets the metadata served with the state.
    #[setter]
    fn set_state_metadata(&self, metadata: PyBackedBytes) -> PyResult<()> {
        self.get()?
            .set_state_metadata(Bytes::copy_from_slice(&metadata))
            .map_err(|e| StateError::new_err(e.to_string()))
    }

    /// Serves what `provider()` returns to newcomers instead of the tensors and metadata
    /// (`None`: those again). `provider` is called with the GIL, on a blocking thread, bounded
    /// by the state request timeout, and returns `(metadata: bytes, [(dtype, shape, raw
    /// little-endian bytes)])` with dtype `"float32"`, `"float16"` or `"bfloat16"`.
    #[pyo3(signature = (provider))]
    fn set_state_provider(&self, provider: Option<Py<PyAny>>) -> PyResult<()> {
        let provider = provider.map(|callback| {
            Arc::new(PyStateProvider { callback })
                as Arc<dyn hivemesh::averager::state::StateProvider>
        });
        self.get()?.set_state_provider(provider);
        Ok(())
    }

    /// With sparse compression, the error feedback residuals (per tensor, flattened): what
    /// this peer has not sent yet; `None` with any other compression.
    fn error_feedback_residuals(&self) -> PyResult<Option<Vec<Vec<f32>>>> {
        Ok(self.get()?.residuals())
    }

    /// The group bits the next step looks under.
    fn group_bits(&self) -> PyResult<String> {
        Ok(self.get()?.group_bits().unwrap_or_default())
    }

    /// Replaces the group bits (`0`s and `1`s).
    fn set_group_bits(&self, bits: &str) -> PyResult<()> {
        self.get()?.set_group_bits(bits).map_err(averaging_error)
    }

    /// Whether the state is served to newcomers.
    fn allow_state_sharing(&self) -> PyResult<bool> {
        Ok(self.get()?.allow_state_sharing())
    }

    /// Switches serving the state on or off (returns once announced).
    fn set_allow_state_sharing(&self, py: Python<'_>, allow: bool) -> PyResult<()> {
        let averager = self.get()?;
        runtime::block_on(
            py,
            async move { averager.set_allow_state_sharing(allow).await },
        )?
        .map_err(|e| StateError::new_err(e.to_string()))
    }

    /// The donor priority announced to newcomers.
    fn state_priority(&self) -> PyResult<f64> {
        Ok(self.get()?.state_priority())
    }

    /// Sets the donor priority (returns once announced).
    fn set_state_priority(&self, py: Python<'_>, priority: f64) -> PyResult<()> {
        let averager = self.get()?;
        runtime::block_on(
            py,
            async move { averager.set_state_priority(priority).await },
        )?
        .map_err(|e| StateError::new_err(e.to_string()))
    }

    /// Stops the averager (a step in flight ends with `ShutdownError`). Idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        if !self.owner.is_here() {
            return Ok(());
        }
        let taken = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(averager) = taken {
            match Arc::try_unwrap(averager) {
                Ok(averager) => runtime::block_on(py, averager.shutdown())?,
                // A lock thread still holds it: it stops when that lock is released.
                Err(shared) => drop(shared),
            }
        }
        Ok(())
    }
}

impl Drop for Averager {
    fn drop(&mut self) {
        let taken = self
            .inner
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(averager) = taken {
            if self.owner.is_here() {
                if let (Ok(rt), Ok(averager)) = (runtime::handle(), Arc::try_unwrap(averager)) {
                    rt.spawn(averager.shutdown());
                }
            } else {
                std::mem::forget(averager);
            }
        }
    }
}

/// A donor's state from a Python callable (`DecentralizedAverager.get_current_state`).
struct PyStateProvider {
    callback: Py<PyAny>,
}

impl hivemesh::averager::state::StateProvider for PyStateProvider {
    fn current_state(&self) -> Result<hivemesh::averager::state::ProvidedState, String> {
        Python::attach(|py| {
            let got = self.callback.call0(py).map_err(|e| {
                // The traceback, where a user looks for it.
                e.print(py);
                format!("get_current_state() raised {e}")
            })?;
            #[allow(clippy::type_complexity)]
            let (metadata, tensors): (
                PyBackedBytes,
                Vec<(String, Vec<usize>, PyBackedBytes)>,
            ) = got
                .extract(py)
                .map_err(|e| format!("get_current_state(): {e}"))?;
            let tensors = tensors
                .into_iter()
                .enumerate()
                .map(|(i, (dtype, shape, data))| {
                    raw_tensor(&dtype, &shape, &data)
                        .map_err(|e| format!("get_current_state() tensor {i}: {e}"))
                })
                .collect::<Result<_, _>>()?;
            Ok(hivemesh::averager::state::ProvidedState {
                metadata: Bytes::copy_from_slice(&metadata),
                tensors,
            })
        })
    }
}

/// A tensor of `dtype` (its name) and `shape` from its raw little-endian bytes.
fn raw_tensor(dtype: &str, shape: &[usize], data: &[u8]) -> Result<Tensor, String> {
    let dtype = DType::from_name(dtype)
        .ok_or_else(|| format!("dtype {dtype:?}; supported: float32, float16, bfloat16"))?;
    Tensor::from_le_bytes(shape, dtype, data).map_err(|e| e.to_string())
}

/// A scheduled step. See `hivemesh.StepControl`.
#[pyclass(module = "hivemesh._hivemesh")]
pub(crate) struct StepControl {
    control: Mutex<RustStepControl>,
    done: watch::Receiver<bool>,
    result: Arc<Mutex<Option<Result<StepOutcome, AveragerError>>>>,
}

#[pymethods]
impl StepControl {
    /// Lets the all-reduce begin once the group is assembled.
    fn trigger(&self) {
        self.control
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .trigger();
    }

    /// Cancels the step in whatever stage it is; the tensors are left unchanged unless the
    /// step had already finished.
    fn cancel(&self) {
        self.control
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .cancel();
    }

    /// The step's weight (the one its all-reduce used, once it began).
    #[getter]
    fn weight(&self) -> f64 {
        self.control
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .weight()
    }

    /// Sets the step's weight; returns `False` (and changes nothing) once the all-reduce has
    /// begun. A weight that is not 0 or a finite positive number is a `ValueError`.
    fn set_weight(&self, weight: f64) -> PyResult<bool> {
        let control = self.control.lock().unwrap_or_else(|e| e.into_inner());
        taken(control.set_weight(weight))
    }

    /// When the all-reduce should begin at the earliest (DHT time), or `None`.
    #[getter]
    fn scheduled_time(&self) -> Option<f64> {
        self.control
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .scheduled_time()
            .map(DhtTime::as_secs)
    }

    /// Sets when the all-reduce should begin at the earliest (DHT time); returns `False` (and
    /// changes nothing) once the all-reduce has begun.
    fn set_scheduled_time(&self, scheduled_time: f64) -> PyResult<bool> {
        let at = DhtTime::from_secs(scheduled_time).ok_or_else(|| {
            PyValueError::new_err(format!(
                "scheduled_time must be finite, not {scheduled_time}"
            ))
        })?;
        let control = self.control.lock().unwrap_or_else(|e| e.into_inner());
        taken(control.set_scheduled_time(at))
    }

    /// Whether the weight and scheduled time are final (the all-reduce began, or the step
    /// ended before it).
    #[getter]
    fn params_final(&self) -> bool {
        !self
            .control
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .accepts_changes()
    }

    /// `"queued"`, `"matchmaking"`, `"awaiting_trigger"`, `"allreduce"` or `"finished"`.
    #[getter]
    fn stage(&self) -> &'static str {
        if *self.done.borrow() {
            return "finished";
        }
        stage_name(
            self.control
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .stage(),
        )
    }

    /// Whether the step has finished.
    fn done(&self) -> bool {
        *self.done.borrow()
    }

    /// Waits (GIL released) until the step finishes or `timeout` seconds pass; returns
    /// whether it finished. Ctrl-C cancels the step, waits for it to end and raises
    /// `KeyboardInterrupt`.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let timeout = timeout.map(|t| seconds("timeout", t)).transpose()?;
        // Finished: true at once, whatever the timeout (a wait of 0 s would otherwise race the
        // waiting task's first poll and could say "not finished" of a finished step).
        if *self.done.borrow() {
            return Ok(true);
        }
        let mut done = self.done.clone();
        let finished = runtime::wait(
            py,
            async move {
                let _ = done.wait_for(|d| *d).await;
            },
            runtime::OnInterrupt::Finish(|| self.cancel()),
            timeout,
        )?;
        Ok(finished.is_some())
    }

    /// The outcome (a dict) once finished; raises the step's error. Call after `wait`.
    fn outcome<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let slot = self.result.lock().unwrap_or_else(|e| e.into_inner());
        match slot.as_ref() {
            None => Err(PyValueError::new_err("the step has not finished")),
            Some(Ok(o)) => outcome_dict(py, o),
            Some(Err(e)) => Err(averaging_error(e.clone())),
        }
    }
}

/// The averager's tensor lock, held by a thread of its own until `release()`.
#[pyclass(module = "hivemesh._hivemesh")]
pub(crate) struct TensorLock {
    release: Mutex<Option<(std::sync::mpsc::SyncSender<()>, std::thread::JoinHandle<()>)>>,
}

#[pymethods]
impl TensorLock {
    /// Releases the lock (idempotent).
    fn release(&self, py: Python<'_>) {
        let taken = self
            .release
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some((tx, thread)) = taken {
            let _ = tx.send(());
            py.detach(|| {
                let _ = thread.join();
            });
        }
    }
}
