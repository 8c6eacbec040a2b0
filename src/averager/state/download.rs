//! The newcomer side of state sharing (see the [parent module](super)): probing donors for
//! metadata, choosing the reference, downloading chunks in parallel from every donor that
//! serves the same content, checking them, and installing the state.

use super::*;

/// What the newcomer's state looks like (a donor's must match).
pub(super) struct Expected {
    schema_hash: Bytes,
    /// The tensors' shapes and dtypes, when the state is to be installed into them (a state
    /// only fetched may hold any tensors: a donor's [`StateProvider`] decides).
    tensors: Option<Vec<TensorDescriptor>>,
}

/// A donor that described a usable state.
pub(super) struct Probed {
    donor: Donor,
    meta: Metadata,
    stream: Option<P2pStream>,
}

/// One request and its answer on `stream`, under `timeout`.
pub(super) async fn exchange(
    stream: &mut P2pStream,
    request: &Request,
    timeout: Duration,
    max_answer: usize,
) -> Result<Response, DonorError> {
    let body = wire::encode_request(request);
    let exchange = async {
        wire::write_frame(stream, &body).await?;
        match wire::read_frame(stream, max_answer).await? {
            Some(answer) => wire::decode_response(answer),
            None => Err(WireError::Truncated),
        }
    };
    match tokio::time::timeout(timeout, exchange).await {
        Err(_) => Err(DonorError::Timeout(timeout)),
        Ok(Ok(response)) => Ok(response),
        Ok(Err(WireError::Io(e))) => Err(DonorError::Io(e)),
        Ok(Err(WireError::Truncated)) => {
            Err(DonorError::Io("stream closed before the answer".into()))
        }
        Ok(Err(e)) => Err(DonorError::Protocol(e)),
    }
}

/// Writes a release for each session, best effort, in the background (bounded by `timeout`).
pub(super) fn release(sessions: Vec<(P2pStream, Bytes)>, timeout: Duration) {
    if sessions.is_empty() {
        return;
    }
    tokio::spawn(async move {
        let releases = sessions
            .into_iter()
            .map(|(mut stream, session)| async move {
                let body = wire::encode_request(&Request::Release { session });
                let _ = tokio::time::timeout(timeout, async {
                    let _ = wire::write_frame(&mut stream, &body).await;
                    let _ = tokio::io::AsyncWriteExt::shutdown(&mut stream).await;
                })
                .await;
            });
        futures::future::join_all(releases).await;
    });
}

/// Fetches and verifies chunk `index` (opening a stream if `stream` is `None`); gives the
/// stream back for the next chunk.
#[allow(clippy::too_many_arguments)]
pub(super) async fn fetch(
    p2p: P2p,
    peer: PeerId,
    protocol: Arc<str>,
    stream: Option<P2pStream>,
    session: Bytes,
    index: u64,
    len: usize,
    hash: [u8; wire::HASH_BYTES],
    timeout: Duration,
) -> Result<(P2pStream, Bytes), DonorError> {
    let mut stream = match stream {
        Some(s) => s,
        None => p2p
            .open_stream(peer, &protocol, timeout)
            .await
            .map_err(DonorError::Open)?,
    };
    // The chunk plus its envelope (tags and varints: well under 64 bytes).
    let max_answer = len + 64;
    let corrupt = |reason: String| DonorError::CorruptChunk { index, reason };
    match exchange(
        &mut stream,
        &Request::Chunk { session, index },
        timeout,
        max_answer,
    )
    .await?
    {
        Response::Chunk { index: got, data } => {
            if got != index {
                return Err(corrupt(format!("answered with chunk {got}")));
            }
            if data.len() != len {
                return Err(corrupt(format!("{} bytes, expected {len}", data.len())));
            }
            if wire::chunk_hash(&data) != hash {
                return Err(corrupt("SHA-256 mismatch".to_owned()));
            }
            Ok((stream, data))
        }
        Response::Refused(r) => Err(DonorError::Refused(r)),
        Response::Metadata(_) => Err(DonorError::Unexpected("metadata answering a chunk request")),
    }
}

