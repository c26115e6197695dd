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
//! verification sync reads our tables back, so drift is repaired within one period. A failed sync
//! is retried with a verification sync after a backoff capped at `sync_period`.
//!
//! The health-check node ports and the UDP conntrack reconciler run on the sync thread after a
//! successful sync: both depend on what was just programmed, and the reconciler's netlink calls
//! block too.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use tokio::runtime::Handle;
use tokio::sync::{oneshot, watch as tokio_watch};

use crate::config::{Config, ConfigError};
use crate::conntrack::{self, UdpService};
use crate::health::{HealthCheckServers, HealthCheckService, ProxyHealth};
use crate::http::{self, Handler, HttpServer};
use crate::leftovers::{self, LeftoverError};
use crate::lock::{self, LockError};
use crate::metrics::{Metrics, PolicyKind, SyncKind};
use crate::model::{
    ClusterState, EndpointSlice, IpFamily, Protocol, ServicePortName, TrafficPolicy, endpoints_for,
};
use crate::nft::owner::{self, TakeOver};
use crate::nft::probe::{self, Missing};
use crate::nft::{Kernel, NetlinkKernel, NftError};
use crate::ruleset::Settings;
use crate::ruleset::categorize::{NodeView, categorize};
use crate::source::Loaded;
use crate::source::watch::{self, Changes, ClusterWatch, WatchError};
use crate::sync::{SyncOutcome, Syncer};

/// The first retry after a failed sync waits this long; each further failure doubles it, up to
/// the sync period.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);

/// How long a healthz or metrics server waits before binding its address again after a failure.
const REBIND_DELAY: Duration = Duration::from_secs(5);

/// Every family nodeproxy programs: the ruleset always has one table per family.
const FAMILIES: [IpFamily; 2] = IpFamily::ALL;

