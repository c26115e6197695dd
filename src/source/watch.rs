//! The API source: kube-runtime watchers on Services, EndpointSlices, this Node and the
//! ServiceCIDRs, kept as a validated [`ClusterState`] that a sync loop reads.
//!
//! Guarantees, each one a production failure otherwise:
//! - **Nothing partial.** [`ClusterWatch::ready`] resolves only after each of the three watches has
//!   listed once; a relist (after `410 Gone` or a restart of the watch) is buffered and replaces
//!   that kind's objects in one step at `InitDone`, so objects deleted while disconnected disappear
//!   and no reader ever sees a half-listed kind.
//! - **An outage removes nothing.** Watcher errors are logged once per change of connectivity
//!   ("lost the API server" … "API server reachable again") and the last good state stays.
//! - **A silently dead connection is noticed.** See [`Timeouts`] for the bound.
//! - **A bad object is skipped, not fatal.** It is logged once per resourceVersion (not on every
//!   relist), reported by [`ClusterWatch::rejected`], and treated as absent.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::api::networking::v1 as networking;
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig, KubeconfigError};
use kube::runtime::WatchStreamExt;
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, DefaultBackoff, Event};
use kube::{Client, Resource, ResourceExt};
use tokio::sync::watch as channel;
use tokio::task::JoinHandle;

use crate::model::{self, ClusterState, NameTable, Rejected, ServiceName, convert, printable};

/// The label selector kube-proxy's informers use for Services and EndpointSlices: objects owned
/// by another proxy, and the slices of headless Services, are never sent to us.
pub const LABEL_SELECTOR: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// Annotation the EndpointSlice controller sets to when the change that produced a slice
/// happened; the network-programming-latency metric measures from it.
pub const ANNOTATION_LAST_CHANGE_TRIGGER_TIME: &str =
    "endpoints.kubernetes.io/last-change-trigger-time";

mod applier;
mod client;
mod ratelimit;

use applier::*;
pub use client::{Timeouts, WatchError, client, client_from, config};
pub use ratelimit::RequestRate;

/// How the watches behave; the defaults are for production, tests shorten them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchOptions {
    /// `timeoutSeconds` of each watch request (whole seconds, at least 1). Should equal the
    /// `watch` of the [`Timeouts`] the client was built with.
    pub watch_timeout: Duration,
    /// `None`: client-go's backoff between failed attempts (0.8 s doubling to 30 s, jittered, so
    /// that thousands of nodes do not reconnect in step). `Some(d)`: a fixed delay.
    pub retry_delay: Option<Duration>,
}

impl Default for WatchOptions {
    fn default() -> WatchOptions {
        WatchOptions {
            watch_timeout: Timeouts::default().watch,
            retry_delay: None,
        }
    }
}

/// What changed since the last [`ClusterWatch::take_changes`]: counts for metrics, and which
/// Services a sync must rebuild.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// Services added, changed (as the model sees them) or removed.
    pub services: u64,
    /// EndpointSlices added, changed or removed.
    pub endpoint_slices: u64,
    /// Changes to this Node.
    pub nodes: u64,
    /// ServiceCIDRs added, changed or removed.
    pub service_cidrs: u64,
    /// `endpoints.kubernetes.io/last-change-trigger-time` of the changed EndpointSlices, by the
    /// Service they belong to. Only times after the watch started are kept (like kube-proxy),
    /// so that the initial list does not report the age of every slice as programming latency.
    pub trigger_times: BTreeMap<ServiceName, Vec<SystemTime>>,
    /// The Services whose rules may differ: each Service added, changed or removed, and the
    /// Service of each EndpointSlice added, changed or removed (both owners when a slice moved
    /// from one to another). Empty when `full`.
    pub services_changed: BTreeSet<ServiceName>,
    /// Too many Services changed to track them one by one (the initial list, a large relist):
    /// only a sync of everything covers the changes.
    pub full: bool,
}