/// A download stream's slot.
pub(super) struct Slot {
    donor: usize,
    stream: Option<P2pStream>,
    busy: bool,
    failures: usize,
    retired: bool,
}

/// Per-donor progress of a download.
pub(super) struct Progress {
    probed: Probed,
    alive: bool,
    chunks: u64,
    bytes: u64,
    failure: Option<DonorError>,
}

/// A completed download.
/// What a load produced: the state, and its tensors when they were not installed.
pub(super) struct Loaded {
    pub(super) state: LoadedState,
    pub(super) tensors: Option<Vec<Tensor>>,
}

pub(super) struct Downloaded {
    data: Vec<u8>,
    meta: Metadata,
    reports: Vec<DonorReport>,
    failures: Vec<(PeerId, DonorError)>,
    idle: Vec<(P2pStream, Bytes)>,
}

impl Inner {
    pub(super) async fn load(&self, install: bool) -> Result<Option<Loaded>, StateError> {
        let expected = {
            let tensors = lock(&self.shared.tensors);
            Expected {
                schema_hash: self.schema_hash.clone(),
                tensors: install.then(|| tensors.iter().map(TensorDescriptor::of).collect()),
            }
        };
        let mut candidates = self.donors().await?.into_iter();
        let mut failures: Vec<(PeerId, DonorError)> = Vec::new();
        let mut answered: Vec<Probed> = Vec::new();
        let mut downloaded = false;
        let trust = &self.config.trust;
        loop {
            // The first content hash (in priority order) that enough donors serve; with the
            // default trust, the best-priority answer's.
            let Some(reference) = trust
                .agreed(answered.iter().map(|p| &p.meta.content_hash))
                .copied()
            else {
                let batch: Vec<Donor> = candidates
                    .by_ref()
                    .take(self.config.max_donors.max(1))
                    .collect();
                if batch.is_empty() {
                    // Nothing agreed on, and nobody left to ask.
                    let required = trust.min_agreeing;
                    let hashes: Vec<_> = answered.iter().map(|p| p.meta.content_hash).collect();
                    let mut idle = Vec::new();
                    for p in std::mem::take(&mut answered) {
                        let agreeing = hashes.iter().filter(|h| **h == p.meta.content_hash).count();
                        failures
                            .push((p.donor.peer, DonorError::Unconfirmed { agreeing, required }));
                        if let Some(stream) = p.stream {
                            idle.push((stream, p.meta.session));
                        }
                    }
                    release(idle, self.config.request_timeout);
                    break;
                }
                let probes = batch.iter().map(|d| self.probe(d, &expected));
                for (donor, result) in batch.iter().zip(futures::future::join_all(probes).await) {
                    match result {
                        Ok(p) => answered.push(p),
                        Err(e) => failures.push((donor.peer, e)),
                    }
                }
                continue;
            };
            // Every answer with the reference's content hash serves the same bytes.
            let (group, rest): (Vec<Probed>, Vec<Probed>) = answered
                .into_iter()
                .partition(|p| p.meta.content_hash == reference);
            answered = rest;
            downloaded = true;
            match self.download(group).await {
                Ok(done) if !trust::all_finite(&done.data, &done.meta.tensors) => {
                    // Verified bytes, but not a state anyone should install: skip its donors
                    // and try the next content hash.
                    let mut done = done;
                    failures.append(&mut done.failures);
                    failures.extend(done.reports.iter().map(|r| (r.peer, DonorError::NonFinite)));
                    release(std::mem::take(&mut done.idle), self.config.request_timeout);
                }
                Ok(mut done) => {
                    failures.append(&mut done.failures);
                    let mut idle = std::mem::take(&mut done.idle);
                    idle.extend(
                        answered
                            .into_iter()
                            .filter_map(|p| Some((p.stream?, p.meta.session))),
                    );
                    release(idle, self.config.request_timeout);
                    return if install {
                        self.install(done, failures).map(|s| {
                            s.map(|state| Loaded {
                                state,
                                tensors: None,
                            })
                        })
                    } else {
                        Ok(Some(self.unpack(done, failures)))
                    };
                }
                Err(group_failures) => failures.extend(group_failures),
            }
        }
        if downloaded {
            return Err(StateError::DownloadFailed { failures });
        }
        let unusable: Vec<&(PeerId, DonorError)> = failures
            .iter()
            .filter(|(_, e)| !e.is_unavailable())
            .collect();
        if unusable.is_empty() {
            if !failures.is_empty() {
                tracing::debug!(failures = %summary(&failures), "no state donor available");
            }
            return Ok(None);
        }
        if unusable
            .iter()
            .all(|(_, e)| matches!(e, DonorError::SchemaMismatch))
        {
            return Err(StateError::SchemaMismatch {
                peers: unusable.iter().map(|(p, _)| *p).collect(),
            });
        }
        Err(StateError::NoUsableDonor { failures })
    }

