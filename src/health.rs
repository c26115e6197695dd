//! Proxy health with kube-proxy's semantics, its `/healthz` and `/livez` answers, and the
//! per-Service health-check node ports of `externalTrafficPolicy: Local` Services.
//!
//! Health is tracked per IP family, like kube-proxy's `ProxyHealthServer`: a family is unhealthy
//! when a change queued for it ([`ProxyHealth::queued_update`]) has waited longer than the health
//! timeout (2 × sync period) without a successful sync ([`ProxyHealth::updated`]). Nothing
//! pending means healthy, including during start-up. The clock is injectable so that tests can
//! move time instead of sleeping.

use std::collections::{BTreeMap, btree_map};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use hyper::StatusCode;
use hyper::header::{HeaderName, HeaderValue};
use serde::Serialize;
use tokio::runtime::Handle;
use tokio::sync::watch;

use crate::http::{self, Body, Handler, HttpError, HttpServer};
use crate::metrics::Metrics;
use crate::model::IpFamily;
use crate::report;

/// Where "now" comes from.
pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> SystemTime;
}

/// The real wall clock. Wall time rather than a monotonic clock because the timestamps are
/// reported to humans and load balancers; a clock step only shifts one health decision.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// A clock that moves only when told to, for tests and simulations.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<Mutex<SystemTime>>);

impl ManualClock {
    pub fn new(start: SystemTime) -> ManualClock {
        ManualClock(Arc::new(Mutex::new(start)))
    }

    pub fn advance(&self, by: Duration) {
        let mut now = lock(&self.0);
        *now += by;
    }

    pub fn set(&self, to: SystemTime) {
        *lock(&self.0) = to;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> SystemTime {
        *lock(&self.0)
    }
}

/// Every critical section below is a few plain assignments that cannot leave the state half
/// updated, so a panic elsewhere while holding the lock is no reason to stop reporting health.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Debug, Clone, Copy, Default)]
struct FamilyState {
    last_updated: Option<SystemTime>,
    oldest_pending: Option<SystemTime>,
}

#[derive(Debug)]
struct State {
    families: BTreeMap<IpFamily, FamilyState>,
    node_eligible: bool,
    quarantined: Vec<String>,
}

struct Inner {
    clock: Arc<dyn Clock>,
    timeout: Duration,
    state: Mutex<State>,
}

/// The health of one family's rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FamilyHealth {
    /// The last successful sync; `None` before the first.
    pub last_updated: Option<SystemTime>,
    pub healthy: bool,
}

/// A consistent view of [`ProxyHealth`] at one instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthSnapshot {
    pub current_time: SystemTime,
    /// The most recent successful sync of any family.
    pub last_updated: Option<SystemTime>,
    /// Every family is healthy (node eligibility not included).
    pub healthy: bool,
    /// Families that were ever queued or synced.
    pub families: BTreeMap<IpFamily, FamilyHealth>,
    pub node_eligible: bool,
    pub quarantined: Vec<String>,
}

/// Shared proxy health. Cheap to clone; clones share state. Safe to use from any thread.
#[derive(Clone)]
pub struct ProxyHealth {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ProxyHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyHealth")
            .field("timeout", &self.inner.timeout)
            .field("state", &*lock(&self.inner.state))
            .finish()
    }
}

impl ProxyHealth {
    /// Health on the system clock; `health_timeout` is 2 × the sync period, as in kube-proxy.
    pub fn new(health_timeout: Duration) -> ProxyHealth {
        ProxyHealth::with_clock(health_timeout, Arc::new(SystemClock))
    }

    pub fn with_clock(health_timeout: Duration, clock: Arc<dyn Clock>) -> ProxyHealth {
        ProxyHealth {
            inner: Arc::new(Inner {
                clock,
                timeout: health_timeout,
                state: Mutex::new(State {
                    families: BTreeMap::new(),
                    // Eligible until a Node update says otherwise, so that a proxy that has not
                    // seen its Node yet is not pulled out of load balancers (kube-proxy ≤ 1.32
                    // did the same).
                    node_eligible: true,
                    quarantined: Vec::new(),
                }),
            }),
        }
    }

