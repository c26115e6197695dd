//! The daemon: `nodeproxy` without `--dry-run`, `--once` or `--cleanup`. Watches the API server
//! and keeps the kernel in sync, with health and metrics servers alongside.
//!
//! Start-up order, each step a precondition of the next: the node lock (two writers would undo
//! each other's transactions), the netlink socket, the capability probe (a kernel missing a
//! feature would reject the first sync half-way through a rollout), taking over the tables a
//! previous instance left (table ownership, `nft::owner`), kube-proxy leftovers (their
//! rules run before or after ours and silently change where traffic goes), the API client, the
//! watches, the HTTP servers. Nothing is programmed before every watch has listed once: a partial
//! view would delete live Services.
//!
//! One writer: the [`Syncer`] lives on a dedicated OS thread (netlink calls block) and receives
//! sync requests over a channel; the async side only decides *when* to sync. Changes are
//! coalesced: after a change, the next sync starts once `min_sync_period` has passed since the
//! previous one started, and covers everything that arrived meanwhile. Every `sync_period` a
//! verification compares the nftables generation with the one our last transaction left and,
//! if anyone else committed, reads our tables back and rebuilds everything (while changes keep
//! coming, the change sync due then does it, and stays incremental when nobody else
//! committed), so drift is repaired within one period. A failed sync is retried with a
//! verification sync after a backoff capped at `sync_period`.
//!
//! A sync costs what changed, not the cluster's size: the watch records which Services changed,
//! and the sync thread gets only those (with their slices and the Nodes, not a copy of the
//! cluster) unless everything must be synced anyway (the first sync, verification, a retry, a
//! Node change, too many changes), or the syncer finds it cannot sync them alone; the sync thread
//! then takes a snapshot of the whole state itself.
//!
//! The health-check node ports and the UDP conntrack reconciler run on the sync thread after a
//! successful sync: both depend on what was just programmed, and the reconciler's netlink calls
//! block too. What they need from each Service is cached per Service (`derived`), so a sync of a
//! few Services recomputes only theirs.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use tokio::runtime::Handle;
use tokio::sync::{oneshot, watch as tokio_watch};

use crate::config::{Config, ConfigError, TableOwnership};
use crate::conntrack::{self, ConntrackError, UdpService};
use crate::health::{self, HealthCheckServers, ProxyHealth};
use crate::http::{Handler, HttpError, HttpServer};
use crate::lock::{self, LockError};
use crate::metrics::{self, Metrics, PolicyKind, SyncKind};
use crate::model::{ClusterState, IpFamily, ServiceName};
use crate::nft::fault::Faulty;
use crate::nft::leftovers::{self, LeftoverError};
use crate::nft::owner::{self, Ownership, TakeOver};
use crate::nft::probe::{self, Missing};
use crate::nft::{Kernel, NetlinkKernel, NftError, ReplyKind};
use crate::notify::{self, Progress};
use crate::report;
use crate::ruleset::Settings;
use crate::source::Loaded;
use crate::source::watch::{self, Changes, ClusterWatch, WatchError};
use crate::sync::{Incremental, SyncOutcome, Syncer};

mod derived;
mod events;
mod schedule;
mod writer;

use derived::{Caches, Delta};
use schedule::{LoopConfig, sync_loop};
use writer::{Reply, Request, Synced, Work, Writer};

/// The first retry after a failed sync waits this long; each further failure doubles it, up to
/// the sync period.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);

/// A periodic verification that finds the ruleset generation unchanged skips the read-back, but
/// rebuilds every Service and compares with what was applied at least this often (kube-proxy's
/// nftables mode forces a full sync hourly too): a last guard against a bug in the incremental
/// bookkeeping, at a cost of a few hundred ms per hour at 10k Services.
const FULL_REBUILD_PERIOD: Duration = Duration::from_secs(3600);

/// How long a healthz or metrics server waits before binding its address again after a failure.
const REBIND_DELAY: Duration = Duration::from_secs(5);

/// Every family nodeproxy programs: the ruleset always has one table per family.
const FAMILIES: [IpFamily; 2] = IpFamily::ALL;