impl Changes {
    /// Whether only a sync of every Service covers these changes: too many to track, or a change
    /// to the Node, which every Service's rules depend on (NodePort addresses, local endpoints,
    /// topology), or to a ServiceCIDR (the drop of unallocated service addresses).
    pub fn needs_full(&self) -> bool {
        self.full || self.nodes > 0 || self.service_cidrs > 0
    }

    /// Adds `other` to these changes (changes taken for a sync that failed count for the retry).
    pub fn merge(&mut self, other: Changes) {
        self.services += other.services;
        self.endpoint_slices += other.endpoint_slices;
        self.nodes += other.nodes;
        self.service_cidrs += other.service_cidrs;
        for (svc, times) in other.trigger_times {
            self.trigger_times.entry(svc).or_default().extend(times);
        }
        self.full |= other.full;
        if self.full {
            self.services_changed.clear();
        } else {
            self.services_changed.extend(other.services_changed);
        }
    }

    /// Records that the rules of `names` may have changed; beyond `limit` names, gives up the
    /// list for `full`, so that memory stays bounded when nobody takes the changes.
    fn note_services(&mut self, names: impl IntoIterator<Item = ServiceName>, limit: usize) {
        if self.full {
            return;
        }
        self.services_changed.extend(names);
        if self.services_changed.len() > limit {
            self.full = true;
            self.services_changed = BTreeSet::new();
        }
    }
}

/// Changed Services are tracked by name up to a quarter of the Services, and at least this many:
/// beyond that a full sync costs about as much as syncing them one by one.
const MIN_TRACKED_SERVICES: usize = 1024;

fn tracking_limit(services: usize) -> usize {
    (services / 4).max(MIN_TRACKED_SERVICES)
}

/// At most this many trigger times are kept per Service between two `take_changes`: the
/// earliest matter most to the latency metric, and nobody calling `take_changes` must not grow
/// memory without bound.
const MAX_TRIGGER_TIMES_PER_SERVICE: usize = 16;

/// The watched kinds, as bits of the "has listed" mask.
const LISTED_SERVICES: u8 = 1;
const LISTED_SLICES: u8 = 2;
const LISTED_NODE: u8 = 4;
const LISTED_SERVICE_CIDRS: u8 = 8;
const LISTED_ALL: u8 = LISTED_SERVICES | LISTED_SLICES | LISTED_NODE | LISTED_SERVICE_CIDRS;

/// State shared between the watcher tasks and the [`ClusterWatch`] handle.
struct Shared {
    /// Shared with the snapshots a sync holds: a write while one is held copies the state
    /// (`Arc::make_mut`), otherwise nothing is copied. A full sync no longer holds a second
    /// copy of the model (15.6 MiB at 10k Services × 10 endpoints) while it builds.
    state: RwLock<Arc<ClusterState>>,
    changes: Mutex<Changes>,
    /// Currently rejected objects, by kind and `namespace/name`.
    rejected: Mutex<BTreeMap<(&'static str, String), Rejected>>,
    /// Bumped after every change of `state`.
    generation: channel::Sender<u64>,
    /// Which kinds have completed their first list.
    listed: channel::Sender<u8>,
    /// Slices whose trigger time is older than this were changed before we watched.
    started: SystemTime,
}

impl Shared {
    /// The current state, shared until the watches next write it.
    fn snapshot(&self) -> Arc<ClusterState> {
        Arc::clone(&self.state.read().unwrap_or_else(PoisonError::into_inner))
    }

    fn new(started: SystemTime) -> Shared {
        Shared {
            state: RwLock::new(Arc::default()),
            changes: Mutex::new(Changes::default()),
            rejected: Mutex::new(BTreeMap::new()),
            generation: channel::channel(0).0,
            listed: channel::channel(0).0,
            started,
        }
    }

