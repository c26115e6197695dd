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
//! verification sync reads our tables back (the change sync due then, while changes keep
//! coming), so drift is repaired within one period. A failed sync
//! is retried with a verification sync after a backoff capped at `sync_period`.
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
use crate::http::{Handler, HttpServer};
use crate::lock::{self, LockError};
use crate::metrics::{self, Metrics, PolicyKind, SyncKind};
use crate::model::{ClusterState, IpFamily, ServiceName};
use crate::nft::leftovers::{self, LeftoverError};
use crate::nft::owner::{self, Ownership, TakeOver};
use crate::nft::probe::{self, Missing};
use crate::nft::{Kernel, NetlinkKernel, NftError, ReplyKind};
use crate::notify::{self, Progress};
use crate::ruleset::Settings;
use crate::source::Loaded;
use crate::source::watch::{self, Changes, ClusterWatch, WatchError};
use crate::sync::{Incremental, SyncOutcome, Syncer};

mod derived;

use derived::{Caches, Delta};

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
    work: Work,
    reply: oneshot::Sender<Reply>,
}

/// The writer's answer: the sync's result, and the kinds of the operations the kernel rejected
/// on the way (also when a retry or a quarantine made the sync succeed).
struct Reply {
    result: Result<Synced, NftError>,
    rejected: Vec<ReplyKind>,
}

/// What the sync thread is asked to sync.
enum Work {
    /// Every Service, from the whole state; `verify` reads the kernel back first.
    Full { state: ClusterState, verify: bool },
    /// Only the `changed` Services, from `scoped` (`ClusterState::subset(changed)` of the
    /// state). If the syncer cannot do that, the sync thread syncs everything from a snapshot it
    /// takes itself.
    Changed {
        scoped: ClusterState,
        changed: BTreeSet<ServiceName>,
    },
    /// The periodic verification with nothing changed: repair whatever someone else changed.
    /// The sync thread takes a snapshot only if the kernel's ruleset generation says someone
    /// did (or a full rebuild is overdue).
    Verify,
}

impl Work {
    /// The state the request carries: whole or scoped, it has the Nodes.
    fn state(&self) -> Option<&ClusterState> {
        match self {
            Work::Full { state, .. } => Some(state),
            Work::Changed { scoped, .. } => Some(scoped),
            Work::Verify => None,
        }
    }
}

