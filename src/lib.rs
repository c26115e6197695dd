//! nodeproxy: a kube-proxy replacement that programs nftables through netlink transactions.
//!
//! Data flows one way: `source` (files or the API) → `model` (validated cluster state) →
//! `ruleset` (pure desired state, rendered as nft text or lowered for the kernel) → `nft` (the
//! only module that talks netlink).

pub mod cli;
pub mod config;
pub mod conntrack;
pub mod daemon;
pub mod explain;
pub mod health;
pub mod http;
pub mod leftovers;
pub mod lock;
pub mod metrics;
pub mod model;
pub mod nft;
pub mod notify;
pub mod ruleset;
pub mod source;
pub mod sync;
