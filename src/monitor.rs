//! `hivemesh monitor`: a live web page of a training run, for the people who run it and the
//! volunteers who join it.
//!
//! # What it reads
//!
//! A monitor is a DHT client in the swarm (it publishes nothing). Every `refresh_period` it
//! fetches the run's two owned keys in one request:
//!
//! * the progress records every training peer publishes ([`crate::train`]), whose tracker's
//!   prefix is `"{run_id}_progress"` ([`progress_prefix`]) as hivemind's `Optimizer` names it,
//!   so their key is `"{run_id}_progress_progress"`. They go through a [`ProgressCore`](crate::train::ProgressCore) in
//!   client mode, which never reports: the same parsing, validation (typed errors, no records
//!   from the future, none past their lifetime) and bounds as every peer applies, so the
//!   global epoch, samples, peers, clients and ETA are the ones the peers compute.
//! * `"{run_id}_metrics"`: the optional [`PeerMetrics`](crate::train::PeerMetrics) records
//!   (loss, reachability, mode, averaging rounds, last group size, a display name, the target
//!   batch size), decoded just as strictly, with the same lifetime rule.
//!
//! # What it keeps (bounded whatever the swarm sends)
//!
//! [`MonitorState`] (sans-IO, tested in virtual time) holds:
//!
//! * a **peer table** of at most `max_peers` rows: a peer is live while its progress or
//!   metrics record is; one whose records are withdrawn or expired is marked **gone** (when
//!   the monitor noticed) and kept for `gone_retention`, so a person sees that it left. A
//!   newcomer that finds the table full takes the row of the peer that left longest ago; live
//!   peers are never evicted for newcomers (a flood of new identities cannot push out the
//!   peers that were there), and the live peers left out are counted (`untracked_peers`);
//! * a **history** of the last `history_len` fetches (one point each: epoch, peers, clients,
//!   the swarm's claimed samples/s, mean loss, rounds finished and failed since the previous
//!   point, mean last group size), the charts' data;
//! * counters (fetches, malformed records ignored).
//!
//! The rounds come from the peers' own counters (what a counter grew by between two fetches;
//! a counter that went down is a restart), so they are claims, as the rates are: the monitor
//! shows what peers say, and the training rules ([`crate::train`]) bound what counts. The
//! target batch size, for the ETA, is `--target-batch-size` or else the lower median of what
//! the peers' metrics say (one peer cannot move it).
//!
//! # What it serves
//!
//! [`serve`] (axum) answers `/` (the page), `/app.js` (its script) and `/api/state` (the
//! [`Snapshot`] as JSON, the same data the page draws). The page polls the JSON every second
//! and draws the summary, the peer table and four charts (hand-written SVG: no library, no
//! CDN, works offline). Every string from the network is put in the page as text
//! (`textContent`, attributes), never as HTML, and the page's Content-Security-Policy allows
//! no script but its own.

mod server;
mod shell;
mod state;

#[cfg(test)]
mod tests;

pub use server::{MonitorServer, serve};
pub use shell::{Monitor, MonitorError, MonitorNode, MonitorOptions, progress_prefix};
pub use state::{
    ApplySummary, GlobalView, HistoryPoint, MonitorConfig, MonitorState, PeerView, Snapshot,
};
