//! The integration tests, one test binary: each file of this folder is a module, one per
//! area (`cargo test --test integration nat::` runs one of them). One binary instead of one
//! per file: each binary links the library and its dependencies again and compiles its own copy
//! of the generic code it uses, which took most of the tests' build time (about 400 of
//! 560 CPU seconds; `docs/architecture.md`, "Tests").
//!
//! The helpers live beside it in `tests/common`, `tests/swarm` and `tests/netns` (the
//! benchmarks and `tests/cuda.rs` include them too). `tests/decode_memory.rs` (it counts
//! allocations with its own global allocator) and `tests/cuda.rs` (the `cuda` feature) stay
//! binaries of their own.

#[path = "../common/mod.rs"]
mod common;
#[path = "../netns/mod.rs"]
mod netns;
#[path = "../swarm/mod.rs"]
mod swarm;

mod allreduce_sim;
mod averager;
mod cli;
mod collective_cli;
mod dht_swarm;
mod diloco;
mod error_feedback;
mod fuzz_corpora;
mod group;
mod hostile_input;
mod links;
mod matchmaking_sim;
mod monitor;
mod nat;
mod p2p_swarm;
mod pending_tensors;
mod private_swarm;
mod progress_swarm;
mod reach_links;
mod review_regressions;
mod rpc;
mod runner;
mod state_sharing;
mod tls_link;
mod wan_sim;

/// The swarm tests of `averager` and `group` run one at a time: each starts a swarm of real
/// nodes whose matchmaking runs on short windows, and on a 2-core machine two of them at once
/// slow its messages past their timeouts, which is a different scenario from the one a test
/// means to check. (Before the tests shared one binary each file had its own lock, and binaries
/// ran one after another.)
pub(crate) async fn serial_swarms() -> tokio::sync::MutexGuard<'static, ()> {
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    SERIAL.lock().await
}