    pub fn health_timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// "Now" on this health's clock.
    pub fn now(&self) -> SystemTime {
        self.inner.clock.now()
    }

    /// A change that needs a sync of `family` has arrived. Only the oldest pending change
    /// counts, so a steady stream of changes cannot hide a sync loop that is stuck.
    pub fn queued_update(&self, family: IpFamily) {
        let now = self.now();
        let mut st = lock(&self.inner.state);
        let f = st.families.entry(family).or_default();
        f.oldest_pending.get_or_insert(now);
    }

    /// `family`'s rules were synced successfully: nothing is pending any more.
    pub fn updated(&self, family: IpFamily) {
        let now = self.now();
        let mut st = lock(&self.inner.state);
        let f = st.families.entry(family).or_default();
        f.oldest_pending = None;
        f.last_updated = Some(now);
    }

    /// The Node's state: a Node being deleted, or tainted `ToBeDeletedByClusterAutoscaler`, is
    /// not eligible for load-balancer traffic and fails `/healthz` (but not `/livez`).
    pub fn set_node(&self, deleting: bool, to_be_deleted_by_autoscaler: bool) {
        lock(&self.inner.state).node_eligible = !(deleting || to_be_deleted_by_autoscaler);
    }

    pub fn node_eligible(&self) -> bool {
        lock(&self.inner.state).node_eligible
    }

    /// The Service ports (e.g. `ns/name:port`) currently left out of the ruleset; reported in
    /// `/healthz`. They do not make the proxy unhealthy: the rest of the cluster is served.
    pub fn set_quarantined(&self, mut services: Vec<String>) {
        services.sort();
        services.dedup();
        lock(&self.inner.state).quarantined = services;
    }

    pub fn quarantined(&self) -> Vec<String> {
        lock(&self.inner.state).quarantined.clone()
    }

    /// Whether every family's rules are fresh at `now`, ignoring the Node (what `/livez` and the
    /// health-check node ports use).
    pub fn healthy(&self, now: SystemTime) -> bool {
        let st = lock(&self.inner.state);
        st.families
            .values()
            .all(|f| family_healthy(f, now, self.inner.timeout))
    }

    /// [`ProxyHealth::healthy`] at the clock's now.
    pub fn is_healthy(&self) -> bool {
        self.healthy(self.now())
    }

    /// Everything at the clock's now, consistently.
    pub fn snapshot(&self) -> HealthSnapshot {
        let now = self.now();
        let st = lock(&self.inner.state);
        let families: BTreeMap<IpFamily, FamilyHealth> = st
            .families
            .iter()
            .map(|(&fam, f)| {
                let h = FamilyHealth {
                    last_updated: f.last_updated,
                    healthy: family_healthy(f, now, self.inner.timeout),
                };
                (fam, h)
            })
            .collect();
        HealthSnapshot {
            current_time: now,
            last_updated: families.values().filter_map(|f| f.last_updated).max(),
            healthy: families.values().all(|f| f.healthy),
            families,
            node_eligible: st.node_eligible,
            quarantined: st.quarantined.clone(),
        }
    }
}

/// A pending change is tolerated for less than `timeout`, as in kube-proxy. Unlike kube-proxy,
/// a family that was queued but never synced counts too (upstream only looks at families that
/// synced once, which cannot happen there because each proxier reports a sync at start).
fn family_healthy(f: &FamilyState, now: SystemTime, timeout: Duration) -> bool {
    match f.oldest_pending {
        None => true,
        // A pending time in the future (clock stepped back) is not late.
        Some(t) => now
            .duration_since(t)
            .map_or(true, |waited| waited < timeout),
    }
}

