//! The round runner over in-memory byte streams: exact averages, modes, a peer dying mid-round,
//! and garbage on the links.

use crate::common;

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hivemesh::allreduce::TensorDescriptor;
use hivemesh::allreduce::{LinkRates, Member, Mode, Outcome, RoundConfig};
use hivemesh::runner::{self, Link, RunnerConfig};
use hivemesh::sim::make_tensors;
use hivemesh::tensor::{DType, Tensor};
use hivemesh::wire;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};

fn descriptors() -> Vec<TensorDescriptor> {
    [vec![150_000], vec![100], vec![]]
        .into_iter()
        .map(|shape| TensorDescriptor {
            shape,
            dtype: DType::F32,
        })
        .collect()
}

fn config(modes: &[Mode], me: usize, weight: f64) -> RoundConfig {
    let members = modes
        .iter()
        .map(|&mode| Member {
            mode,
            fraction: if mode == Mode::Client { 0.0 } else { 1.0 },
        })
        .collect();
    let mut cfg = RoundConfig::new(members, me);
    cfg.weight = weight;
    cfg.part_size_bytes = 64 << 10;
    cfg.sender_timeout = Duration::from_secs(2);
    cfg.reducer_timeout = Duration::from_secs(4);
    cfg
}

/// A link that breaks (errors on read and write) once `budget` bytes were written through any
/// of the links sharing it: a process dying mid-round.
struct Dying {
    inner: DuplexStream,
    budget: Arc<AtomicUsize>,
}

impl Dying {
    fn dead(&self) -> bool {
        self.budget.load(Ordering::SeqCst) == 0
    }
}

