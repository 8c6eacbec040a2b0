//! Lasting groups on real in-process swarms (libp2p on loopback, TLS data links): every
//! collective against a reference computed here, for 1..=8 members, three dtypes, odd sizes
//! and (on odd group sizes) a lossy codec; members that fail mid-operation.

use crate::swarm;

use std::sync::Arc;
use std::time::Duration;
use swarm::Swarm;

use hivemesh::allreduce::{Mode, TensorDescriptor};
use hivemesh::averager::{Averager, AveragerConfig, StepOptions};
use hivemesh::compression::{Compression, CompressionType};
use hivemesh::tensor::{DType, Tensor};
use hivemesh::{Group, GroupError, Partial, ReduceOp};

fn config(prefix: &str, size: usize, compression: CompressionType) -> AveragerConfig {
    let mut c = AveragerConfig::new(prefix);
    c.mode = Some(Mode::Node);
    c.target_group_size = Some(size);
    c.min_group_size = size;
    c.min_matchmaking_time = Duration::from_secs(1);
    c.compression = Compression::Fixed(compression);
    c
}

/// Forms one group over nodes `0..n` of `swarm`.
async fn form(
    swarm: &Swarm,
    n: usize,
    prefix: &str,
    configure: impl Fn(&mut AveragerConfig),
) -> (Vec<Arc<Averager>>, Vec<Group>) {
    let averagers: Vec<Arc<Averager>> = (0..n)
        .map(|i| {
            let mut c = config(prefix, n, CompressionType::None);
            configure(&mut c);
            swarm.averager(i, vec![vec![0.0f32; 4]], c)
        })
        .collect();
    let formed = futures::future::join_all(averagers.iter().map(|a| {
        a.form_group(StepOptions {
            timeout: Some(Duration::from_secs(60)),
            ..StepOptions::default()
        })
    }))
    .await;
    let mut groups: Vec<Group> = formed
        .into_iter()
        .map(|g| g.expect("the group forms"))
        .collect();
    // In group order, so that index i is member i.
    groups.sort_by_key(Group::me);
    for (i, g) in groups.iter().enumerate() {
        assert_eq!(g.size(), n);
        assert_eq!(g.me(), i);
        assert_eq!(g.members(), groups[0].members(), "one order for everyone");
    }
    (averagers, groups)
}

/// Small integers (exact in every dtype and codec used here, and in their sums).
fn input(member: usize, salt: usize, dtype: DType, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((member * 7 + salt * 13 + i * 5) % 17) as f32 - 8.0)
        .collect();
    Tensor::from_f32_as(shape, &v, dtype).unwrap()
}

fn reduce(op: ReduceOp, columns: &[Vec<f32>]) -> Vec<f64> {
    (0..columns[0].len())
        .map(|e| {
            let c = columns.iter().map(|v| f64::from(v[e]));
            match op {
                ReduceOp::Sum => c.sum(),
                ReduceOp::Mean => c.sum::<f64>() / columns.len() as f64,
                ReduceOp::Max => c.fold(f64::MIN, f64::max),
                ReduceOp::Min => c.fold(f64::MAX, f64::min),
            }
        })
        .collect()
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::BF16 => 1e-2,
    }
}

fn assert_close(got: &Tensor, want: &[f64], dtype: DType, lossy: bool, what: &str) {
    assert_eq!(got.dtype(), dtype, "{what}: dtype");
    let got = got.to_f32_vec();
    assert_eq!(got.len(), want.len(), "{what}: length");
    // The float16 codec rounds what goes over the wire: averages, and deltas of the size of
    // the inputs (up to 8), so its error scales with the inputs, not with the result.
    let (tol, floor) = if lossy {
        (tolerance(dtype).max(tolerance(DType::F16)), 8.0)
    } else {
        (tolerance(dtype), 1.0)
    };
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = tol * w.abs().max(floor);
        assert!(
            (f64::from(*g) - w).abs() <= tol,
            "{what}: element {i} is {g}, want {w}"
        );
    }
}

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];
/// Odd sizes, an empty tensor among them.
const SHAPES: [&[usize]; 3] = [&[37], &[0], &[3, 5]];