/// Why the daemon could not start or had to stop. Every one exits with status 1.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("opening the netlink socket: {0}")]
    Netlink(#[source] NftError),
    #[error("probing the kernel's nftables features: {0}")]
    Probe(#[source] NftError),
    #[error("the kernel lacks nftables features nodeproxy needs: {}", list_missing(.0))]
    MissingFeatures(Vec<Missing>),
    #[error("removing kube-proxy's leftovers (--cleanup-kube-proxy): {0}")]
    Leftovers(#[source] LeftoverError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("building the API client: {0}")]
    Client(#[from] WatchError),
    #[error("{context}: {source}")]
    Io {
        context: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the sync thread stopped unexpectedly")]
    SyncThread,
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
        let client = watch::client(config.kubeconfig.as_deref(), config.master.as_deref()).await?;
        let cluster = watch::spawn(client, node_name);
        tracing::info!("waiting for the API server's Services, EndpointSlices and Node");
        cluster.ready().await;
        Ok(Loaded {
            state: cluster.snapshot(),
            rejected: cluster.rejected(),
            ignored: Vec::new(),
        })
    })
}

/// Runs the daemon until SIGTERM or SIGINT; see the module documentation. Returns `Ok` on a
/// signal, leaving the rules in place.
pub fn run(config: &Config) -> Result<(), DaemonError> {
    let lock = lock::acquire(&config.lock_file)?;
    tracing::info!(lock = %lock.path().display(), "took the node lock");
    let mut kernel = NetlinkKernel::new().map_err(DaemonError::Netlink)?;
    let caps = probe::probe(&mut kernel).map_err(DaemonError::Probe)?;
    if !caps.complete() {
        for m in &caps.missing {
            tracing::error!("kernel feature missing: {m}");
        }
        return Err(DaemonError::MissingFeatures(caps.missing));
    }
    let ownership = caps.ownership();
    tracing::info!("{ownership}");
    handle_leftovers(&mut kernel, config.cleanup_kube_proxy)?;
    let node_name = config.node_name()?;
    let mut settings = Settings::new(config, node_name.clone());
    settings.own_tables = ownership.enabled();
    if ownership.enabled() {
        take_over_tables(&mut kernel);
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
            tracing::warn!("cannot check for kube-proxy leftovers: {e}");
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

/// One request to the sync thread.
struct Request {
    state: ClusterState,
    verify: bool,
    reply: oneshot::Sender<Result<Synced, NftError>>,
}

/// What the sync thread did for one request.
struct Synced {
    outcome: SyncOutcome,
    state: ClusterState,
    /// Per family: (internal, external) Local-policy Service ports without local endpoints.
    no_local: Vec<(IpFamily, usize, usize)>,
    /// Per family: UDP conntrack entries deleted.
    conntrack_deleted: Vec<(IpFamily, usize)>,
}

async fn run_async(
    config: &Config,
    kernel: NetlinkKernel,
    settings: Settings,
) -> Result<(), DaemonError> {
    let (shutdown_tx, shutdown_rx) = tokio_watch::channel(false);
    watch_signals(shutdown_tx)?;

    let client = watch::client(config.kubeconfig.as_deref(), config.master.as_deref()).await?;
    let mut cluster = watch::spawn(client, settings.node_name.clone());

    let health = ProxyHealth::new(config.health_timeout());
    // The first sync is queued from the start, as in kube-proxy: a proxy that never gets a
    // complete view of the cluster turns unhealthy after the health timeout.
    for f in FAMILIES {
        health.queued_update(f);
    }
    let metrics = Metrics::new();
    let mut servers = Vec::new();
    if let Some(addr) = config.healthz_bind_address {
        let handler = http::healthz_handler(health.clone(), metrics.clone());
        servers.push(tokio::spawn(serve(
            "healthz",
            addr,
            handler,
            shutdown_rx.clone(),
        )));
    }
    if let Some(addr) = config.metrics_bind_address {
        let handler = http::metrics_handler(metrics.clone());
        servers.push(tokio::spawn(serve(
            "metrics",
            addr,
            handler,
            shutdown_rx.clone(),
        )));
    }

    tracing::info!(node = %settings.node_name, "waiting for the API server's Services, EndpointSlices and Node before programming anything");
    let ready = tokio::select! {
        () = cluster.ready() => true,
        () = stopped(shutdown_rx.clone()) => false,
    };
    let result = if ready {
        tracing::info!("the watches have listed; programming the kernel");
        let (tx, rx) = mpsc::channel::<Request>();
        let writer = Writer::new(
            Syncer::new(kernel),
            settings.clone(),
            health.clone(),
            Handle::current(),
        );
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
        Ok(())
    };
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
                tracing::error!(%addr, "{what} server: {e}; retrying in {REBIND_DELAY:?}");
                tokio::select! {
                    () = tokio::time::sleep(REBIND_DELAY) => {}
                    () = stopped(shutdown.clone()) => return,
                }
            }
        }
    }
}

/// The timing of the sync loop.
#[derive(Debug, Clone, Copy)]
struct LoopConfig {
    min_sync_period: Duration,
    sync_period: Duration,
}

/// When the next sync runs, and of which kind; pure, so the coalescing is unit-tested.
#[derive(Debug, Clone)]
struct Schedule {
    cfg: LoopConfig,
    /// A change (or a failed sync) waits to be synced.
    pending: bool,
    /// The next sync reads the kernel back.
    verify: bool,
    last_start: Option<Instant>,
    retry_at: Option<Instant>,
    backoff: Duration,
    next_verify: Instant,
}

impl Schedule {
    fn new(cfg: LoopConfig, now: Instant) -> Schedule {
        Schedule {
            cfg,
            // The first sync is due at once, and verifies: the kernel may hold a previous
            // instance's rules, which are reconciled, not flushed.
            pending: true,
            verify: true,
            last_start: None,
            retry_at: None,
            backoff: Duration::ZERO,
            next_verify: now + cfg.sync_period,
        }
    }

    fn changed(&mut self) {
        self.pending = true;
    }

    /// When the next sync is due.
    fn due(&self, now: Instant) -> Instant {
        if !self.pending {
            return self.next_verify;
        }
        let mut at = self
            .last_start
            .map_or(now, |t| t + self.cfg.min_sync_period);
        if let Some(r) = self.retry_at {
            at = at.max(r);
        }
        at
    }

    /// A sync starts now; returns whether it verifies.
    fn start(&mut self, now: Instant) -> bool {
        if !self.pending {
            // Nothing changed: this is the periodic verification.
            self.verify = true;
        }
        self.last_start = Some(now);
        self.verify
    }

    fn succeeded(&mut self, started: Instant) {
        self.pending = false;
        self.verify = false;
        self.retry_at = None;
        self.backoff = Duration::ZERO;
        self.next_verify = started + self.cfg.sync_period;
    }

    /// Returns the delay before the retry.
    fn failed(&mut self, now: Instant) -> Duration {
        self.pending = true;
        self.verify = true;
        self.backoff = if self.backoff.is_zero() {
            FIRST_BACKOFF
        } else {
            self.backoff.saturating_mul(2)
        }
        .min(self.cfg.sync_period);
        self.retry_at = Some(now + self.backoff);
        self.backoff
    }
}

async fn sync_loop(
    cluster: &mut ClusterWatch,
    settings: &Settings,
    health: &ProxyHealth,
    metrics: &Metrics,
    cfg: LoopConfig,
    writer: mpsc::Sender<Request>,
    shutdown: tokio_watch::Receiver<bool>,
) -> Result<(), DaemonError> {
    let mut schedule = Schedule::new(cfg, Instant::now());
    // Changes taken for a sync that failed: they count for the retry.
    let mut carried = Changes::default();
    loop {
        let due = schedule.due(Instant::now());
        tokio::select! {
            biased;
            () = stopped(shutdown.clone()) => return Ok(()),
            () = cluster.changed() => {
                schedule.changed();
                for f in FAMILIES {
                    health.queued_update(f);
                }
                metrics.set_last_queued_timestamp(&FAMILIES, SystemTime::now());
                continue;
            }
            () = tokio::time::sleep_until(due.into()) => {}
        }
        let started = Instant::now();
        let verify = schedule.start(started);
        let state = cluster.snapshot();
        let mut changes = cluster.take_changes();
        merge(&mut changes, std::mem::take(&mut carried));
        if let Some(node) = state.nodes.get(&settings.node_name) {
            health.set_node(node.deleting, node.to_be_deleted);
        }
        let (reply, answer) = oneshot::channel();
        writer
            .send(Request {
                state,
                verify,
                reply,
            })
            .map_err(|_| DaemonError::SyncThread)?;
        // Not raced against shutdown: the transaction in flight always finishes.
        match answer.await.map_err(|_| DaemonError::SyncThread)? {
            Ok(synced) => {
                schedule.succeeded(started);
                record_success(&synced, &changes, health, metrics);
            }
            Err(e) => {
                let delay = schedule.failed(Instant::now());
                tracing::error!(
                    "sync failed: {e}; retrying with a full read-back in {:.1} s",
                    delay.as_secs_f64()
                );
                for f in FAMILIES {
                    metrics.inc_sync_failures(f);
                }
                carried = changes;
            }
        }
    }
}

fn merge(into: &mut Changes, from: Changes) {
    into.services += from.services;
    into.endpoint_slices += from.endpoint_slices;
    into.nodes += from.nodes;
    for (svc, times) in from.trigger_times {
        into.trigger_times.entry(svc).or_default().extend(times);
    }
}

/// Logs, health and metrics after a successful sync.
fn record_success(synced: &Synced, changes: &Changes, health: &ProxyHealth, metrics: &Metrics) {
    let outcome = &synced.outcome;
    let now = SystemTime::now();
    let changed = outcome.report.empty_plans < outcome.report.tables || outcome.drift_repaired;
    if changed {
        tracing::info!(
            "{outcome} ({} Service, {} EndpointSlice, {} Node change(s))",
            changes.services,
            changes.endpoint_slices,
            changes.nodes
        );
    } else {
        tracing::debug!("{outcome}: nothing to change");
    }
    for f in FAMILIES {
        health.updated(f);
    }
    health.set_quarantined(
        outcome
            .quarantined
            .iter()
            .map(|(name, _)| name.to_string())
            .collect(),
    );
    metrics.set_quarantined_services(outcome.quarantined.len());
    let kind = if outcome.full {
        SyncKind::Full
    } else {
        SyncKind::Partial
    };
    metrics.observe_sync(&FAMILIES, kind, outcome.duration);
    metrics.set_last_sync_timestamp(&FAMILIES, now);
    if outcome.report.messages > 0 {
        metrics.observe_transaction(outcome.report.messages, outcome.report.bytes);
    }
    for &f in &outcome.drift_families {
        tracing::warn!("our {f} table had been changed by someone else; repaired");
        metrics.inc_drift_repairs(f);
    }
    // nodeproxy programs both families in every sync, so each change is counted for each family,
    // as a dual-stack kube-proxy's two proxiers would (see `metrics`).
    for f in FAMILIES {
        metrics.add_service_changes(f, changes.services);
        metrics.add_endpoint_changes(f, changes.endpoint_slices);
    }
    for (svc, times) in &changes.trigger_times {
        let families: BTreeSet<IpFamily> = synced
            .state
            .slices
            .values()
            .filter(|s| &s.service == svc)
            .map(|s| s.family)
            .collect();
        for t in times {
            let Ok(latency) = now.duration_since(*t) else {
                continue;
            };
            for &f in &families {
                metrics.observe_network_programming(f, latency);
            }
        }
    }
    for &(f, internal, external) in &synced.no_local {
        metrics.set_no_local_endpoints(f, PolicyKind::Internal, internal);
        metrics.set_no_local_endpoints(f, PolicyKind::External, external);
    }
    for &(f, n) in &synced.conntrack_deleted {
        metrics.add_conntrack_deleted(f, n as u64);
    }
}

/// The sync thread's state: the one writer, plus what runs after each successful sync.
struct Writer<K: Kernel> {
    syncer: Syncer<K>,
    settings: Settings,
    health: ProxyHealth,
    runtime: Handle,
    /// The health-check node port servers and the addresses they were created for.
    health_checks: Option<(Vec<IpAddr>, HealthCheckServers)>,
    /// Serving endpoints of each UDP Service port at the last successful sync; `None` before the
    /// first, so that the first sync reconciles (stale entries may predate a restart).
    udp_last: Option<UdpEndpoints>,
}

type UdpEndpoints = BTreeMap<(IpFamily, ServicePortName), BTreeSet<IpAddr>>;

impl<K: Kernel> Writer<K> {
    fn new(syncer: Syncer<K>, settings: Settings, health: ProxyHealth, runtime: Handle) -> Self {
        Writer {
            syncer,
            settings,
            health,
            runtime,
            health_checks: None,
            udp_last: None,
        }
    }

    fn serve(mut self, requests: mpsc::Receiver<Request>) {
        while let Ok(req) = requests.recv() {
            let result = self.handle(req.state, req.verify);
            // The loop only stops waiting for a reply when the daemon is exiting.
            let _ = req.reply.send(result);
        }
    }

    fn handle(&mut self, state: ClusterState, verify: bool) -> Result<Synced, NftError> {
        let outcome = self.syncer.sync(&state, &self.settings, verify)?;
        self.sync_health_checks(&state);
        let conntrack_deleted = self.reconcile_conntrack(&state);
        let no_local = FAMILIES
            .into_iter()
            .map(|f| {
                let (i, e) = no_local_endpoints(&state, &self.settings.node_name, f);
                (f, i, e)
            })
            .collect();
        Ok(Synced {
            outcome,
            state,
            no_local,
            conntrack_deleted,
        })
    }

    fn sync_health_checks(&mut self, state: &ClusterState) {
        let wanted = health_check_services(state, &self.settings.node_name);
        if wanted.is_empty() && self.health_checks.is_none() {
            return;
        }
        let Some(addrs) = health_check_addresses(state, &self.settings) else {
            if !wanted.is_empty() {
                tracing::warn!(
                    "no address of node {} is selected by --nodeport-addresses: health-check \
                     node ports are not served",
                    self.settings.node_name
                );
            }
            self.health_checks = None;
            return;
        };
        let servers = match &mut self.health_checks {
            Some((bound, servers)) if *bound == addrs => servers,
            slot => {
                // New addresses (or the first time): listeners on the old ones close.
                let servers = HealthCheckServers::new(
                    addrs.clone(),
                    self.health.clone(),
                    self.runtime.clone(),
                );
                &mut slot.insert((addrs, servers)).1
            }
        };
        servers.sync(wanted);
    }

    fn reconcile_conntrack(&mut self, state: &ClusterState) -> Vec<(IpFamily, usize)> {
        let current = udp_endpoints(state);
        let mut out = Vec::new();
        for f in FAMILIES {
            let changed = match &self.udp_last {
                None => true,
                Some(last) => differs(last, &current, f),
            };
            if !changed {
                continue;
            }
            let services = udp_services(state, f);
            match conntrack::reconcile_udp(f, &services) {
                Ok(0) => {}
                Ok(n) => {
                    tracing::info!("deleted {n} stale {f} UDP conntrack entr(y/ies)");
                    out.push((f, n));
                }
                Err(e) => tracing::warn!("UDP conntrack reconciliation ({f}): {e}"),
            }
        }
        self.udp_last = Some(current);
        out
    }
}

/// Whether the serving endpoints of any UDP Service port of `family` differ.
fn differs(a: &UdpEndpoints, b: &UdpEndpoints, family: IpFamily) -> bool {
    let of = |m: &'_ UdpEndpoints| -> Vec<(ServicePortName, BTreeSet<IpAddr>)> {
        m.iter()
            .filter(|((f, _), _)| *f == family)
            .map(|((_, n), eps)| (n.clone(), eps.clone()))
            .collect()
    };
    of(a) != of(b)
}