/// Why the daemon could not start or had to stop. Every one exits with status 1.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("opening the netlink socket")]
    Netlink(#[source] NftError),
    #[error("probing the kernel's nftables features")]
    Probe(#[source] NftError),
    #[error("the kernel lacks nftables features nodeproxy needs: {}", list_missing(.0))]
    MissingFeatures(Vec<Missing>),
    #[error("removing kube-proxy's leftovers (--cleanup-kube-proxy)")]
    Leftovers(#[source] LeftoverError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("building the API client")]
    Client(#[from] WatchError),
    #[error("{context}")]
    Io {
        context: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the sync thread stopped unexpectedly")]
    SyncThread,
    #[error("{what} server (--bind-address-hard-fail)")]
    Bind {
        what: &'static str,
        #[source]
        source: HttpError,
    },
}

impl DaemonError {
    /// Whether the operator has to fix it (exit 2): the configuration, or no usable way to reach
    /// the API server (no kubeconfig and not in a pod, a kubeconfig that does not load, a
    /// `--master` that is not a URL).
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            DaemonError::Config(_)
                | DaemonError::Client(
                    WatchError::InCluster { .. }
                        | WatchError::Kubeconfig { .. }
                        | WatchError::Master { .. }
                )
        )
    }
}

fn list_missing(missing: &[Missing]) -> String {
    missing
        .iter()
        .map(Missing::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

fn io_err(context: &'static str) -> impl FnOnce(io::Error) -> DaemonError {
    move |source| DaemonError::Io { context, source }
}

fn runtime() -> Result<tokio::runtime::Runtime, DaemonError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("nodeproxy-rt")
        .enable_all()
        .build()
        .map_err(io_err("starting the async runtime"))
}

/// Reads the cluster from the API server once (`--dry-run` without `--from-file`): waits until
/// every watch has listed, then returns what it saw, like a file source would.
pub fn fetch(config: &Config) -> Result<Loaded, DaemonError> {
    let node_name = config.node_name()?;
    runtime()?.block_on(async {
        let client = watch::client(
            config.kubeconfig.as_deref(),
            config.master.as_deref(),
            config.request_rate(),
        )
        .await?;
        let cluster = watch::spawn(client, node_name);
        tracing::info!("waiting for the API server's Services, EndpointSlices and Node");
        cluster.ready().await;
        let rejected = cluster.rejected();
        Ok(Loaded {
            state: cluster.into_state(),
            rejected,
            ignored: Vec::new(),
            replaced: Vec::new(),
            dropped: Vec::new(),
        })
    })
}

/// Runs the daemon until SIGTERM or SIGINT; see the module documentation. Returns `Ok` on a
/// signal, leaving the rules in place.
pub fn run(config: &Config) -> Result<(), DaemonError> {
    let lock = lock::acquire(&config.lock_file)?;
    tracing::info!(lock = %lock.path().display(), "took the node lock");
    // As kube-proxy: each value is written only when it differs, so an unprivileged pod whose
    // privileged init container (`--init-only`) did the work has nothing to write and gets no
    // warning; what it cannot write is logged, never fatal.
    crate::node_setup::set_up_host(&config.conntrack(), config.oom_score_adj);
    let mut kernel = NetlinkKernel::new().map_err(DaemonError::Netlink)?;
    let caps = probe::probe(&mut kernel).map_err(DaemonError::Probe)?;
    if !caps.complete() {
        for m in &caps.missing {
            tracing::error!("kernel feature missing: {m}");
        }
        return Err(DaemonError::MissingFeatures(caps.missing));
    }
    let ownership = match config.table_ownership {
        TableOwnership::Auto => caps.ownership(),
        TableOwnership::Off => Ownership::Off,
    };
    tracing::info!("{ownership}");
    handle_leftovers(&mut kernel, config.cleanup_kube_proxy)?;
    let node_name = config.node_name()?;
    let mut settings = Settings::new(config, node_name.clone());
    settings.own_tables = ownership.enabled();
    if ownership.enabled() {
        take_over_tables(&mut kernel);
    } else if config.table_ownership == TableOwnership::Off {
        let persisted = owner::persisted(&mut kernel, crate::ruleset::names::TABLE);
        if let Some(warning) = owner::persisted_warning(&persisted, crate::ruleset::names::TABLE) {
            tracing::warn!("{warning}");
        }
    }
    let rt = runtime()?;
    let result = rt.block_on(run_async(config, kernel, settings));
    // The servers' connections get DRAIN_TIMEOUT inside `run_async`; whatever is left (an API
    // request in flight) must not delay the exit.
    rt.shutdown_timeout(Duration::from_secs(1));
    drop(lock);
    result
}

/// Claims the tables a previous nodeproxy left orphaned (see [`owner::take_over`]), logging each
/// family's state. Never fatal: the syncs deal with whatever is left.
fn take_over_tables(kernel: &mut NetlinkKernel) {
    for (family, state) in owner::take_over(kernel, crate::ruleset::names::TABLE) {
        let table = format!(
            "table {} {}",
            crate::nft::wire::family_keyword(family),
            crate::ruleset::names::TABLE
        );
        match state {
            TakeOver::Absent | TakeOver::Ours => tracing::debug!("{table} {state}"),
            TakeOver::Claimed => tracing::info!("{table} {state}"),
            TakeOver::ClaimFailed(_) | TakeOver::OwnedByOther(_) | TakeOver::Unclaimable => {
                tracing::warn!("{table} {state}")
            }
        }
    }
}

/// Reports kube-proxy's leftovers, and removes them when asked to. Detection failing is only a
/// warning: the leftovers are a hazard to point out, not a precondition of our own rules.
fn handle_leftovers(kernel: &mut NetlinkKernel, cleanup: bool) -> Result<(), DaemonError> {
    let found = match leftovers::detect_with(kernel) {
        Ok(found) => found,
        Err(e) => {
            tracing::warn!(
                "cannot check for kube-proxy leftovers: {}",
                report::chain(&e)
            );
            return Ok(());
        }
    };
    if found.is_empty() {
        return Ok(());
    }
    for l in &found {
        tracing::warn!("kube-proxy leftover: {l}");
    }
    if !cleanup {
        tracing::warn!(
            "kube-proxy's rules are still installed and may take traffic before nodeproxy's; \
             restart with --cleanup-kube-proxy to remove them"
        );
        return Ok(());
    }
    let removed = leftovers::remove_with(kernel, &found).map_err(DaemonError::Leftovers)?;
    tracing::info!(
        "removed kube-proxy leftovers: {} table(s), {} chain(s), {} jump rule(s)",
        removed.tables,
        removed.chains,
        removed.jump_rules
    );
    for s in &removed.skipped {
        tracing::warn!("cannot remove without other tools: {s}");
    }
    Ok(())
}

async fn run_async(
    config: &Config,
    kernel: NetlinkKernel,
    settings: Settings,
) -> Result<(), DaemonError> {
    let (shutdown_tx, shutdown_rx) = tokio_watch::channel(false);
    watch_signals(shutdown_tx)?;

    let client = watch::client(
        config.kubeconfig.as_deref(),
        config.master.as_deref(),
        config.request_rate(),
    )
    .await?;
    let metrics = Metrics::new();
    let events = events::spawn(client.clone(), &settings.node_name, metrics.clone());
    events.send(events::Notice::starting(&settings.node_name));
    let mut cluster = watch::spawn(client, settings.node_name.clone());

    let health = ProxyHealth::new(config.health_timeout());
    // The first sync is queued from the start, as in kube-proxy: a proxy that never gets a
    // complete view of the cluster turns unhealthy after the health timeout.
    for f in FAMILIES {
        health.queued_update(f);
    }
    let mut servers = Vec::new();
    let hard_fail = config.bind_address_hard_fail;
    if let Some(addr) = config.healthz_bind_address {
        let handler = health::healthz_handler(health.clone(), metrics.clone());
        servers.push(start_server("healthz", addr, handler, &shutdown_rx, hard_fail).await?);
    }
    if let Some(addr) = config.metrics_bind_address {
        let handler = metrics::handler(metrics.clone());
        servers.push(start_server("metrics", addr, handler, &shutdown_rx, hard_fail).await?);
    }

    // The watchdog reads the writer's progress (see `notify`); started before the first sync so
    // that a hang in it is caught too.
    let progress = Progress::default();
    let watchdog = notify::watchdog_interval(&|name| std::env::var(name).ok()).map(|interval| {
        tracing::info!(
            "systemd watchdog: pinging every {:.1} s while the sync thread makes progress",
            interval.as_secs_f64() / 2.0
        );
        tokio::spawn(notify::watchdog(progress.clone(), interval))
    });

    tracing::info!(node = %settings.node_name, "waiting for the API server's Services, EndpointSlices and Node before programming anything");
    notify::status("waiting for the API server's Services, EndpointSlices and Node");
    let ready = tokio::select! {
        () = cluster.ready() => true,
        () = stopped(shutdown_rx.clone()) => false,
    };
    let result = if ready {
        tracing::info!("the watches have listed; programming the kernel");
        let (tx, rx) = mpsc::channel::<Request>();
        let reader = cluster.reader();
        let mut writer = Writer::new(
            Syncer::new(Faulty::from_env(kernel)),
            settings.clone(),
            health.clone(),
            Handle::current(),
            Box::new(move || reader.snapshot()),
        );
        writer.progress = progress;
        writer.events = events.clone();
        writer.hang_switch = std::env::var_os(notify::HANG_WRITER_ENV).map(Into::into);
        let thread = std::thread::Builder::new()
            .name("nodeproxy-sync".into())
            .spawn(move || writer.serve(rx))
            .map_err(io_err("starting the sync thread"))?;
        let loop_config = LoopConfig {
            min_sync_period: config.min_sync_period,
            sync_period: config.sync_period,
        };
        let result = sync_loop(
            &mut cluster,
            &settings,
            &health,
            &metrics,
            loop_config,
            tx,
            shutdown_rx.clone(),
        )
        .await;
        // `tx` was moved into the loop and is dropped now: the thread ends after its request
        // in flight. Joining off the async workers keeps the servers draining meanwhile.
        let joined = tokio::task::spawn_blocking(move || thread.join()).await;
        if !matches!(joined, Ok(Ok(()))) {
            tracing::error!("the sync thread ended abnormally");
        }
        result
    } else {
        notify::stopping();
        Ok(())
    };
    if let Some(watchdog) = watchdog {
        watchdog.abort();
    }
    drop(cluster);
    for s in servers {
        let _ = s.await;
    }
    tracing::info!("stopped; the rules stay in place");
    result
}

/// Sets the shutdown flag on SIGTERM or SIGINT.
fn watch_signals(shutdown: tokio_watch::Sender<bool>) -> Result<(), DaemonError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).map_err(io_err("installing SIGTERM handler"))?;
    let mut int = signal(SignalKind::interrupt()).map_err(io_err("installing SIGINT handler"))?;
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!("{name} received: finishing the sync in flight, then exiting");
        shutdown.send_replace(true);
    });
    Ok(())
}