/// Everything one member does: every operation, checked against the reference.
async fn script(mut g: Group, lossy: bool) -> Group {
    let n = g.size();
    let me = g.me();
    for (d, &dtype) in DTYPES.iter().enumerate() {
        for (o, &op) in OPS.iter().enumerate() {
            let salt = d * 10 + o;
            let mine: Vec<Tensor> = SHAPES.iter().map(|s| input(me, salt, dtype, s)).collect();
            let got = g.all_reduce(op, mine).await.unwrap();
            for (t, shape) in SHAPES.iter().enumerate() {
                let columns: Vec<Vec<f32>> = (0..n)
                    .map(|m| input(m, salt, dtype, shape).to_f32_vec())
                    .collect();
                let what = format!("all_reduce {op:?} {dtype:?} tensor {t} at {me}/{n}");
                assert_close(&got[t], &reduce(op, &columns), dtype, lossy, &what);
                assert_eq!(got[t].shape(), *shape);
            }
        }
        let salt = 100 + d;
        let mine: Vec<Tensor> = SHAPES.iter().map(|s| input(me, salt, dtype, s)).collect();
        let gathered = g.all_gather(mine).await.unwrap();
        assert_eq!(gathered.len(), n);
        for (m, tensors) in gathered.iter().enumerate() {
            for (t, shape) in SHAPES.iter().enumerate() {
                let want: Vec<f64> = input(m, salt, dtype, shape)
                    .to_f32_vec()
                    .into_iter()
                    .map(f64::from)
                    .collect();
                let what = format!("all_gather {dtype:?} member {m} tensor {t} at {me}/{n}");
                assert_close(&tensors[t], &want, dtype, lossy, &what);
            }
        }
        for root in [0, n - 1] {
            let salt = 200 + d * 10 + root;
            let mine: Vec<Tensor> = SHAPES.iter().map(|s| input(me, salt, dtype, s)).collect();
            let got = g.broadcast(root, mine).await.unwrap();
            for (t, shape) in SHAPES.iter().enumerate() {
                let want: Vec<f64> = input(root, salt, dtype, shape)
                    .to_f32_vec()
                    .into_iter()
                    .map(f64::from)
                    .collect();
                let what = format!("broadcast from {root} {dtype:?} tensor {t} at {me}/{n}");
                assert_close(&got[t], &want, dtype, lossy, &what);
            }
        }
        for (o, &op) in OPS.iter().enumerate() {
            let salt = 300 + d * 10 + o;
            // Member j's chunk has j + 2 elements.
            let inputs: Vec<Tensor> = (0..n)
                .map(|j| input(me * 31 + j, salt, dtype, &[j + 2]))
                .collect();
            let got = g.reduce_scatter(op, inputs).await.unwrap();
            let columns: Vec<Vec<f32>> = (0..n)
                .map(|m| input(m * 31 + me, salt, dtype, &[me + 2]).to_f32_vec())
                .collect();
            let what = format!("reduce_scatter {op:?} {dtype:?} at {me}/{n}");
            assert_close(&got, &reduce(op, &columns), dtype, lossy, &what);
        }
    }
    g.barrier().await.unwrap();
    if n >= 2 {
        // A ring of sends, then every member to member 0, received in arrival order.
        let like = [TensorDescriptor {
            shape: vec![9],
            dtype: DType::BF16,
        }];
        let next = (me + 1) % n;
        let prev = (me + n - 1) % n;
        g.send(next, vec![input(me, 400, DType::BF16, &[9])])
            .await
            .unwrap();
        let got = g.recv(prev, &like).await.unwrap();
        assert_eq!(
            got,
            vec![input(prev, 400, DType::BF16, &[9])],
            "ring at {me}/{n}"
        );
        if me == 0 {
            let mut from: Vec<usize> = Vec::new();
            for _ in 1..n {
                let (m, got) = g.recv_any(&like).await.unwrap();
                assert_eq!(got, vec![input(m, 500, DType::BF16, &[9])]);
                from.push(m);
            }
            from.sort_unstable();
            assert_eq!(
                from,
                (1..n).collect::<Vec<_>>(),
                "recv_any got everyone once"
            );
        } else {
            g.send(0, vec![input(me, 500, DType::BF16, &[9])])
                .await
                .unwrap();
        }
    }
    g.barrier().await.unwrap();
    g
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_op_matches_the_reference_for_one_to_eight_members() {
    let _serial = crate::serial_swarms().await;
    let swarm = Swarm::start(8, |_| false).await;
    let mut all = Vec::new();
    for n in 1..=8 {
        // Odd sizes go through a lossy codec (exact on these small integers; reductions of
        // lossy parts are checked to the dtype's tolerance).
        let codec = if n % 2 == 1 {
            CompressionType::Float16
        } else {
            CompressionType::None
        };
        let (averagers, groups) = form(&swarm, n, &format!("ops{n}"), |c| {
            c.compression = Compression::Fixed(codec);
        })
        .await;
        let groups =
            futures::future::join_all(groups.into_iter().map(|g| script(g, n % 2 == 1))).await;
        for g in groups {
            g.close().await;
        }
        all.extend(averagers);
    }
    swarm.shutdown(all).await;
}

/// Members run the same operations one after another; a member whose group is gone (its
/// links closed, as when its process dies) fails each kind of operation for the others with
/// an error that names it, and after `shrink` the others go on without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_gone_mid_group_is_named_and_shrunk_away() {
    let _serial = crate::serial_swarms().await;
    let swarm = Swarm::start(4, |_| false).await;
    let mut all = Vec::new();
    for (case, op) in [
        "all_reduce",
        "all_gather",
        "broadcast",
        "broadcast_to_it",
        "reduce_scatter",
        "barrier",
        "recv",
    ]
    .into_iter()
    .enumerate()
    {
        let (averagers, mut groups) = form(&swarm, 4, &format!("gone{case}"), |c| {
            c.sender_timeout = Duration::from_secs(2);
            c.reducer_timeout = Duration::from_secs(4);
            c.round_timeout = Duration::from_secs(60);
            c.part_size_bytes = 512; // several parts per reducer
        })
        .await;
        let victim = groups.pop().unwrap();
        let victim_peer = victim.members()[3];
        drop(victim);
        let results = futures::future::join_all(groups.iter_mut().map(|g| async move {
            let me = g.me();
            let t = || vec![input(me, 1, DType::F32, &[1000])];
            match op {
                "all_reduce" => g.all_reduce(ReduceOp::Sum, t()).await.map(drop),
                "all_gather" => g.all_gather(t()).await.map(drop),
                // From the member that is gone: nothing to pass on.
                "broadcast" => g.broadcast(3, t()).await.map(drop),
                // To it, the last of the chain 0, 1, 2, 3: the news travels back up to the
                // root, which names it too.
                "broadcast_to_it" => g.broadcast(0, t()).await.map(drop),
                "reduce_scatter" => g
                    .reduce_scatter(
                        ReduceOp::Sum,
                        (0..4).map(|_| input(me, 2, DType::F32, &[10])).collect(),
                    )
                    .await
                    .map(drop),
                "barrier" => g.barrier().await,
                _ => g
                    .recv(
                        3,
                        &[TensorDescriptor {
                            shape: vec![5],
                            dtype: DType::F32,
                        }],
                    )
                    .await
                    .map(drop),
            }
        }))
        .await;
        for (i, r) in results.into_iter().enumerate() {
            match r {
                Err(GroupError::Failed {
                    failed, partial, ..
                }) => {
                    assert_eq!(failed.len(), 1, "{op} at {i}: {failed:?}");
                    assert_eq!(failed[0].index, 3);
                    assert_eq!(failed[0].peer, victim_peer);
                    match (op, *partial) {
                        ("all_reduce", Partial::AllReduce { report, .. }) => {
                            // The dead member's span stayed local; the survivors' spans
                            // combine exactly the survivors' values.
                            for span in &report.spans {
                                for seg in &span.segments {
                                    let want = (span.reducer != 3).then(|| {
                                        hivemesh::allreduce::PeerSet::from_indices([0, 1, 2])
                                    });
                                    assert_eq!(seg.contributors, want, "span of {}", span.reducer);
                                }
                            }
                            assert_eq!(report.spans.len(), 4);
                        }
                        ("all_gather", Partial::Gathered(got)) => {
                            assert!(got[3].is_none());
                            assert!((0..3).all(|m| got[m].is_some()), "{op} at {i}");
                        }
                        ("reduce_scatter", Partial::Reduced { contributors, .. }) => {
                            assert_eq!(contributors, vec![0, 1, 2]);
                        }
                        ("barrier", Partial::Arrived(arrived)) => {
                            assert_eq!(arrived, vec![0, 1, 2])
                        }
                        ("broadcast" | "broadcast_to_it" | "recv", Partial::Nothing) => {}
                        (op, other) => panic!("{op}: partial {other:?}"),
                    }
                }
                other => panic!("{op} at {i}: {other:?}"),
            }
        }
        let removed = futures::future::join_all(groups.iter_mut().map(Group::shrink)).await;
        for r in removed {
            assert_eq!(r.unwrap(), vec![victim_peer], "{op}");
        }
        let results = futures::future::join_all(groups.iter_mut().map(|g| async move {
            let me = g.me();
            g.all_reduce(
                ReduceOp::Sum,
                vec![Tensor::from_f32(&[2], vec![me as f32, 1.0]).unwrap()],
            )
            .await
        }))
        .await;
        for r in results {
            let got = r.expect("the shrunk group works");
            assert_eq!(got[0].to_f32_vec(), vec![3.0, 3.0], "{op}: 0+1+2 and 1+1+1");
        }
        for g in groups {
            assert_eq!(g.size(), 3);
            g.close().await;
        }
        all.extend(averagers);
    }
    swarm.shutdown(all).await;
}