fn slices_of<'a>(
    index: &std::collections::HashMap<&crate::model::ServiceName, Vec<&'a EndpointSlice>>,
    svc: &crate::model::ServiceName,
    family: IpFamily,
) -> Vec<&'a EndpointSlice> {
    index
        .get(svc)
        .map(|v| v.iter().copied().filter(|s| s.family == family).collect())
        .unwrap_or_default()
}

/// Serving endpoints (ready, or terminating but serving) of every UDP Service port, per family.
fn udp_endpoints(state: &ClusterState) -> UdpEndpoints {
    let index = state.slices_by_service();
    let mut out = UdpEndpoints::new();
    for svc in state.services.values() {
        for f in FAMILIES {
            if svc.cluster_ip(f).is_none() {
                continue;
            }
            let slices = slices_of(&index, &svc.name, f);
            for port in svc.ports.iter().filter(|p| p.protocol == Protocol::Udp) {
                let eps = endpoints_for(&slices, port)
                    .iter()
                    .filter(|ep| ep.conditions.ready || ep.conditions.serving)
                    .map(|ep| ep.addr)
                    .collect();
                out.insert((f, svc.port_name(port)), eps);
            }
        }
    }
    out
}

/// What the conntrack reconciler needs for every UDP Service port of `family`.
fn udp_services(state: &ClusterState, family: IpFamily) -> Vec<UdpService> {
    let index = state.slices_by_service();
    let mut out = Vec::new();
    for svc in state.services.values() {
        let Some(cluster_ip) = svc.cluster_ip(family) else {
            continue;
        };
        let ips: Vec<IpAddr> = std::iter::once(cluster_ip)
            .chain(svc.external_ips.iter().copied())
            .chain(svc.load_balancer_ips.iter().copied())
            .filter(|ip| IpFamily::of(ip) == family)
            .collect();
        let slices = slices_of(&index, &svc.name, family);
        for port in svc.ports.iter().filter(|p| p.protocol == Protocol::Udp) {
            let serving_endpoints = endpoints_for(&slices, port)
                .iter()
                .filter(|ep| ep.conditions.ready || ep.conditions.serving)
                .map(|ep| ep.addr)
                .collect();
            out.push(UdpService {
                ips: ips.clone(),
                port: port.port,
                node_port: port.node_port,
                serving_endpoints,
            });
        }
    }
    out
}