/// What the sync thread did for one request.
struct Synced {
    outcome: SyncOutcome,
    /// Which path ran: every Service rebuilt (or the kernel read back), or only the changed ones.
    kind: SyncKind,
    /// How many Services were rebuilt.
    rebuilt: usize,
    /// The state synced: whole, or scoped to the changed Services.
    state: ClusterState,
    /// Per family: (internal, external) Local-policy Service ports without local endpoints.
    no_local: Vec<(IpFamily, usize, usize)>,
    /// Per family: UDP conntrack entries deleted.
    conntrack_deleted: Vec<(IpFamily, usize)>,
    /// Address and port claims lost to another Service at the last full sync.
    address_conflicts: usize,
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
        let handler = health::healthz_handler(health.clone(), metrics.clone());
        servers.push(tokio::spawn(serve(
            "healthz",
            addr,
            handler,
            shutdown_rx.clone(),
        )));
    }
    if let Some(addr) = config.metrics_bind_address {
        let handler = metrics::handler(metrics.clone());
        servers.push(tokio::spawn(serve(
            "metrics",
            addr,
            handler,
            shutdown_rx.clone(),
        )));
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
            Syncer::new(kernel),
            settings.clone(),
            health.clone(),
            Handle::current(),
            Box::new(move || reader.snapshot()),
        );
        writer.progress = progress;
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
    /// The sync under way is the periodic verification (nothing was pending).
    periodic: bool,
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
            periodic: false,
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
        // Nothing changed: this is the periodic verification.
        self.periodic = !self.pending;
        // A change sync that falls due after the verification verifies too: under a steady
        // stream of changes (one per sync period is enough) there is never an idle sync, and
        // a table changed by someone else would otherwise never be repaired.
        if self.periodic || now >= self.next_verify {
            self.verify = true;
        }
        self.last_start = Some(now);
        self.verify
    }

    fn succeeded(&mut self, started: Instant) {
        // Only a sync that read the kernel back postpones the next verification.
        if self.verify {
            self.next_verify = started + self.cfg.sync_period;
        }
        self.pending = false;
        self.verify = false;
        self.retry_at = None;
        self.backoff = Duration::ZERO;
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
    // systemd is told READY=1 after the first successful sync, not before: `systemctl start`
    // then returns once the rules are programmed.
    let mut notified_ready = false;
    // Changes taken for a sync that failed: they count for the retry.
    let mut carried = Changes::default();
    loop {
        let due = schedule.due(Instant::now());
        tokio::select! {
            biased;
            () = stopped(shutdown.clone()) => {
                notify::stopping();
                return Ok(());
            }
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
        // The changes before the state: the watch writes the state before it records a change,
        // so the state read next covers at least the changes taken (a change that lands in
        // between is also in the next batch, and syncing a Service twice is harmless).
        let mut changes = cluster.take_changes();
        changes.merge(std::mem::take(&mut carried));
        // A failed sync is retried verifying, so it always takes the full path too.
        let work = if verify && schedule.periodic && changes == Changes::default() {
            Work::Verify
        } else if verify || changes.needs_full() {
            Work::Full {
                state: cluster.snapshot(),
                verify,
            }
        } else {
            let changed = changes.services_changed.clone();
            Work::Changed {
                scoped: cluster.with_state(|s| s.subset(&changed)),
                changed,
            }
        };
        if let Some(node) = work.state().and_then(|s| s.nodes.get(&settings.node_name)) {
            health.set_node(node.deleting, node.to_be_deleted);
        }
        let (reply, answer) = oneshot::channel();
        writer
            .send(Request { work, reply })
            .map_err(|_| DaemonError::SyncThread)?;
        // Not raced against shutdown: the transaction in flight always finishes.
        let Reply { result, rejected } = answer.await.map_err(|_| DaemonError::SyncThread)?;
        for kind in rejected {
            metrics.inc_kernel_rejections(kind.label());
        }
        match result {
            Ok(synced) => {
                schedule.succeeded(started);
                record_success(&synced, &changes, health, metrics);
                let status = format!("last sync {}: {}", jiff::Timestamp::now(), synced.outcome);
                if notified_ready {
                    notify::status(&status);
                } else {
                    notify::ready(&status);
                    notified_ready = true;
                }
            }
            Err(e) => {
                let delay = schedule.failed(Instant::now());
                tracing::error!(
                    "sync failed: {e}; retrying with a full read-back in {:.1} s",
                    delay.as_secs_f64()
                );
                notify::status(&format!(
                    "sync failed at {}: {e}; retrying in {:.1} s",
                    jiff::Timestamp::now(),
                    delay.as_secs_f64()
                ));
                for f in FAMILIES {
                    metrics.inc_sync_failures(f);
                }
                carried = changes;
            }
        }
    }
}

/// Logs, health and metrics after a successful sync.
fn record_success(synced: &Synced, changes: &Changes, health: &ProxyHealth, metrics: &Metrics) {
    let outcome = &synced.outcome;
    let now = SystemTime::now();
    let changed = outcome.report.empty_plans < outcome.report.tables || outcome.drift_repaired;
    if changed {
        tracing::info!(
            "{outcome}; {} Service(s) rebuilt ({} Service, {} EndpointSlice, {} Node change(s))",
            synced.rebuilt,
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
    metrics.set_address_conflicts(synced.address_conflicts);
    metrics.observe_sync(&FAMILIES, synced.kind, outcome.duration);
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
    // A Service with a trigger time had a slice changed, so the synced state has its slices
    // whether it was whole or scoped.
    let mut families: BTreeMap<&ServiceName, BTreeSet<IpFamily>> = BTreeMap::new();
    if !changes.trigger_times.is_empty() {
        for s in synced.state.slices.values() {
            if changes.trigger_times.contains_key(&s.service) {
                families.entry(&s.service).or_default().insert(s.family);
            }
        }
    }
    for (svc, times) in &changes.trigger_times {
        let Some(families) = families.get(svc) else {
            continue;
        };
        for t in times {
            let Ok(latency) = now.duration_since(*t) else {
                continue;
            };
            for &f in families {
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

/// A successful sync, before what follows it.
struct Done {
    outcome: SyncOutcome,
    kind: SyncKind,
    rebuilt: usize,
    state: ClusterState,
    delta: Delta,
}

/// Deletes a family's stale UDP conntrack entries given every UDP Service port of the family;
/// returns how many were deleted.
type ReconcileUdp = Box<dyn FnMut(IpFamily, &[UdpService]) -> Result<usize, ConntrackError> + Send>;

/// The sync thread's state: the one writer, plus what runs after each successful sync.
struct Writer<K: Kernel> {
    syncer: Syncer<K>,
    settings: Settings,
    health: ProxyHealth,
    runtime: Handle,
    /// A copy of the whole current state, for a request to sync the changed Services that the
    /// syncer can only do by syncing everything.
    full_state: Box<dyn Fn() -> ClusterState + Send>,
    /// `conntrack::reconcile_udp`; replaced in tests, which must not touch the host's table.
    reconcile_udp: ReconcileUdp,
    /// The health-check node port servers and the addresses they were created for.
    health_checks: Option<(Vec<IpAddr>, HealthCheckServers)>,
    /// What was derived from each Service at the last successful sync.
    caches: Caches,
    /// Families whose last UDP conntrack reconciliation failed (e.g. a netlink timeout): retried
    /// on the next sync, since the stale entries would otherwise stay until the next change of
    /// a UDP Service's endpoints.
    conntrack_retry: BTreeSet<IpFamily>,
    /// When every Service was last rebuilt: a verification that finds the kernel unchanged
    /// still rebuilds everything after [`FULL_REBUILD_PERIOD`].
    last_full_rebuild: Option<Instant>,
    /// Marked around every job, read by the systemd watchdog (`notify`).
    progress: Progress,
    /// The test-only fault switch [`notify::HANG_WRITER_ENV`].
    hang_switch: Option<std::path::PathBuf>,
    /// [`ruleset::address_warnings`] of the last full sync: each is logged when it appears,
    /// not at every full sync while it lasts.
    address_warnings: BTreeSet<String>,
    /// Clashes between Services over one address and port at the last full sync.
    address_conflicts: usize,
}

impl<K: Kernel> Writer<K> {
    fn new(
        syncer: Syncer<K>,
        settings: Settings,
        health: ProxyHealth,
        runtime: Handle,
        full_state: Box<dyn Fn() -> ClusterState + Send>,
    ) -> Self {
        Writer {
            syncer,
            settings,
            health,
            runtime,
            full_state,
            reconcile_udp: Box::new(conntrack::reconcile_udp),
            health_checks: None,
            caches: Caches::default(),
            conntrack_retry: BTreeSet::new(),
            last_full_rebuild: None,
            progress: Progress::default(),
            hang_switch: None,
            address_warnings: BTreeSet::new(),
            address_conflicts: 0,
        }
    }

    fn serve(mut self, requests: mpsc::Receiver<Request>) {
        while let Ok(req) = requests.recv() {
            self.progress.busy();
            notify::hang_if_switched(self.hang_switch.as_deref());
            let result = self.handle(req.work);
            let rejected = self.syncer.take_rejections();
            self.progress.idle();
            // The loop only stops waiting for a reply when the daemon is exiting.
            let _ = req.reply.send(Reply { result, rejected });
        }
    }

    fn handle(&mut self, work: Work) -> Result<Synced, NftError> {
        let done = match work {
            Work::Full { state, verify } => {
                // A verification that falls due while changes keep coming reads back only
                // when someone else committed, as the idle one does: at 10k Services the
                // read-back costs more than half a second, every sync period.
                let verify =
                    verify && (self.rebuild_overdue() || !self.syncer.kernel_unchanged()?);
                self.sync_all(state, verify)?
            }
            Work::Verify => {
                if self.rebuild_overdue() || !self.syncer.kernel_unchanged()? {
                    self.sync_all((self.full_state)(), true)?
                } else {
                    tracing::debug!(
                        "verified: no nftables transaction since ours, the kernel holds what \
                         we applied"
                    );
                    return Ok(self.verified_unchanged());
                }
            }
            // The caches are only ever updated from a complete build; the loop starts with a
            // full sync, so this is only a safeguard.
            Work::Changed { .. } if !self.caches.is_built() => {
                self.sync_all((self.full_state)(), false)?
            }
            Work::Changed { scoped, changed } => {
                match self
                    .syncer
                    .sync_changed(&scoped, &changed, &self.settings)?
                {
                    Incremental::Done(outcome) => {
                        let delta = self
                            .caches
                            .update(&scoped, &changed, &self.settings.node_name);
                        Done {
                            // Reading the kernel back is a full sync whatever was rebuilt.
                            kind: if outcome.full {
                                SyncKind::Full
                            } else {
                                SyncKind::Partial
                            },
                            outcome,
                            rebuilt: changed.len(),
                            state: scoped,
                            delta,
                        }
                    }
                    Incremental::NeedsFull(why) => {
                        tracing::debug!("syncing every Service: {why}");
                        self.sync_all((self.full_state)(), false)?
                    }
                }
            }
        };
        let addrs = health_check_addresses(&done.state, &self.settings);
        self.sync_health_checks(
            addrs,
            done.kind == SyncKind::Full || done.delta.health_checks,
        );
        let mut families = std::mem::take(&mut self.conntrack_retry);
        families.extend(done.delta.udp_families.iter().copied());
        let conntrack_deleted = self.reconcile_conntrack(&families);
        let no_local = self.no_local();
        Ok(Synced {
            outcome: done.outcome,
            kind: done.kind,
            rebuilt: done.rebuilt,
            state: done.state,
            no_local,
            conntrack_deleted,
            address_conflicts: self.address_conflicts,
        })
    }

    /// Every Service is rebuilt and compared at least every `FULL_REBUILD_PERIOD`.
    fn rebuild_overdue(&self) -> bool {
        self.last_full_rebuild
            .is_none_or(|t| t.elapsed() >= FULL_REBUILD_PERIOD)
    }

    /// Syncs every Service of `state` and rebuilds the caches from it.
    fn sync_all(&mut self, state: ClusterState, verify: bool) -> Result<Done, NftError> {
        let outcome = self.syncer.sync(&state, &self.settings, verify)?;
        self.last_full_rebuild = Some(Instant::now());
        let warnings: BTreeSet<String> = crate::ruleset::address_warnings(&state, &self.settings)
            .into_iter()
            .collect();
        for warning in warnings.difference(&self.address_warnings) {
            tracing::warn!("{warning}");
        }
        self.address_warnings = warnings;
        self.address_conflicts = IpFamily::ALL
            .iter()
            .map(|&f| crate::ruleset::Claims::new(&state, f).clashes.len())
            .sum();
        let delta = self.caches.rebuild(&state, &self.settings.node_name);
        Ok(Done {
            outcome,
            kind: SyncKind::Full,
            rebuilt: state.services.len(),
            state,
            delta,
        })
    }

    /// The answer to a verification that found nothing to do: no Service rebuilt, nothing
    /// derived changed; only a failed conntrack clean-up is retried.
    fn verified_unchanged(&mut self) -> Synced {
        let families = std::mem::take(&mut self.conntrack_retry);
        let conntrack_deleted = self.reconcile_conntrack(&families);
        Synced {
            outcome: SyncOutcome::default(),
            kind: SyncKind::Partial,
            rebuilt: 0,
            state: ClusterState::default(),
            no_local: self.no_local(),
            conntrack_deleted,
            address_conflicts: self.address_conflicts,
        }
    }

    /// Per family: (internal, external) Local-policy Service ports without local endpoints.
    fn no_local(&self) -> Vec<(IpFamily, usize, usize)> {
        FAMILIES
            .into_iter()
            .map(|f| {
                let (i, e) = self.caches.no_local(f);
                (f, i, e)
            })
            .collect()
    }

    /// Serves the health-check node ports on `addrs`. The wanted ports are passed to the servers
    /// only when they may have `changed` (or the addresses did): at 10k Services that list is
    /// not rebuilt for every sync. A port that failed to open is retried then.
    fn sync_health_checks(&mut self, addrs: Option<Vec<IpAddr>>, changed: bool) {
        let wanted = self.caches.has_health_checks();
        if !wanted && self.health_checks.is_none() {
            return;
        }
        let Some(addrs) = addrs else {
            if wanted && changed {
                tracing::warn!(
                    "no address of node {} is selected by --nodeport-addresses: health-check \
                     node ports are not served",
                    self.settings.node_name
                );
            }
            self.health_checks = None;
            return;
        };
        match &mut self.health_checks {
            Some((bound, servers)) if *bound == addrs => {
                if changed {
                    servers.sync(self.caches.health_checks());
                }
            }
            slot => {
                // New addresses (or the first time): listeners on the old ones close.
                let servers = HealthCheckServers::new(
                    addrs.clone(),
                    self.health.clone(),
                    self.runtime.clone(),
                );
                slot.insert((addrs, servers))
                    .1
                    .sync(self.caches.health_checks());
            }
        }
    }

    /// Runs the UDP conntrack reconciler for each family whose UDP serving endpoints changed in
    /// this (successful) sync.
    fn reconcile_conntrack(&mut self, families: &BTreeSet<IpFamily>) -> Vec<(IpFamily, usize)> {
        let mut out = Vec::new();
        for &f in families {
            let services = self.caches.udp_services(f);
            match (self.reconcile_udp)(f, &services) {
                Ok(0) => {}
                Ok(n) => {
                    tracing::info!("deleted {n} stale {f} UDP conntrack entr(y/ies)");
                    out.push((f, n));
                }
                Err(e) => {
                    tracing::warn!(
                        "UDP conntrack reconciliation ({f}) failed, retried on the next sync: {e}"
                    );
                    self.conntrack_retry.insert(f);
                }
            }
        }
        out
    }
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

#[cfg(test)]
mod tests;