    /// Asks `donor` for metadata (retrying a stream that fails) and checks the schema.
    async fn probe(&self, donor: &Donor, expected: &Expected) -> Result<Probed, DonorError> {
        let timeout = self.config.request_timeout;
        let mut last = DonorError::Timeout(timeout);
        if !donor.addrs.is_empty() {
            // Best effort: a newcomer may not know the donor yet (dials go by peer id).
            let _ = self
                .dht
                .p2p()
                .add_peer_addresses(donor.peer, donor.addrs.clone())
                .await;
        }
        for _ in 0..self.config.attempts.max(1) {
            let mut stream = self
                .dht
                .p2p()
                .open_stream(donor.peer, &self.protocol, timeout)
                .await
                .map_err(DonorError::Open)?;
            match exchange(
                &mut stream,
                &Request::Metadata,
                timeout,
                wire::MAX_RESPONSE_BYTES,
            )
            .await
            {
                Ok(Response::Metadata(meta)) => {
                    if meta.schema_hash != expected.schema_hash
                        || expected
                            .tensors
                            .as_ref()
                            .is_some_and(|t| *t != meta.tensors)
                    {
                        release(vec![(stream, meta.session)], timeout);
                        return Err(DonorError::SchemaMismatch);
                    }
                    return Ok(Probed {
                        donor: donor.clone(),
                        meta,
                        stream: Some(stream),
                    });
                }
                Ok(Response::Refused(r)) => return Err(DonorError::Refused(r)),
                Ok(Response::Chunk { .. }) => {
                    return Err(DonorError::Unexpected(
                        "a chunk answering a metadata request",
                    ));
                }
                Err(e) if e.is_transient() => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// Downloads the state `group` describes (all with one content hash) from all of them.
    async fn download(&self, group: Vec<Probed>) -> Result<Downloaded, Vec<(PeerId, DonorError)>> {
        let meta = group[0].meta.clone();
        let chunks = meta.chunks();
        let total = usize::try_from(meta.total_bytes).unwrap_or(usize::MAX);
        let mut data = vec![0u8; total];
        let mut queue: VecDeque<u64> = (0..chunks).collect();
        let mut remaining = chunks;
        let streams = self.config.streams_per_donor.max(1);
        let mut progress: Vec<Progress> = group
            .into_iter()
            .map(|probed| Progress {
                probed,
                alive: true,
                chunks: 0,
                bytes: 0,
                failure: None,
            })
            .collect();
        // Interleaved, so the first chunks go to every donor.
        let mut slots: Vec<Slot> = Vec::with_capacity(streams * progress.len());
        for s in 0..streams {
            for (d, p) in progress.iter_mut().enumerate() {
                slots.push(Slot {
                    donor: d,
                    stream: if s == 0 { p.probed.stream.take() } else { None },
                    busy: false,
                    failures: 0,
                    retired: false,
                });
            }
        }
        let protocol: Arc<str> = Arc::from(self.protocol.as_str());
        let timeout = self.config.request_timeout;
        let attempts = self.config.attempts.max(1);
        let mut inflight = JoinSet::new();
        // Chunks in flight: the donors fetching each, and when its first fetch began.
        let mut fetching: HashMap<u64, (Vec<usize>, Instant)> = HashMap::new();
        let mut done = vec![false; usize::try_from(chunks).unwrap_or(0)];
        while remaining > 0 {
            for (i, slot) in slots.iter_mut().enumerate() {
                if slot.busy || slot.retired || !progress[slot.donor].alive {
                    continue;
                }
                let index = match queue.pop_front() {
                    Some(index) => index,
                    // The end game: nothing left to hand out, so this idle stream asks for the
                    // chunk in flight longest that its donor is not fetching yet.
                    None => match end_game_pick(&fetching, slot.donor) {
                        Some(index) => index,
                        None => continue,
                    },
                };
                let (Some(range), Some(hash)) = (meta.chunk_range(index), meta.chunk_hash(index))
                else {
                    continue;
                };
                let hash: [u8; wire::HASH_BYTES] = hash.try_into().unwrap_or_default();
                slot.busy = true;
                fetching
                    .entry(index)
                    .or_insert_with(|| (Vec::new(), Instant::now()))
                    .0
                    .push(slot.donor);
                let donor = &progress[slot.donor].probed;
                let task = fetch(
                    self.dht.p2p().clone(),
                    donor.donor.peer,
                    protocol.clone(),
                    slot.stream.take(),
                    donor.meta.session.clone(),
                    index,
                    (range.end - range.start) as usize,
                    hash,
                    timeout,
                );
                inflight.spawn(async move { (i, index, task.await) });
            }
            let Some(joined) = inflight.join_next().await else {
                break;
            };
            let Ok((i, index, result)) = joined else {
                // A fetch task panicked: its chunk is lost, so the download cannot complete.
                continue;
            };
            let slot = &mut slots[i];
            slot.busy = false;
            if let Some((donors, _)) = fetching.get_mut(&index) {
                donors.retain(|d| *d != slot.donor);
                if donors.is_empty() {
                    fetching.remove(&index);
                }
            }
            let k = usize::try_from(index).ok().filter(|k| *k < done.len());
            let already = k.is_none_or(|k| done[k]);
            let p = &mut progress[slot.donor];
            match result {
                Ok((stream, chunk)) => {
                    // Verified against the reference description, whoever sent it; a copy
                    // that lost the end-game race to another donor's is dropped.
                    if !already && let (Some(k), Some(range)) = (k, meta.chunk_range(index)) {
                        done[k] = true;
                        data[range.start as usize..range.end as usize].copy_from_slice(&chunk);
                        remaining -= 1;
                        p.chunks += 1;
                        p.bytes += chunk.len() as u64;
                    }
                    slot.stream = Some(stream);
                    slot.failures = 0;
                }
                Err(e) => {
                    // Back to the queue, unless a copy arrived or another is still in flight.
                    if !already && !fetching.contains_key(&index) {
                        queue.push_front(index);
                    }
                    if e.is_transient() {
                        slot.failures += 1;
                        if slot.failures >= attempts {
                            slot.retired = true;
                            tracing::debug!(peer = %p.probed.donor.peer, error = %e, "state stream retired");
                            let donor = slot.donor;
                            if slots.iter().all(|s| s.donor != donor || s.retired) {
                                let p = &mut progress[donor];
                                p.alive = false;
                                p.failure = Some(e);
                            }
                        }
                    } else {
                        tracing::debug!(peer = %p.probed.donor.peer, error = %e, "state donor dropped");
                        if p.alive {
                            p.alive = false;
                            p.failure = Some(e);
                        }
                    }
                }
            }
        }
        // Whatever is still running cannot finish the download.
        inflight.shutdown().await;
        let failures: Vec<(PeerId, DonorError)> = progress
            .iter_mut()
            .filter_map(|p| Some((p.probed.donor.peer, p.failure.take()?)))
            .collect();
        if remaining > 0 {
            return Err(failures);
        }
        let mut idle = Vec::new();
        for (d, p) in progress.iter().enumerate() {
            if let Some(stream) = slots
                .iter_mut()
                .filter(|s| s.donor == d)
                .find_map(|s| s.stream.take())
            {
                idle.push((stream, p.probed.meta.session.clone()));
            }
        }
        Ok(Downloaded {
            data,
            meta,
            reports: progress
                .iter()
                .map(|p| DonorReport {
                    peer: p.probed.donor.peer,
                    priority: p.probed.donor.priority,
                    chunks: p.chunks,
                    bytes: p.bytes,
                })
                .collect(),
            failures,
            idle,
        })
    }

    /// A verified download as tensors of the local schema, installed nowhere.
    fn unpack(&self, done: Downloaded, skipped: Vec<(PeerId, DonorError)>) -> Loaded {
        let Downloaded {
            data,
            meta,
            reports,
            ..
        } = done;
        let mut offset = 0;
        let tensors = meta
            .tensors
            .iter()
            .map(|d| {
                let mut t = Tensor::zeros(&d.shape, d.dtype);
                let n = t.size_bytes();
                copy_into(&mut t, &data[offset..offset + n]);
                offset += n;
                t
            })
            .collect();
        Loaded {
            state: self.loaded_state(meta, reports, skipped),
            tensors: Some(tensors),
        }
    }

    /// Where a verified download came from, and what it was.
    fn loaded_state(
        &self,
        meta: Metadata,
        reports: Vec<DonorReport>,
        skipped: Vec<(PeerId, DonorError)>,
    ) -> LoadedState {
        LoadedState {
            source: reports.first().map_or(self.dht.p2p().peer_id(), |r| r.peer),
            donors: reports,
            bytes: meta.total_bytes,
            content_hash: meta.content_hash,
            metadata: meta.metadata,
            skipped,
        }
    }

    /// Replaces the tensors and the metadata with a verified download.
    fn install(
        &self,
        done: Downloaded,
        skipped: Vec<(PeerId, DonorError)>,
    ) -> Result<Option<LoadedState>, StateError> {
        let Downloaded {
            data,
            meta,
            reports,
            ..
        } = done;
        {
            let mut tensors = self.shared.lock_tensors_mut();
            if tensors.len() != meta.tensors.len()
                || tensors
                    .iter()
                    .zip(&meta.tensors)
                    .any(|(t, d)| TensorDescriptor::of(t) != *d)
            {
                return Err(StateError::LocalSchemaChanged);
            }
            crate::tensor::with_memory_checked(&mut tensors, |tensors| {
                let mut offset = 0;
                for t in tensors.iter_mut() {
                    let n = t.size_bytes();
                    copy_into(t, &data[offset..offset + n]);
                    offset += n;
                }
            })
            .map_err(StateError::LocalMemoryChanged)?;
        }
        *lock(&self.metadata) = meta.metadata.clone();
        Ok(Some(self.loaded_state(meta, reports, skipped)))
    }
}

/// Copies `bytes` (the raw little-endian data of `tensor`, same length) into `tensor`.
pub(super) fn copy_into(tensor: &mut Tensor, bytes: &[u8]) {
    match tensor.flat_mut() {
        PartViewMut::F32(s) => bytemuck::cast_slice_mut::<_, u8>(s).copy_from_slice(bytes),
        PartViewMut::F16(s) => bytemuck::cast_slice_mut::<_, u8>(s).copy_from_slice(bytes),
        PartViewMut::BF16(s) => bytemuck::cast_slice_mut::<_, u8>(s).copy_from_slice(bytes),
    }
}
