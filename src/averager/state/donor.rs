//! The donor side of state sharing (see the [parent module](super)): serving inbound state
//! streams, opening sessions, building and reusing snapshots, answering chunk requests.

use super::*;

pub(super) async fn serve(inner: Arc<Inner>, inbound: InboundStreams) {
    let shares = Shares::new(inner.config.max_inbound, inner.config.max_inbound_per_peer);
    inbound
        .serve_each(shares, "state", |peer, stream| {
            let inner = inner.clone();
            Some(async move {
                if let Err(e) = serve_stream(&inner, peer, stream).await {
                    tracing::debug!(%peer, error = %e, "state stream closed");
                }
            })
        })
        .await;
}

pub(super) async fn serve_stream(
    inner: &Arc<Inner>,
    peer: PeerId,
    mut stream: P2pStream,
) -> Result<(), WireError> {
    let idle = inner.config.session_idle_timeout;
    let write_timeout = inner.config.request_timeout;
    loop {
        let read = wire::read_frame(&mut stream, wire::MAX_REQUEST_BYTES);
        let body = match tokio::time::timeout(idle, read).await {
            Err(_) | Ok(Ok(None)) => return Ok(()),
            Ok(Ok(Some(body))) => body,
            Ok(Err(e)) => return Err(e),
        };
        let response = match wire::decode_request(body)? {
            Request::Metadata => open_session(inner, peer).await,
            Request::Chunk { session, index } => chunk(inner, peer, &session, index),
            Request::Release { session } => {
                lock(&inner.sessions).release(peer, &session);
                continue;
            }
        };
        let body = wire::encode_response(&response);
        tokio::time::timeout(write_timeout, wire::write_frame(&mut stream, &body))
            .await
            .map_err(|_| WireError::Io(format!("answer not written within {write_timeout:?}")))??;
    }
}

pub(super) async fn open_session(inner: &Arc<Inner>, peer: PeerId) -> Response {
    if !inner.sharing() {
        lock(&inner.sessions).clear();
        return Response::Refused(Refusal::NotSharing);
    }
    if !lock(&inner.sessions).has_room(peer, Instant::now()) {
        return Response::Refused(Refusal::Busy);
    }
    let built = {
        let _one_at_a_time = inner.building.lock().await;
        match inner.current_snapshot(Instant::now()) {
            Some(snapshot) => Some(snapshot),
            None => {
                let provider = lock(&inner.provider).clone();
                match provider {
                    None => {
                        let builder = inner.clone();
                        tokio::task::spawn_blocking(move || {
                            let started = Instant::now();
                            let (version, external, snapshot) = build_snapshot(&builder)?;
                            Some(cache(&builder, version, external, false, started, snapshot))
                        })
                        .await
                        .ok()
                        .flatten()
                    }
                    Some(provider) => provided_snapshot(inner, provider).await,
                }
            }
        }
    };
    let Some(snapshot) = built else {
        return Response::Refused(Refusal::Busy);
    };
    if !inner.sharing() {
        return Response::Refused(Refusal::NotSharing);
    }
    let mut sessions = lock(&inner.sessions);
    // Sessions of the same state share one copy.
    let snapshot = sessions
        .same_state(&snapshot.meta.content_hash)
        .unwrap_or(snapshot);
    let id = Bytes::copy_from_slice(&rand::rng().random::<[u8; 16]>());
    let mut meta = snapshot.meta.clone();
    meta.session = id.clone();
    match sessions.open(peer, id, snapshot, Instant::now()) {
        Ok(()) => Response::Metadata(meta),
        Err(refusal) => Response::Refused(refusal),
    }
}

/// Keeps `snapshot` (whose building began at `started`) as the donor's last one and counts
/// it.
fn cache(
    inner: &Inner,
    version: u64,
    external: bool,
    provided: bool,
    started: Instant,
    snapshot: Snapshot,
) -> Arc<Snapshot> {
    let snapshot = Arc::new(snapshot);
    inner.snapshots_built.fetch_add(1, Ordering::SeqCst);
    let built = Instant::now();
    *lock(&inner.last_snapshot) = Some(CachedSnapshot {
        version,
        external,
        provided,
        built,
        cost: built - started,
        snapshot: snapshot.clone(),
    });
    snapshot
}

/// Clears the "a provider call is running" flag when the call ends, however it ends.
struct Providing<'a>(&'a AtomicBool);

impl Drop for Providing<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// A snapshot of what `provider` returns, built on a blocking thread under the request
/// timeout; `None` (the newcomer is refused as busy) if a call is still running, the provider
/// fails or is late, or its state breaks the wire's limits.
async fn provided_snapshot(
    inner: &Arc<Inner>,
    provider: Arc<dyn StateProvider>,
) -> Option<Arc<Snapshot>> {
    if inner.providing.swap(true, Ordering::SeqCst) {
        tracing::debug!("the state provider is still busy with an earlier call");
        return None;
    }
    let builder = inner.clone();
    let call = tokio::task::spawn_blocking(move || {
        let _providing = Providing(&builder.providing);
        let started = Instant::now();
        // Read before the call: a change made meanwhile makes the next request rebuild.
        let version = builder.shared.version.load(Ordering::SeqCst);
        let state = provider.current_state()?;
        check_provided(&state)?;
        let mut data = Vec::with_capacity(state.tensors.iter().map(Tensor::size_bytes).sum());
        for t in &state.tensors {
            data.extend_from_slice(t.flat().as_bytes());
        }
        let tensors = state.tensors.iter().map(TensorDescriptor::of).collect();
        let snapshot = snapshot_of(&builder, data, tensors, state.metadata);
        Ok::<_, String>(cache(&builder, version, true, true, started, snapshot))
    });
    let timeout = inner.config.request_timeout;
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(Ok(snapshot))) => Some(snapshot),
        Ok(Ok(Err(e))) => {
            tracing::warn!(error = %e, "the state provider failed; newcomers are refused");
            None
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "the state provider panicked; newcomers are refused");
            None
        }
        Err(_) => {
            tracing::warn!(?timeout, "the state provider did not answer in time");
            None
        }
    }
}

