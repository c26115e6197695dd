//! nodeproxy: a kube-proxy replacement that programs nftables through netlink transactions.
//!
//! Data flows one way: `source` (files or the API) → `model` (validated cluster state) →
//! `ruleset` (pure desired state, rendered as nft text or lowered for the kernel) → `nft` (the
//! only module that speaks nf_tables) → `sync` (the single writer) → `daemon`. `netlink` is the
//! transport `nft` and `conntrack` (ctnetlink) share. `docs/architecture.md` maps the rest.

pub mod address_hash;
pub mod cli;
pub mod config;
pub mod conntrack;
pub mod daemon;
pub mod explain;
pub mod health;
pub mod http;
pub mod lock;
pub mod metrics;
pub mod model;
pub mod netlink;
pub mod nft;
pub mod node_setup;
pub mod notify;
pub mod oneshot;
pub mod report;
pub mod ruleset;
pub mod source;
pub mod sync;
pub mod token_bucket;
