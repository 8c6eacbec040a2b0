//! hivemesh: peer-to-peer decentralized averaging, in the style of hivemind.
//!
//! # One averaging round
//!
//! 1. A group of peers has agreed on an order, each member's mode (node, client or aux) and
//!    its share of the reduction: [`matchmaking`] forms the group through the DHT
//!    ([`matchmaking::Matchmaker`]) and derives the shares from advertised bandwidths
//!    ([`matchmaking::load_balancing`]).
//! 2. Each peer builds an [`allreduce::Butterfly`] over its tensors. Tensors are flattened and
//!    cut into parts ([`allreduce::Partition`]); peer `i` reduces the `i`-th span.
//! 3. Senders stream their parts, encoded by a [`compression`] codec, to each span's reducer;
//!    reducers average each part in one pass once it is complete ([`allreduce::Reducer`]) and
//!    answer each sender with the average (lossless) or the delta `average − its input`
//!    (lossy codecs), naming the contributors.
//! 4. Sender and reducer timeouts ban silent or misbehaving peers; the round still finishes,
//!    and [`allreduce::Outcome`] says part by part whose values were averaged.
//! 5. The peer adds `result − start` to its tensors ([`allreduce::Outcome::apply`], the delta
//!    rule: updates made while the round ran are kept).
//!
//! The protocol cores are sans-IO: [`sim`] drives them in virtual time with simulated links
//! and faults; [`p2p`] is the libp2p layer (swarm, Kademlia with merged records) and [`dht`]
//! the typed values stored in it; [`wire`] holds the prost messages of a round;
//! [`transport`] is the data plane that carries them (TLS 1.3 over TCP, authenticated by
//! libp2p PeerIds); [`links`] sets up a round's links over it or, as the fallback, over libp2p
//! streams, and [`runner`] runs the round over them. Behind NATs, [`reach`] says how each peer
//! can be reached and, for a group, who links with whom, who opens and who may reduce; the p2p
//! layer finds a node's reachability, keeps relay reservations and hole-punches.
//!
//! With the `cuda` feature, the `cuda` module lets an averager average tensors in GPU memory in place:
//! snapshot by an asynchronous device-to-host copy, the delta rule applied on the device.
#![warn(missing_docs)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod allreduce;
pub mod averager;
pub mod buffers;
pub mod compression;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dht;
#[doc(hidden)]
pub mod fuzzing;
pub mod group;
pub mod links;
pub mod matchmaking;
pub mod metrics;
pub mod monitor;
pub mod p2p;
mod proto_guard;
pub mod reach;
pub mod rpc;
pub mod runner;
mod shares;
pub mod sim;
pub mod tensor;
pub mod timeline;
pub mod train;
pub mod transport;
pub mod wire;

/// The README's Rust snippet, compiled by `cargo test` (doctests) so that it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeSnippets;

// The types a training loop and a node operator use, at the crate root.
pub use allreduce::{Aggregator, CenteredClip};
pub use averager::node::{Node, NodeConfig, NodeError};
pub use averager::{
    AveragedTensor, Averager, AveragerConfig, AveragerError, BlockingAverager, Stage, StepControl,
    StepOptions, StepOutcome,
};
pub use compression::{Compression, CompressionType};
#[cfg(feature = "cuda")]
pub use cuda::{CudaDevice, CudaError, DeviceTensor};
pub use dht::Dht;
pub use group::{FailedMember, Group, GroupConfig, GroupError, Partial, ReduceOp};
pub use metrics::Metrics;
pub use p2p::{P2p, P2pConfig};
pub use rpc::{Rpc, RpcConfig, RpcError};
pub use tensor::Tensor;
pub use train::{GlobalProgress, LocalProgress, ProgressConfig, ProgressTracker};