/// The node a group member runs on.
fn node_of<'a>(swarm: &'a Swarm, g: &Group) -> &'a hivemesh::Node {
    let me = g.members()[g.me()];
    swarm
        .nodes
        .iter()
        .find(|n| n.dht().p2p().peer_id() == me)
        .expect("a member of the swarm")
}

/// Three members admit a fourth at an operation boundary: it finds the group's invitation in
/// the DHT, the leader admits it, everyone links to it, and the next all-reduce is over four.
/// An admission nobody asks for changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newcomer_is_admitted_at_an_operation_boundary() {
    let _serial = crate::serial_swarms().await;
    let swarm = Swarm::start(4, |_| false).await;
    let (mut averagers, mut groups) = form(&swarm, 3, "admit", |_| {}).await;
    // Nobody asks: the members go on as they were.
    let admitted = futures::future::join_all(groups.iter_mut().map(|g| {
        let node = node_of(&swarm, g);
        async move { g.admit(node, Duration::from_millis(500)).await }
    }))
    .await;
    for a in admitted {
        assert_eq!(a.unwrap(), Vec::new());
    }
    let newcomer = swarm.averager(
        3,
        vec![vec![0.0f32; 4]],
        config("admit", 3, CompressionType::None),
    );
    let joining = newcomer.join_group(&swarm.nodes[3], Duration::from_secs(60));
    let admitting = futures::future::join_all(groups.iter_mut().map(|g| {
        let node = node_of(&swarm, g);
        async move { g.admit(node, Duration::from_secs(60)).await }
    }));
    let (joined, admitted) = tokio::join!(joining, admitting);
    let joined = joined.expect("the newcomer joins");
    for a in admitted {
        assert_eq!(a.unwrap(), vec![swarm.peer(3)]);
    }
    groups.push(joined);
    for g in &groups {
        assert_eq!(g.size(), 4);
        assert_eq!(g.members(), groups[0].members());
        assert_eq!(g.members()[3], swarm.peer(3), "newcomers come last");
    }
    let results = futures::future::join_all(groups.iter_mut().map(|g| async move {
        let me = g.me() as f32;
        g.all_reduce(
            ReduceOp::Sum,
            vec![Tensor::from_f32(&[2], vec![me, 1.0]).unwrap()],
        )
        .await
    }))
    .await;
    for r in results {
        assert_eq!(
            r.unwrap()[0].to_f32_vec(),
            vec![6.0, 4.0],
            "0+1+2+3 and four ones"
        );
    }
    for g in groups {
        g.close().await;
    }
    averagers.push(newcomer);
    swarm.shutdown(averagers).await;
}

