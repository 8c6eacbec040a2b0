//! hivemesh: peer-to-peer decentralized averaging.
#![warn(missing_docs)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod allreduce;
pub mod compression;
pub mod dht;
pub mod sim;
pub mod tensor;
pub mod wire;