/// The `externalTrafficPolicy: Local` Services with a health-check node port, with their ready
/// endpoints on this node (terminating ones do not count, so a draining node fails the check).
/// An endpoint is counted once however many ports it serves.
fn health_check_services(state: &ClusterState, node_name: &str) -> Vec<HealthCheckService> {
    let index = state.slices_by_service();
    let mut out = Vec::new();
    for svc in state.services.values() {
        if svc.external_traffic_policy != TrafficPolicy::Local {
            continue;
        }
        let Some(port) = svc.health_check_node_port else {
            continue;
        };
        let slices = index.get(&svc.name).map(Vec::as_slice).unwrap_or_default();
        let mut local = BTreeSet::new();
        for p in &svc.ports {
            for ep in endpoints_for(slices, p) {
                if ep.node_name == Some(node_name) && ep.conditions.ready {
                    local.insert(ep.addr);
                }
            }
        }
        out.push(HealthCheckService {
            namespace: svc.name.namespace.clone(),
            name: svc.name.name.clone(),
            port,
            local_endpoints: local.len(),
        });
    }
    out
}

/// Where the health-check node ports listen: the Node's addresses that `--nodeport-addresses`
/// selects (the same addresses NodePorts answer on), or every address for `all`. `None` when
/// nothing is selected (the Node has no matching address, or is not known yet).
fn health_check_addresses(state: &ClusterState, settings: &Settings) -> Option<Vec<IpAddr>> {
    let npa = &settings.nodeport_addresses;
    if FAMILIES.iter().all(|&f| npa.all_of(f)) {
        return Some(Vec::new());
    }
    let node = state.nodes.get(&settings.node_name)?;
    let addrs: Vec<IpAddr> = node
        .internal_ips
        .iter()
        .chain(&node.external_ips)
        .copied()
        .filter(|ip| {
            let f = IpFamily::of(ip);
            !ip.is_loopback() && npa.selects(*ip, node.primary_ip(f) == Some(*ip))
        })
        .collect();
    (!addrs.is_empty()).then_some(addrs)
}