/// Two groups (different prefixes: process sets) on the same three nodes share the nodes'
/// swarms and link hubs and run their operations at the same time, each on its own data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_groups_on_the_same_nodes_run_side_by_side() {
    let _serial = crate::serial_swarms().await;
    let swarm = Swarm::start(3, |_| false).await;
    let (mut averagers, mut a) = form(&swarm, 3, "set-a", |_| {}).await;
    let (more, mut b) = form(&swarm, 3, "set-b", |_| {}).await;
    averagers.extend(more);
    let (ra, rb) = tokio::join!(side(&mut a, 1.0), side(&mut b, 10.0));
    for (results, scale) in [(ra, 1.0f32), (rb, 10.0)] {
        for (sum, all) in results {
            assert_eq!(sum[0].to_f32_vec(), vec![3.0 * scale, 3.0 * scale, 3.0]);
            for (m, t) in all.iter().enumerate() {
                assert_eq!(t[0].to_f32_vec(), vec![m as f32 * scale, scale, 1.0]);
            }
        }
    }
    for g in a.into_iter().chain(b) {
        g.close().await;
    }
    swarm.shutdown(averagers).await;
}

/// One group's side of `two_groups_on_the_same_nodes_run_side_by_side`.
async fn side(groups: &mut [Group], scale: f32) -> Vec<(Vec<Tensor>, Vec<Vec<Tensor>>)> {
    futures::future::join_all(groups.iter_mut().map(|g| async move {
        let me = g.me() as f32;
        let x = vec![Tensor::from_f32(&[3], vec![me * scale, scale, 1.0]).unwrap()];
        let sum = g.all_reduce(ReduceOp::Sum, x.clone()).await.unwrap();
        let all = g.all_gather(x).await.unwrap();
        (sum, all)
    }))
    .await
}