/// Whether a provided state fits what a newcomer accepts.
fn check_provided(state: &ProvidedState) -> Result<(), String> {
    if state.metadata.len() > wire::MAX_METADATA_BYTES {
        return Err(format!(
            "metadata of {} bytes (at most {})",
            state.metadata.len(),
            wire::MAX_METADATA_BYTES
        ));
    }
    if state.tensors.len() > wire::MAX_TENSORS {
        return Err(format!(
            "{} tensors (at most {})",
            state.tensors.len(),
            wire::MAX_TENSORS
        ));
    }
    if let Some(t) = state
        .tensors
        .iter()
        .find(|t| t.shape().len() > wire::MAX_DIMS)
    {
        return Err(format!(
            "a tensor of {} dimensions (at most {})",
            t.shape().len(),
            wire::MAX_DIMS
        ));
    }
    Ok(())
}

/// A snapshot of the tensors and metadata, the tensors' version it was taken at, and whether
/// any tensor is [external](Tensor::External). Only the copy runs under the tensor lock; the
/// hashes after it. `None` (logged) when a shared tensor's memory moved
/// ([`crate::tensor::MovableMemory`]): nothing is served then.
pub(super) fn build_snapshot(inner: &Inner) -> Option<(u64, bool, Snapshot)> {
    let (version, external, data, tensors) = {
        let mut tensors = lock(&inner.shared.tensors);
        // Read under the lock: every change through a guard counted before it was taken.
        let version = inner.shared.version.load(Ordering::SeqCst);
        let external = tensors.iter().any(|t| matches!(t, Tensor::External(_)));
        let total = tensors.iter().map(Tensor::size_bytes).sum();
        let data = crate::tensor::with_memory_checked(&mut tensors, |tensors| {
            let mut data = Vec::with_capacity(total);
            for t in tensors.iter() {
                data.extend_from_slice(t.flat().as_bytes());
            }
            data
        });
        let data = match data {
            Ok(data) => data,
            Err(e) => {
                tracing::warn!(error = %e, "not serving the state");
                return None;
            }
        };
        let descriptors: Vec<TensorDescriptor> = tensors.iter().map(TensorDescriptor::of).collect();
        (version, external, data, descriptors)
    };
    let metadata = lock(&inner.metadata).clone();
    Some((
        version,
        external,
        snapshot_of(inner, data, tensors, metadata),
    ))
}

/// The served form of a state: its data, chunk hashes and description.
fn snapshot_of(
    inner: &Inner,
    data: Vec<u8>,
    tensors: Vec<TensorDescriptor>,
    metadata: Bytes,
) -> Snapshot {
    let chunk_bytes =
        (inner.config.chunk_bytes as u64).clamp(wire::MIN_CHUNK_BYTES, wire::MAX_CHUNK_BYTES);
    let mut hashes =
        Vec::with_capacity(data.len().div_ceil(chunk_bytes as usize) * wire::HASH_BYTES);
    for c in data.chunks(chunk_bytes as usize) {
        hashes.extend_from_slice(&wire::chunk_hash(c));
    }
    let total_bytes = data.len() as u64;
    let content_hash = wire::content_hash(
        &inner.schema_hash,
        &tensors,
        total_bytes,
        chunk_bytes,
        &hashes,
        &metadata,
    );
    Snapshot {
        data: data.into(),
        meta: Metadata {
            session: Bytes::new(),
            schema_hash: inner.schema_hash.clone(),
            tensors,
            total_bytes,
            chunk_bytes,
            chunk_hashes: hashes.into(),
            content_hash,
            metadata,
        },
    }
}

pub(super) fn chunk(inner: &Inner, peer: PeerId, session: &Bytes, index: u64) -> Response {
    if !inner.sharing() {
        lock(&inner.sessions).clear();
        return Response::Refused(Refusal::NotSharing);
    }
    let served = lock(&inner.sessions).serve(
        peer,
        session,
        |s| s.meta.chunk_range(index).map(|r| r.end - r.start),
        Instant::now(),
    );
    let snapshot = match served {
        Ok(snapshot) => snapshot,
        Err(refusal) => return Response::Refused(refusal),
    };
    match snapshot.meta.chunk_range(index) {
        Some(range) => Response::Chunk {
            index,
            data: snapshot
                .data
                .slice(range.start as usize..range.end as usize),
        },
        None => Response::Refused(Refusal::BadRequest),
    }
}