/// Timestamps as Go's `time.Time` marshals them (RFC 3339, fractional seconds only as needed),
/// in UTC. Never-synced is Go's zero time, which is what kube-proxy prints in that case.
fn go_time(t: Option<SystemTime>) -> String {
    const GO_ZERO_TIME: &str = "0001-01-01T00:00:00Z";
    t.and_then(|t| jiff::Timestamp::try_from(t).ok())
        .map_or_else(|| GO_ZERO_TIME.to_string(), |ts| ts.to_string())
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct FamilyJson {
    last_updated: String,
    healthy: bool,
}

/// kube-proxy's `ProxyHealth` JSON, field for field and in the same order, plus
/// `quarantinedServices` on `/healthz`.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct HealthJson {
    last_updated: String,
    current_time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    node_eligible: Option<bool>,
    healthy: bool,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    status: BTreeMap<String, FamilyJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    quarantined_services: Option<Vec<String>>,
}

fn health_json(snap: HealthSnapshot, with_node: bool) -> (bool, HealthJson) {
    let healthy = snap.healthy && (!with_node || snap.node_eligible);
    // kube-proxy reports `lastUpdated` as now when healthy: older releases bumped it on every
    // sync loop pass, and clients compare it with the current time.
    let last_updated = if healthy {
        Some(snap.current_time)
    } else {
        snap.last_updated
    };
    let json = HealthJson {
        last_updated: go_time(last_updated),
        current_time: go_time(Some(snap.current_time)),
        node_eligible: with_node.then_some(snap.node_eligible),
        // Like kube-proxy, `healthy` is the proxier's health; eligibility has its own field.
        healthy: snap.healthy,
        status: snap
            .families
            .iter()
            .map(|(fam, f)| {
                let j = FamilyJson {
                    last_updated: go_time(f.last_updated),
                    healthy: f.healthy,
                };
                (fam.to_string(), j)
            })
            .collect(),
        quarantined_services: with_node.then_some(snap.quarantined),
    };
    (healthy, json)
}

fn json_response(status: StatusCode, body: &impl Serialize) -> hyper::Response<Body> {
    match serde_json::to_vec(body) {
        Ok(bytes) => http::respond(status, "application/json", bytes),
        // Unreachable for these plain structs; answer honestly rather than panic.
        Err(e) => http::respond(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain; charset=utf-8",
            format!("encoding JSON failed: {e}\n"),
        ),
    }
}

fn code(healthy: bool) -> StatusCode {
    if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// The healthz server's routes: `/healthz` and `/livez` (kube-proxy's `--healthz-bind-address`).
pub fn healthz_handler(health: ProxyHealth, metrics: Metrics) -> Handler {
    Arc::new(move |req| match req.uri().path() {
        "/healthz" => healthz_response(&health, &metrics),
        "/livez" => livez_response(&health, &metrics),
        _ => http::not_found(),
    })
}

/// `/healthz`: 200 iff the rules are fresh and the Node is eligible; counted in
/// `kubeproxy_proxy_healthz_total{code}`.
fn healthz_response(health: &ProxyHealth, metrics: &Metrics) -> hyper::Response<Body> {
    let (healthy, json) = health_json(health.snapshot(), true);
    let status = code(healthy);
    metrics.inc_healthz(status.as_u16());
    json_response(status, &json)
}

/// `/livez`: 200 iff the rules are fresh, whatever the Node; counted in
/// `kubeproxy_proxy_livez_total{code}`.
fn livez_response(health: &ProxyHealth, metrics: &Metrics) -> hyper::Response<Body> {
    let (healthy, json) = health_json(health.snapshot(), false);
    let status = code(healthy);
    metrics.inc_livez(status.as_u16());
    json_response(status, &json)
}

/// One `externalTrafficPolicy: Local` Service with a `healthCheckNodePort`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheckService {
    pub namespace: String,
    pub name: String,
    /// `spec.healthCheckNodePort`.
    pub port: u16,
    /// Ready endpoints on this node (terminating ones do not count, so the node drains).
    pub local_endpoints: usize,
}