impl AsyncRead for Dying {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.dead() {
            return Poll::Ready(Err(io::ErrorKind::ConnectionReset.into()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Dying {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        // Claim the bytes first: the links of one dying peer write concurrently, and a
        // load-then-subtract let two of them spend the same bytes, wrapping the budget around
        // to "never dies" (the flake this test had).
        let Ok(left) = self
            .budget
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                (left > 0).then(|| left - left.min(data.len()))
            })
        else {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        };
        // Claimed bytes count as written even if the duplex buffer takes fewer (it holds 1 MiB,
        // more than any budget here): the peer only dies a little earlier.
        let n = data.len().min(left);
        Pin::new(&mut self.inner).poll_write(cx, &data[..n])
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Full mesh of duplex links: `links[a][b]` is a's end towards b.
fn mesh(n: usize) -> Vec<Vec<Option<DuplexStream>>> {
    mesh_buffered(n, 1 << 20)
}

/// [`mesh`] with `buffer` bytes of room in each direction of a link.
fn mesh_buffered(n: usize, buffer: usize) -> Vec<Vec<Option<DuplexStream>>> {
    let mut links: Vec<Vec<Option<DuplexStream>>> =
        (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
    for a in 0..n {
        for b in a + 1..n {
            let (x, y) = tokio::io::duplex(buffer);
            links[a][b] = Some(x);
            links[b][a] = Some(y);
        }
    }
    links
}

/// Checks `outcome` against the weighted mean of the contributors its report names.
fn max_err(
    me: usize,
    outcome: &Outcome,
    start: &[Vec<Tensor>],
    weights: &[f64],
    cfg: &RoundConfig,
) -> f32 {
    let part = hivemesh::allreduce::Partition::new(
        &descriptors(),
        &cfg.fractions(),
        cfg.part_size_bytes,
        &cfg.compression,
    )
    .unwrap();
    hivemesh::sim::deviation_from_report(me, outcome, &part, start, weights)
}

/// How [`run_group_with`] departs from the defaults.
struct Setup {
    /// Messages queued per link (`RunnerConfig::link_queue`); each member has its own runner
    /// config, so its own buffer pool.
    link_queue: usize,
    /// Room in each direction of a link.
    link_buffer: usize,
    /// Replaces the sender timeout; the reducer timeout is twice that.
    timeouts: Option<Duration>,
    /// Declared measured rates (bytes per second, both directions) of every member, with
    /// the client links paced from them (`RoundConfig::pace_links`).
    paced_at: Option<f64>,
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            link_queue: RunnerConfig::default().link_queue,
            link_buffer: 1 << 20,
            timeouts: None,
            paced_at: None,
        }
    }
}

type Results = Vec<Result<(Vec<Tensor>, Outcome), runner::RunnerError>>;

async fn run_group(
    modes: &[Mode],
    weights: &[f64],
    budgets: &[Option<usize>],
) -> (Vec<Vec<Tensor>>, Results) {
    run_group_with(modes, weights, budgets, Setup::default()).await
}

async fn run_group_with(
    modes: &[Mode],
    weights: &[f64],
    budgets: &[Option<usize>],
    setup: Setup,
) -> (Vec<Vec<Tensor>>, Results) {
    let n = modes.len();
    let start: Vec<Vec<Tensor>> = (0..n)
        .map(|p| make_tensors(&descriptors(), 7, p).unwrap())
        .collect();
    let mut links = mesh_buffered(n, setup.link_buffer);
    let mut tasks = Vec::new();
    for me in 0..n {
        let budget = budgets[me].map(|b| Arc::new(AtomicUsize::new(b)));
        let my_links: Vec<Option<Box<dyn Link>>> = links[me]
            .iter_mut()
            .map(|l| {
                l.take().map(|inner| match &budget {
                    Some(b) => Box::new(Dying {
                        inner,
                        budget: b.clone(),
                    }) as Box<dyn Link>,
                    None => Box::new(inner) as Box<dyn Link>,
                })
            })
            .collect();
        let mut cfg = config(modes, me, weights[me]);
        if let Some(t) = setup.timeouts {
            cfg.sender_timeout = t;
            cfg.reducer_timeout = 2 * t;
        }
        if let Some(rate) = setup.paced_at {
            cfg.pace_links = true;
            cfg.rates = vec![
                LinkRates {
                    up: rate,
                    down: rate
                };
                n
            ];
        }
        let tensors = start[me].clone();
        tasks.push(tokio::spawn(runner::run_round(
            cfg,
            Bytes::from_static(b"group-a"),
            tensors,
            my_links,
            RunnerConfig {
                link_queue: setup.link_queue,
                ..RunnerConfig::default()
            },
        )));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(
            tokio::time::timeout(Duration::from_secs(60), t)
                .await
                .expect("round ends")
                .unwrap(),
        );
    }
    (start, results)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_nodes_average_exactly() {
    let modes = [Mode::Node; 4];
    let weights = [1.0, 2.0, 0.5, 1.0];
    let (start, results) = run_group(&modes, &weights, &[None; 4]).await;
    for (p, r) in results.iter().enumerate() {
        let (_, outcome) = r.as_ref().unwrap();
        assert!(outcome.report.local_parts().next().is_none(), "peer {p}");
        assert!(outcome.report.banned.is_empty() && outcome.report.failed_reducers.is_empty());
        let err = max_err(p, outcome, &start, &weights, &config(&modes, p, weights[p]));
        assert!(err < 1e-5, "peer {p}: {err}");
        common::assert_full_mean(p, outcome, &start, &weights);
    }
}

/// Short link queues over links with little room: the compute thread keeps finding queues
/// full and must be woken when a writer makes room (nothing else would wake it at the end of
/// the round: the timeouts are an hour, and `run_group_with` gives the round a minute). With
/// one-message queues every receive finds the queue full (this run hangs without the wake-up);
/// with two, writers also take from queues with room left and skip it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_link_queues_do_not_stall_the_round() {
    let modes = [Mode::Node; 4];
    let weights = [1.0; 4];
    for queue in [1, 2] {
        let setup = Setup {
            link_queue: queue,
            link_buffer: 4 << 10,
            timeouts: Some(Duration::from_secs(3600)),
            paced_at: None,
        };
        let (start, results) = run_group_with(&modes, &weights, &[None; 4], setup).await;
        for (p, r) in results.iter().enumerate() {
            let (_, outcome) = r.as_ref().unwrap();
            assert!(outcome.report.local_parts().next().is_none(), "peer {p}");
            let err = max_err(p, outcome, &start, &weights, &config(&modes, p, 1.0));
            assert!(err < 1e-5, "queue {queue}, peer {p}: {err}");
            common::assert_full_mean(p, outcome, &start, &weights);
        }
    }
}

/// Two nodes, an aux peer and two clients, with their weights.
const MIXED: [Mode; 5] = [
    Mode::Node,
    Mode::Client,
    Mode::Aux,
    Mode::Node,
    Mode::Client,
];
const MIXED_WEIGHTS: [f64; 5] = [1.0, 1.0, 0.0, 3.0, 0.25];

/// Every member of [`MIXED`] but the aux peer holds the exact weighted mean of everyone's
/// values, and nobody was banned or failed.
fn assert_mixed_exact(start: &[Vec<Tensor>], results: &Results) {
    for (p, r) in results.iter().enumerate() {
        let (_, outcome) = r.as_ref().unwrap();
        if MIXED[p] == Mode::Aux {
            assert!(outcome.results.is_none());
            continue;
        }
        assert!(outcome.report.local_parts().next().is_none(), "peer {p}");
        assert!(outcome.report.banned.is_empty() && outcome.report.failed_reducers.is_empty());
        let cfg = config(&MIXED, p, MIXED_WEIGHTS[p]);
        let err = max_err(p, outcome, start, &MIXED_WEIGHTS, &cfg);
        assert!(err < 1e-5, "peer {p}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_and_aux_over_links() {
    let (start, results) = run_group(&MIXED, &MIXED_WEIGHTS, &[None; 5]).await;
    assert_mixed_exact(&start, &results);
}

/// The same group with every member's rates declared at 1 MB/s and the client links paced
/// from them: the averages are as exact, and the round takes at least as long as its slowest
/// paced flow needs at its pace (a floor the pacer guarantees; over in-memory links an unpaced
/// round takes milliseconds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_and_aux_over_paced_links() {
    let rate = 1e6;
    let setup = Setup {
        paced_at: Some(rate),
        ..Setup::default()
    };
    let cfg = config(&MIXED, 1, 1.0);
    let paces = hivemesh::allreduce::pacing::link_paces(
        &cfg.members,
        &vec![
            LinkRates {
                up: rate,
                down: rate
            };
            MIXED.len()
        ],
        1,
    );
    // Client 1 sends a third of its ~600 KB to each of the three reducers.
    let pace = paces[0].expect("a client's link to a node is paced");
    let floor = (600_000.0 / 3.0 - hivemesh::allreduce::pacing::PACE_SLICE_BYTES as f64) / pace
        - hivemesh::allreduce::pacing::PACE_SLACK.as_secs_f64();
    assert!(floor > 0.5, "{floor}");
    let started = std::time::Instant::now();
    let (start, results) = run_group_with(&MIXED, &MIXED_WEIGHTS, &[None; 5], setup).await;
    let took = started.elapsed().as_secs_f64();
    assert!(
        took >= floor,
        "{took} s, paced flows need at least {floor} s"
    );
    assert_mixed_exact(&start, &results);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_dying_mid_round_leaves_correct_partial_averages() {
    let modes = [Mode::Node; 4];
    let weights = [1.0; 4];
    // Peer 2 dies after writing 200 KB (of ~1.8 MB it would send). Every survivor needs more
    // than that from it alone (peer 0, the least: 2 parts and 2 replies of 64 KiB), so each
    // one sees it die before it got everything.
    let (start, results) = run_group(&modes, &weights, &[None, None, Some(200_000), None]).await;
    for p in [0, 1, 3] {
        let (_, outcome) = results[p].as_ref().unwrap();
        let r = &outcome.report;
        assert!(
            r.banned.contains(2) || r.failed_reducers.contains(2),
            "peer {p}: {r:?}"
        );
        let err = max_err(p, outcome, &start, &weights, &config(&modes, p, 1.0));
        assert!(err < 1e-5, "peer {p}: {err}");
        // Some averaging happened with the survivors.
        assert!(
            r.spans
                .iter()
                .any(|s| s.segments.iter().any(|g| g.contributors.is_some()))
        );
    }
}

/// An adversary in the group (index 3) writes garbage of each kind on its links; the honest
/// peers finish, ban it, and hold correct averages over whom they name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_links_is_rejected_and_the_round_completes() {
    let foreign = common::foreign_group_frame();
    let mut huge = BytesMut::new();
    wire::put_length_prefix(4 << 30, &mut huge);
    let random: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    for garbage in [random, huge.to_vec(), foreign] {
        let modes = [Mode::Node; 4];
        let weights = [1.0; 4];
        let n = 4;
        let start: Vec<Vec<Tensor>> = (0..n)
            .map(|p| make_tensors(&descriptors(), 7, p).unwrap())
            .collect();
        let mut links = mesh(n);
        let mut tasks = Vec::new();
        for me in 0..3 {
            let my_links: Vec<Option<Box<dyn Link>>> = links[me]
                .iter_mut()
                .map(|l| l.take().map(|s| Box::new(s) as Box<dyn Link>))
                .collect();
            tasks.push(tokio::spawn(runner::run_round(
                config(&modes, me, 1.0),
                Bytes::from_static(b"group-a"),
                start[me].clone(),
                my_links,
                RunnerConfig::default(),
            )));
        }
        let mut adversary: Vec<DuplexStream> =
            links[3].iter_mut().filter_map(Option::take).collect();
        for l in &mut adversary {
            l.write_all(&garbage).await.unwrap();
        }
        for (p, t) in tasks.into_iter().enumerate() {
            let (_, outcome) = tokio::time::timeout(Duration::from_secs(60), t)
                .await
                .expect("honest peer finishes")
                .unwrap()
                .unwrap();
            let r = &outcome.report;
            assert!(
                r.banned.contains(3) && r.failed_reducers.contains(3),
                "peer {p}: {r:?}"
            );
            let err = max_err(p, &outcome, &start, &weights, &config(&modes, p, 1.0));
            assert!(err < 1e-5, "peer {p}: {err}");
        }
        drop(adversary);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_link_count_is_an_error() {
    let modes = [Mode::Node; 3];
    let err = runner::run_round(
        config(&modes, 0, 1.0),
        Bytes::from_static(b"g"),
        make_tensors(&descriptors(), 1, 0).unwrap(),
        Vec::new(),
        RunnerConfig::default(),
    )
    .await
    .unwrap_err();
    assert!(matches!(
        err,
        runner::RunnerError::LinkCount {
            links: 0,
            members: 3
        }
    ));
}

type RoundTask = tokio::task::JoinHandle<Result<(Vec<Tensor>, Outcome), runner::RunnerError>>;

/// A round of two whose other member never sends anything (its timeouts an hour away, so
/// nothing but its caller can end it): the round's task and the silent member's end of the
/// link (with room for everything the round sends).
fn held_round(cancel: tokio::sync::watch::Receiver<bool>) -> (RoundTask, DuplexStream) {
    let modes = [Mode::Node; 2];
    let mut cfg = config(&modes, 0, 1.0);
    cfg.sender_timeout = Duration::from_secs(3600);
    cfg.reducer_timeout = Duration::from_secs(7200);
    let (mine, theirs) = tokio::io::duplex(8 << 20);
    let links: Vec<Option<Box<dyn Link>>> = vec![None, Some(Box::new(mine))];
    let round = tokio::spawn(runner::run_round_cancellable(
        cfg,
        Bytes::from_static(b"g"),
        make_tensors(&descriptors(), 7, 0).unwrap(),
        links,
        RunnerConfig::default(),
        cancel,
    ));
    (round, theirs)
}

/// Dropping a round's future (what a step's deadline does) ends everything the round started:
/// the peer's end of a link sees the stream close, rather than a reader and a writer that live
/// on with the link and its buffers while the peer stays silent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_round_closes_its_links() {
    use tokio::io::AsyncReadExt;
    let (_cancel, cancelled) = tokio::sync::watch::channel(false);
    let (round, mut silent) = held_round(cancelled);
    // The round has begun once its first part for the silent peer arrives.
    let mut buf = vec![0u8; 64 << 10];
    let n = tokio::time::timeout(Duration::from_secs(60), silent.read(&mut buf))
        .await
        .expect("no part arrived")
        .unwrap();
    assert!(n > 0);
    round.abort();
    assert!(round.await.unwrap_err().is_cancelled());
    let closed = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            match silent.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the link stayed open after its round was dropped"
    );
}

/// Cancelling a round that nothing else can end (its peer never sends its part, and the
/// timeouts are an hour away) ends it with `Cancelled` and tells the peer: among the frames it
/// received is an abort, and then its link closes. Deterministic: the round cannot have
/// finished before the cancel landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_held_round_aborts_it() {
    use hivemesh::allreduce::{AbortReason, Message, RoundError};
    use tokio::io::AsyncReadExt;
    let (cancel, cancelled) = tokio::sync::watch::channel(false);
    let (round, mut held) = held_round(cancelled);
    let mut received = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    let n = tokio::time::timeout(Duration::from_secs(60), held.read(&mut buf))
        .await
        .expect("no part arrived")
        .unwrap();
    received.extend_from_slice(&buf[..n]);
    cancel.send(true).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(60), round)
        .await
        .expect("the cancel ended the round")
        .unwrap();
    assert!(
        matches!(
            result,
            Err(runner::RunnerError::Round(RoundError::Cancelled))
        ),
        "{:?}",
        result.map(|_| ())
    );
    tokio::time::timeout(Duration::from_secs(60), held.read_to_end(&mut received))
        .await
        .expect("the link closed")
        .unwrap();
    let decoder = wire::FrameDecoder::new(wire::DEFAULT_MAX_FRAME_BYTES);
    let mut rest = &received[..];
    let mut aborted = false;
    while let Some((prefix, len)) = decoder.peek_len(rest).unwrap() {
        let frame =
            wire::decode_frame(Bytes::copy_from_slice(&rest[prefix..prefix + len])).unwrap();
        aborted |= matches!(
            frame.message,
            Message::Abort {
                reason: AbortReason::Cancelled,
                ..
            }
        );
        rest = &rest[prefix + len..];
    }
    assert!(rest.is_empty(), "a partial frame was left");
    assert!(aborted, "the peer was not told");
}