    fn bump(&self) {
        self.generation.send_modify(|g| *g = g.wrapping_add(1));
    }
}

/// Locks ignoring poisoning: no code here panics while holding a lock, and a reader must not be
/// taken down by a panic elsewhere.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The running watches. Dropping it stops them.
pub struct ClusterWatch {
    shared: Arc<Shared>,
    generation: channel::Receiver<u64>,
    listed: channel::Receiver<u8>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for ClusterWatch {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Starts the Service, EndpointSlice, Node and ServiceCIDR watches with the default options. Must be called
/// within a tokio runtime.
pub fn spawn(client: Client, node_name: String) -> ClusterWatch {
    spawn_with(client, node_name, WatchOptions::default())
}

/// Starts the watches with explicit options. Must be called within a tokio runtime.
pub fn spawn_with(client: Client, node_name: String, options: WatchOptions) -> ClusterWatch {
    let shared = Arc::new(Shared::new(SystemTime::now()));
    let generation_rx = shared.generation.subscribe();
    let listed_rx = shared.listed.subscribe();
    let timeout = u32::try_from(options.watch_timeout.as_secs())
        .unwrap_or(u32::MAX)
        .max(1);
    let base = watcher::Config::default().timeout(timeout);
    let services = run::<core::Service>(
        Api::all(client.clone()),
        base.clone().labels(LABEL_SELECTOR),
        options,
        shared.clone(),
        None,
    );
    let slices = run::<discovery::EndpointSlice>(
        Api::all(client.clone()),
        base.clone().labels(LABEL_SELECTOR),
        options,
        shared.clone(),
        None,
    );
    let node = run::<core::Node>(
        Api::all(client.clone()),
        base.clone().fields(&format!("metadata.name={node_name}")),
        options,
        shared.clone(),
        Some(node_name),
    );
    let service_cidrs = run_service_cidrs(Api::all(client), base, options, shared.clone());
    ClusterWatch {
        shared,
        generation: generation_rx,
        listed: listed_rx,
        tasks: vec![
            tokio::spawn(services),
            tokio::spawn(slices),
            tokio::spawn(node),
            tokio::spawn(service_cidrs),
        ],
    }
}

impl ClusterWatch {
    /// Resolves once every watch has completed its first list. Nothing may be programmed before:
    /// a partial view would delete live Services.
    pub async fn ready(&self) {
        let mut listed = self.listed.clone();
        // The sender lives in `shared`, which `self` holds: `wait_for` cannot fail while we wait.
        if listed.wait_for(|m| *m == LISTED_ALL).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Whether every watch has completed its first list.
    pub fn is_ready(&self) -> bool {
        *self.listed.borrow() == LISTED_ALL
    }

    /// Resolves when the state changed since the last call returned (or since the watch started,
    /// for the first call). Several changes in between resolve it once: the sync loop coalesces.
    pub async fn changed(&mut self) {
        if self.generation.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Runs `f` on the current state without copying it. Keep `f` short: the watchers wait
    /// while it runs.
    pub fn with_state<R>(&self, f: impl FnOnce(&ClusterState) -> R) -> R {
        f(&self
            .shared
            .state
            .read()
            .unwrap_or_else(PoisonError::into_inner))
    }

    /// The current state, shared until the watches next write it.
    pub fn snapshot(&self) -> Arc<ClusterState> {
        self.shared.snapshot()
    }

    /// The current state, taken out of the watches (which stop with the handle): no copy when
    /// no snapshot is held.
    pub fn into_state(self) -> ClusterState {
        let state = std::mem::take(
            &mut *self
                .shared
                .state
                .write()
                .unwrap_or_else(PoisonError::into_inner),
        );
        Arc::unwrap_or_clone(state)
    }

    /// A handle that copies the current state from any thread, for as long as it lives (the
    /// watches stop when this `ClusterWatch` is dropped; the handle then sees the last state).
    pub fn reader(&self) -> StateReader {
        StateReader {
            shared: self.shared.clone(),
        }
    }

    /// The changes since the previous call: which Services to sync, and counts for metrics.
    pub fn take_changes(&self) -> Changes {
        std::mem::take(&mut *lock(&self.shared.changes))
    }

    /// The objects currently left out because they failed validation.
    pub fn rejected(&self) -> Vec<Rejected> {
        lock(&self.shared.rejected).values().cloned().collect()
    }
}

/// Reads the watched state from another thread; see [`ClusterWatch::reader`].
#[derive(Clone)]
pub struct StateReader {
    shared: Arc<Shared>,
}

impl StateReader {
    /// The current state, shared until the watches next write it.
    pub fn snapshot(&self) -> Arc<ClusterState> {
        self.shared.snapshot()
    }
}

/// What differs between the three watched kinds.
trait Kind:
    Resource<DynamicType = ()>
    + Clone
    + serde::de::DeserializeOwned
    + fmt::Debug
    + Send
    + Sync
    + 'static
{
    type Key: Ord + std::hash::Hash + Clone + fmt::Display + Send + Sync;
    type Model: PartialEq + Clone + Send + Sync;
    const NAME: &'static str;
    const LISTED: u8;
    /// The object's key in the state, from its metadata alone (a deleted object need not convert).
    fn key(obj: &Self) -> Option<Self::Key>;
    /// `Ok(None)`: a valid object the proxy does not use. Parts left out of a used object
    /// (an endpoint at a special address, …) are reported in `dropped`.
    /// `names` shares the node and zone names (and their pairs) of the endpoints converted so
    /// far.
    fn convert(
        obj: &Self,
        dropped: &mut Vec<Rejected>,
        names: &mut NameTable,
    ) -> Result<Option<Self::Model>, Rejected>;
    fn map(state: &ClusterState) -> &BTreeMap<Self::Key, Self::Model>;
    fn map_mut(state: &mut ClusterState) -> &mut BTreeMap<Self::Key, Self::Model>;
    fn counter(changes: &mut Changes) -> &mut u64;
    /// The Service whose rules the object feeds; `None` for a Node, which feeds every Service's.
    fn service_of(model: &Self::Model) -> Option<ServiceName>;
    /// The Service and last-change trigger time, for kinds that carry one.
    fn trigger(_obj: &Self) -> Option<(ServiceName, SystemTime)> {
        None
    }
}

fn namespaced_key<K: Resource>(obj: &K) -> Option<ServiceName> {
    let meta = obj.meta();
    Some(ServiceName::new(
        meta.namespace.as_deref()?,
        meta.name.as_deref()?,
    ))
}

impl Kind for core::Service {
    type Key = ServiceName;
    type Model = model::Service;
    const NAME: &'static str = "Service";
    const LISTED: u8 = LISTED_SERVICES;
    fn key(obj: &Self) -> Option<ServiceName> {
        namespaced_key(obj)
    }
    fn convert(
        obj: &Self,
        dropped: &mut Vec<Rejected>,
        _names: &mut NameTable,
    ) -> Result<Option<model::Service>, Rejected> {
        convert::service_noting(obj, dropped)
    }
    fn map(state: &ClusterState) -> &BTreeMap<ServiceName, model::Service> {
        &state.services
    }
    fn map_mut(state: &mut ClusterState) -> &mut BTreeMap<ServiceName, model::Service> {
        &mut state.services
    }
    fn counter(changes: &mut Changes) -> &mut u64 {
        &mut changes.services
    }
    fn service_of(model: &model::Service) -> Option<ServiceName> {
        Some(model.name.clone())
    }
}

impl Kind for discovery::EndpointSlice {
    type Key = ServiceName;
    type Model = model::EndpointSlice;
    const NAME: &'static str = "EndpointSlice";
    const LISTED: u8 = LISTED_SLICES;
    fn key(obj: &Self) -> Option<ServiceName> {
        namespaced_key(obj)
    }
    fn convert(
        obj: &Self,
        dropped: &mut Vec<Rejected>,
        names: &mut NameTable,
    ) -> Result<Option<model::EndpointSlice>, Rejected> {
        convert::endpoint_slice_noting(obj, dropped, names)
    }
    fn map(state: &ClusterState) -> &BTreeMap<ServiceName, model::EndpointSlice> {
        &state.slices
    }
    fn map_mut(state: &mut ClusterState) -> &mut BTreeMap<ServiceName, model::EndpointSlice> {
        &mut state.slices
    }
    fn counter(changes: &mut Changes) -> &mut u64 {
        &mut changes.endpoint_slices
    }
    fn service_of(model: &model::EndpointSlice) -> Option<ServiceName> {
        Some(model.service.clone())
    }
    fn trigger(obj: &Self) -> Option<(ServiceName, SystemTime)> {
        let raw = obj.annotations().get(ANNOTATION_LAST_CHANGE_TRIGGER_TIME)?;
        // An unparsable annotation only costs a metric sample; the slice itself is fine.
        let at = k8s_openapi::jiff::Timestamp::from_str(raw).ok()?;
        let service = ServiceName::new(
            &obj.namespace()?,
            obj.labels().get(convert::LABEL_SERVICE_NAME)?,
        );
        Some((service, SystemTime::from(at)))
    }
}

impl Kind for core::Node {
    type Key = String;
    type Model = model::Node;
    const NAME: &'static str = "Node";
    const LISTED: u8 = LISTED_NODE;
    fn key(obj: &Self) -> Option<String> {
        obj.meta().name.clone()
    }
    fn convert(
        obj: &Self,
        _dropped: &mut Vec<Rejected>,
        _names: &mut NameTable,
    ) -> Result<Option<model::Node>, Rejected> {
        convert::node(obj).map(Some)
    }
    fn map(state: &ClusterState) -> &BTreeMap<String, model::Node> {
        &state.nodes
    }
    fn map_mut(state: &mut ClusterState) -> &mut BTreeMap<String, model::Node> {
        &mut state.nodes
    }
    fn counter(changes: &mut Changes) -> &mut u64 {
        &mut changes.nodes
    }
    fn service_of(_model: &model::Node) -> Option<ServiceName> {
        None
    }
}

impl Kind for networking::ServiceCIDR {
    type Key = String;
    type Model = Vec<ipnet::IpNet>;
    const NAME: &'static str = "ServiceCIDR";
    const LISTED: u8 = LISTED_SERVICE_CIDRS;
    fn key(obj: &Self) -> Option<String> {
        obj.meta().name.clone()
    }
    fn convert(
        obj: &Self,
        _dropped: &mut Vec<Rejected>,
        _names: &mut NameTable,
    ) -> Result<Option<Vec<ipnet::IpNet>>, Rejected> {
        convert::service_cidr(obj).map(|(_, cidrs)| Some(cidrs))
    }
    fn map(state: &ClusterState) -> &BTreeMap<String, Vec<ipnet::IpNet>> {
        &state.service_cidrs
    }
    fn map_mut(state: &mut ClusterState) -> &mut BTreeMap<String, Vec<ipnet::IpNet>> {
        &mut state.service_cidrs
    }
    fn counter(changes: &mut Changes) -> &mut u64 {
        &mut changes.service_cidrs
    }
    fn service_of(_model: &Vec<ipnet::IpNet>) -> Option<ServiceName> {
        None
    }
}

/// The ServiceCIDR watch, unless the API server has no such resource (before Kubernetes 1.33,
/// or with the MultiCIDRServiceAllocator API disabled): then there are none, `--service-cidr`
/// is all there is, and the kind counts as listed so that the other watches are not held back.
/// Any other answer to the probe (the API server down, a timeout) leaves it to the watch, which
/// retries as the others do.
async fn run_service_cidrs(
    api: Api<networking::ServiceCIDR>,
    config: watcher::Config,
    options: WatchOptions,
    shared: Arc<Shared>,
) {
    match api.list_metadata(&ListParams::default().limit(1)).await {
        Err(kube::Error::Api(status)) if status.code == 404 => {
            tracing::info!(
                "the API server has no ServiceCIDR resource (networking.k8s.io/v1, Kubernetes \
                 1.33+): unallocated service addresses are dropped only inside --service-cidr"
            );
            shared.listed.send_modify(|m| *m |= LISTED_SERVICE_CIDRS);
            shared.bump();
        }
        _ => run::<networking::ServiceCIDR>(api, config, options, shared, None).await,
    }
}

#[cfg(test)]
mod tests;