/// Resolves once shutdown was requested (or the flag's sender is gone).
async fn stopped(mut rx: tokio_watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// Serves one of the HTTP endpoints until shutdown. A bind failure is logged (naming the
/// address) and retried every [`REBIND_DELAY`], and is not fatal: the rules matter more than
/// their observability, and kube-proxy behaves the same way. `/healthz` failing to bind shows
/// up as a failing health probe, which is the right signal for the operator.
/// Starts one server: with `hard_fail` (kube-proxy's `--bind-address-hard-fail`) a port that
/// cannot be bound ends the daemon, before anything is programmed; otherwise see [`serve`].
async fn start_server(
    what: &'static str,
    addr: SocketAddr,
    handler: Handler,
    shutdown: &tokio_watch::Receiver<bool>,
    hard_fail: bool,
) -> Result<tokio::task::JoinHandle<()>, DaemonError> {
    if !hard_fail {
        return Ok(tokio::spawn(serve(what, addr, handler, shutdown.clone())));
    }
    let server = HttpServer::bind(addr, handler)
        .await
        .map_err(|source| DaemonError::Bind { what, source })?;
    tracing::info!(%addr, "serving {what}");
    let shutdown = shutdown.clone();
    Ok(tokio::spawn(async move {
        server.run(stopped(shutdown)).await;
    }))
}

async fn serve(
    what: &'static str,
    addr: SocketAddr,
    handler: Handler,
    shutdown: tokio_watch::Receiver<bool>,
) {
    loop {
        match HttpServer::bind(addr, handler.clone()).await {
            Ok(server) => {
                tracing::info!(%addr, "serving {what}");
                server.run(stopped(shutdown)).await;
                return;
            }
            Err(e) => {
                tracing::error!(
                    %addr,
                    "{what} server: {}; retrying in {REBIND_DELAY:?}",
                    report::chain(&e)
                );
                tokio::select! {
                    () = tokio::time::sleep(REBIND_DELAY) => {}
                    () = stopped(shutdown.clone()) => return,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