/// What a health-check port reports; updated in place on every sync.
#[derive(Debug, Clone)]
struct PortInfo {
    namespace: String,
    name: String,
    local_endpoints: usize,
}

#[derive(Serialize)]
struct ServiceRef<'a> {
    namespace: &'a str,
    name: &'a str,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ServiceHealthJson<'a> {
    service: ServiceRef<'a>,
    local_endpoints: usize,
    service_proxy_healthy: bool,
}

fn service_health_response(info: &Mutex<PortInfo>, health: &ProxyHealth) -> hyper::Response<Body> {
    let info = lock(info).clone();
    let proxy_healthy = health.is_healthy();
    let json = ServiceHealthJson {
        service: ServiceRef {
            namespace: &info.namespace,
            name: &info.name,
        },
        local_endpoints: info.local_endpoints,
        service_proxy_healthy: proxy_healthy,
    };
    let mut resp = json_response(code(info.local_endpoints > 0 && proxy_healthy), &json);
    // Load balancers that support weights (e.g. some cloud LBs) spread by local endpoint count.
    resp.headers_mut().insert(
        HeaderName::from_static("x-load-balancing-endpoint-weight"),
        HeaderValue::from(info.local_endpoints),
    );
    resp
}

/// Where the health-check ports listen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum BindTarget {
    /// Every local address of both families.
    All,
    Ip(IpAddr),
}

impl std::fmt::Display for BindTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BindTarget::All => f.write_str("all addresses"),
            BindTarget::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// One listening socket; dropping it stops its server (the watch sender's drop is the signal).
struct Listener {
    addr: SocketAddr,
    _stop: watch::Sender<()>,
}

struct PortServer {
    info: Arc<Mutex<PortInfo>>,
    listeners: BTreeMap<BindTarget, Listener>,
}

/// The health-check node ports: one HTTP listener per wanted port on each bind address. Any path
/// answers `{"service":{"namespace","name"},"localEndpoints":N,"serviceProxyHealthy":bool}` with
/// `X-Load-Balancing-Endpoint-Weight: N`, 200 iff N > 0 and the proxy is healthy, else 503.
pub struct HealthCheckServers {
    targets: Vec<BindTarget>,
    health: ProxyHealth,
    runtime: Handle,
    ports: BTreeMap<u16, PortServer>,
}

impl HealthCheckServers {
    /// `bind_addrs` are the node addresses to listen on (kube-proxy: those matching
    /// `--nodeport-addresses`); empty means every address. Servers run on `runtime`, so
    /// [`HealthCheckServers::sync`] can be called from a blocking sync thread.
    pub fn new(bind_addrs: Vec<IpAddr>, health: ProxyHealth, runtime: Handle) -> Self {
        let mut targets: Vec<BindTarget> = bind_addrs.into_iter().map(BindTarget::Ip).collect();
        targets.sort();
        targets.dedup();
        if targets.is_empty() {
            targets.push(BindTarget::All);
        }
        HealthCheckServers {
            targets,
            health,
            runtime,
            ports: BTreeMap::new(),
        }
    }