/// `(internal, external)`: how many Service ports of `family` with a Local traffic policy have
/// endpoints, but none on this node (kube-proxy's `no_local_endpoints_total` gauges). External
/// policy only counts for ports reachable from outside (NodePort, external or LB IPs).
fn no_local_endpoints(state: &ClusterState, node_name: &str, family: IpFamily) -> (usize, usize) {
    let index = state.slices_by_service();
    let node = state.nodes.get(node_name);
    let view = NodeView {
        name: node_name,
        zone: node.and_then(|n| n.zone.as_deref()),
    };
    let (mut internal, mut external) = (0, 0);
    for svc in state.services.values() {
        if svc.cluster_ip(family).is_none() {
            continue;
        }
        let slices = slices_of(&index, &svc.name, family);
        let external_ips = svc
            .external_ips
            .iter()
            .chain(&svc.load_balancer_ips)
            .any(|ip| IpFamily::of(ip) == family);
        for port in &svc.ports {
            let eps = endpoints_for(&slices, port);
            let c = categorize(&eps, &view);
            if !c.has_endpoints || !c.local.is_empty() {
                continue;
            }
            if svc.internal_traffic_policy == TrafficPolicy::Local {
                internal += 1;
            }
            if svc.external_traffic_policy == TrafficPolicy::Local
                && (port.node_port.is_some() || external_ips)
            {
                external += 1;
            }
        }
    }
    (internal, external)
}

#[cfg(test)]
mod tests;