/// Issue 29, attack 2 (eclipse): a stranger whose peer id was ground to sort before every
/// member's (owner subkeys sort by peer id, and newcomers took the first invitation) invites
/// to a group of its own under the same prefix. The newcomer joins the real group, whose
/// invitation every member endorses, not the stranger's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newcomer_joins_the_endorsed_group_not_an_impostor() {
    use hivemesh::averager::node::{Node, NodeConfig};
    use hivemesh::group::Formation;
    use hivemesh::matchmaking::MemberInfo;
    let _serial = crate::serial_swarms().await;
    let swarm = Swarm::start(4, |_| false).await;
    // The impostor's id sorts before those of the nodes that will form the group. (Its node
    // starts before the group forms: later, its dial from its listen port may meet a port
    // still in TIME_WAIT from the forming's connections, "address already in use".)
    let key = loop {
        let key = libp2p::identity::Keypair::generate_ed25519();
        let id = key.public().to_peer_id().to_bytes();
        if (0..3).all(|i| id < swarm.peer(i).to_bytes()) {
            break key;
        }
    };
    let impostor_id = key.public().to_peer_id();
    let mut node_config = NodeConfig::loopback();
    node_config.p2p.initial_peers = vec![swarm.bootstrap.join_address().await.unwrap()];
    let impostor_node = Node::start(node_config, key).await.unwrap();
    let (mut averagers, mut groups) = form(&swarm, 3, "eclipse", |_| {}).await;
    let members = groups[0].members().to_vec();
    let mut impostor = Group::new(
        b"impostor",
        vec![impostor_id],
        0,
        vec![None],
        vec![None],
        hivemesh::GroupConfig::default(),
    )
    .unwrap()
    .with_formation(Formation {
        group_id: bytes::Bytes::from_static(b"impostor"),
        name: "eclipse".into(),
        infos: vec![MemberInfo::new(Mode::Node)],
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let impostor_task = tokio::spawn(async move {
        tokio::select! {
            _ = impostor.admit(&impostor_node, Duration::from_secs(120)) => {}
            _ = stopped => {}
        }
        impostor.close().await;
        impostor_node.shutdown().await;
    });
    let admitting = futures::future::join_all(groups.iter_mut().map(|g| {
        let node = node_of(&swarm, g);
        async move { g.admit(node, Duration::from_secs(60)).await }
    }));
    let newcomer = swarm.averager(
        3,
        vec![vec![0.0f32; 4]],
        config("eclipse", 3, CompressionType::None),
    );
    let joining = async {
        // The leader's and the impostor's invitations are out before the newcomer looks (a
        // leader publishes its invitation once the members have endorsed it).
        let key = hivemesh::dht::owned_key(b"eclipse.group");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let authors: Vec<libp2p::PeerId> = swarm.nodes[3]
                .dht()
                .get(&key)
                .await
                .ok()
                .flatten()
                .map(|v| v.owner_entries().map(|(p, _)| p).collect())
                .unwrap_or_default();
            if [members[0], impostor_id]
                .iter()
                .all(|m| authors.contains(m))
            {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "entries: {authors:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        newcomer
            .join_group(&swarm.nodes[3], Duration::from_secs(60))
            .await
    };
    let (joined, admitted) = tokio::join!(joining, admitting);
    let _ = stop.send(());
    impostor_task.await.unwrap();
    let joined = joined.expect("the newcomer joins");
    let mut want = members.clone();
    want.push(swarm.peer(3));
    assert_eq!(joined.members(), want, "joined the real group");
    for a in admitted {
        assert_eq!(a.unwrap(), vec![swarm.peer(3)]);
    }
    groups.push(joined);
    for g in groups {
        g.close().await;
    }
    averagers.push(newcomer);
    swarm.shutdown(averagers).await;
}

/// Issue 29, attack 2 (duplicates, who may join): a member asking to join its own group, a
/// newcomer asking twice at once, and a stranger the group's authorizer refuses. Before, the
/// member (or the newcomer's second request) took a second place in the membership and every
/// member's admission failed on it; the group admitted whoever asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_refuses_members_duplicates_and_the_unauthorized() {
    let _serial = crate::serial_swarms().await;
    let swarm = Swarm::start(5, |_| false).await;
    let (mut averagers, groups) = form(&swarm, 3, "dupes", |_| {}).await;
    let allowed = swarm.peer(3);
    let mut groups: Vec<Group> = groups
        .into_iter()
        .map(|g| g.with_authorizer(Arc::new(move |peer, _| *peer == allowed)))
        .collect();
    let newcomer = swarm.averager(
        3,
        vec![vec![0.0f32; 4]],
        config("dupes", 3, CompressionType::None),
    );
    let stranger = swarm.averager(
        4,
        vec![vec![0.0f32; 4]],
        config("dupes", 3, CompressionType::None),
    );
    let join = |a: &Arc<Averager>, node: usize| {
        let a = a.clone();
        let node = &swarm.nodes[node];
        async move { a.join_group(node, Duration::from_secs(20)).await }
    };
    // The member and the stranger ask first: both are refused without closing the window.
    let refused = futures::future::join_all([join(&averagers[1], 1), join(&stranger, 4)]);
    let admitting = futures::future::join_all(groups.iter_mut().map(|g| {
        let node = node_of(&swarm, g);
        async move { g.admit(node, Duration::from_secs(60)).await }
    }));
    let ((refused, joins), admitted) = tokio::join!(
        async {
            let refused = refused.await;
            let joins = futures::future::join_all([join(&newcomer, 3), join(&newcomer, 3)]).await;
            (refused, joins)
        },
        admitting
    );
    for r in refused {
        let e = r.expect_err("refused");
        assert!(matches!(e, GroupError::Internal { .. }), "{e}");
    }
    for a in admitted {
        assert_eq!(a.expect("the admission works"), vec![allowed]);
    }
    let mut joined: Vec<Group> = joins.into_iter().filter_map(Result::ok).collect();
    assert_eq!(joined.len(), 1, "one place for the newcomer");
    groups.append(&mut joined);
    let results = futures::future::join_all(groups.iter_mut().map(|g| async move {
        g.all_reduce(
            ReduceOp::Sum,
            vec![Tensor::from_f32(&[1], vec![1.0]).unwrap()],
        )
        .await
    }))
    .await;
    for r in results {
        assert_eq!(r.unwrap()[0].to_f32_vec(), vec![4.0]);
    }
    for g in groups {
        g.close().await;
    }
    averagers.extend([newcomer, stranger]);
    swarm.shutdown(averagers).await;
}