    /// Makes the listeners match `wanted`: opens missing ones, closes those for ports no longer
    /// wanted, and updates the reported Service and endpoint count of the others in place. A port
    /// that cannot be bound is logged and retried on the next sync; it never affects the others.
    ///
    /// A closed listener releases its port when its task next runs, so a port dropped and wanted
    /// again by the very next sync may fail to bind once (`EADDRINUSE`) and open a sync later.
    pub fn sync(&mut self, wanted: Vec<HealthCheckService>) {
        let mut by_port: BTreeMap<u16, HealthCheckService> = BTreeMap::new();
        for svc in wanted {
            if svc.port == 0 {
                tracing::warn!(service = %format_args!("{}/{}", svc.namespace, svc.name),
                    "ignoring health-check node port 0");
                continue;
            }
            match by_port.entry(svc.port) {
                btree_map::Entry::Vacant(v) => {
                    v.insert(svc);
                }
                // The API server allocates node ports uniquely; a clash means a stale or invalid
                // object, and the first one keeps the port.
                btree_map::Entry::Occupied(o) => tracing::warn!(
                    port = svc.port,
                    service = %format_args!("{}/{}", svc.namespace, svc.name),
                    holder = %format_args!("{}/{}", o.get().namespace, o.get().name),
                    "health-check node port already used by another Service; ignoring"
                ),
            }
        }

        self.ports.retain(|port, server| {
            let keep = by_port.contains_key(port);
            if !keep {
                let info = lock(&server.info);
                tracing::info!(port, service = %format_args!("{}/{}", info.namespace, info.name),
                    "closing health-check node port");
            }
            keep
        });

        for (port, svc) in by_port {
            let server = self.ports.entry(port).or_insert_with(|| PortServer {
                info: Arc::new(Mutex::new(PortInfo {
                    namespace: String::new(),
                    name: String::new(),
                    local_endpoints: 0,
                })),
                listeners: BTreeMap::new(),
            });
            {
                let mut info = lock(&server.info);
                info.namespace.clone_from(&svc.namespace);
                info.name.clone_from(&svc.name);
                info.local_endpoints = svc.local_endpoints;
            }
            for &target in &self.targets {
                if server.listeners.contains_key(&target) {
                    continue;
                }
                match open(target, port, &server.info, &self.health, &self.runtime) {
                    Ok(listener) => {
                        tracing::info!(port, addr = %listener.addr,
                            service = %format_args!("{}/{}", svc.namespace, svc.name),
                            "opened health-check node port");
                        server.listeners.insert(target, listener);
                    }
                    Err(e) => tracing::warn!(
                        port,
                        on = %target,
                        service = %format_args!("{}/{}", svc.namespace, svc.name),
                        error = %report::chain(&e),
                        "cannot open health-check node port; retrying on the next sync"
                    ),
                }
            }
        }
    }

    /// The ports listening on every bind address.
    pub fn ports(&self) -> Vec<u16> {
        self.ports
            .iter()
            .filter(|(_, s)| s.listeners.len() == self.targets.len())
            .map(|(&p, _)| p)
            .collect()
    }

    /// The addresses `port` listens on.
    pub fn local_addrs(&self, port: u16) -> Vec<SocketAddr> {
        self.ports
            .get(&port)
            .map(|s| s.listeners.values().map(|l| l.addr).collect())
            .unwrap_or_default()
    }
}

fn open(
    target: BindTarget,
    port: u16,
    info: &Arc<Mutex<PortInfo>>,
    health: &ProxyHealth,
    runtime: &Handle,
) -> Result<Listener, HttpError> {
    let (addr, std_listener) = match target {
        BindTarget::All => {
            let addr = SocketAddr::from(([0, 0, 0, 0], port));
            http::listen_all(port).map_err(|source| HttpError::Bind { addr, source })?
        }
        BindTarget::Ip(ip) => {
            let addr = SocketAddr::new(ip, port);
            let l = http::listen(addr, false).map_err(|source| HttpError::Bind { addr, source })?;
            (addr, l)
        }
    };
    let handler: Handler = {
        let (info, health) = (info.clone(), health.clone());
        Arc::new(move |_req| service_health_response(&info, &health))
    };
    // Registering with the reactor needs the runtime's context; the caller may be a plain thread.
    let _ctx = runtime.enter();
    let server = HttpServer::from_std(std_listener, handler)
        .map_err(|source| HttpError::Bind { addr, source })?;
    let (stop, mut stopped) = watch::channel(());
    runtime.spawn(server.run(async move {
        // Resolves once the sender is dropped, i.e. when the listener is closed.
        while stopped.changed().await.is_ok() {}
    }));
    Ok(Listener { addr, _stop: stop })
}

#[cfg(test)]
mod tests;
