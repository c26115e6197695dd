//! The API source: kube-runtime watchers on Services, EndpointSlices and this Node, kept as a
//! validated [`ClusterState`] that a sync loop reads.
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
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig, KubeconfigError};
use kube::runtime::WatchStreamExt;
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, DefaultBackoff, Event};
use kube::{Client, Resource, ResourceExt};
use tokio::sync::watch as channel;
use tokio::task::JoinHandle;

use crate::model::{self, ClusterState, Rejected, ServiceName, convert, printable};

/// The label selector kube-proxy's informers use for Services and EndpointSlices: objects owned
/// by another proxy, and the slices of headless Services, are never sent to us.
pub const LABEL_SELECTOR: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// Annotation the EndpointSlice controller sets to when the change that produced a slice
/// happened; the network-programming-latency metric measures from it.
pub const ANNOTATION_LAST_CHANGE_TRIGGER_TIME: &str =
    "endpoints.kubernetes.io/last-change-trigger-time";

/// Why no API client could be built.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("kubeconfig {}: {source}", path.display())]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: KubeconfigError,
    },
    #[error(
        "no --kubeconfig and no in-cluster configuration ({source}); pass --kubeconfig or run in a pod with a service account"
    )]
    InCluster {
        #[source]
        source: kube::config::InClusterError,
    },
    #[error("--master {url:?} is not a URL: {source}")]
    Master {
        url: String,
        #[source]
        source: http::uri::InvalidUri,
    },
    #[error("cannot build an API client for {url}: {source}")]
    Client {
        url: String,
        #[source]
        source: kube::Error,
    },
}

/// How long nodeproxy waits on a silent API connection before it replaces it.
///
/// The bound on staleness behind a dead connection (half-open TCP after an API server restart or
/// a NAT timeout), with the defaults:
/// - an established watch that receives nothing for `watch + 5 s` (295 s) is abandoned by
///   kube-runtime and re-established from its last resourceVersion (the API server itself ends a
///   healthy watch after `watch`, so a live but quiet watch never hits this);
/// - a list, or the start of a watch, whose response stalls fails after `read` (300 s) without a
///   byte from the server, then is retried after the backoff (at most 30 s);
///
/// so rules are never stale for more than about 5½ minutes after the last byte the API server
/// sent. `read` must exceed `watch + 5 s`, or every quiet healthy watch would end in a read error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// `timeoutSeconds` of each watch request.
    pub watch: Duration,
    /// The HTTP client's read timeout (kube `Config::read_timeout`), counted from the last byte
    /// read or the request written.
    pub read: Duration,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts {
            watch: Duration::from_secs(290),
            read: Duration::from_secs(300),
        }
    }
}

/// Builds the client configuration like kube-proxy does: the `--kubeconfig` file if given,
/// otherwise the in-cluster service account; `--master` overrides the server of either (and
/// alone means "this URL, no credentials", as in kube-proxy). The read timeout is set from
/// `timeouts.read` so a half-open connection cannot hang a list forever.
pub async fn config(
    kubeconfig: Option<&Path>,
    master: Option<&str>,
    timeouts: &Timeouts,
) -> Result<kube::Config, WatchError> {
    let master_uri = master
        .map(|url| {
            http::Uri::from_str(url).map_err(|source| WatchError::Master {
                url: url.to_owned(),
                source,
            })
        })
        .transpose()?;
    let mut config = match (kubeconfig, master_uri) {
        (Some(path), master_uri) => {
            let wrap = |source| WatchError::Kubeconfig {
                path: path.to_owned(),
                source,
            };
            let file = Kubeconfig::read_from(path).map_err(wrap)?;
            let mut config =
                kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                    .await
                    .map_err(wrap)?;
            if let Some(uri) = master_uri {
                config.cluster_url = uri;
            }
            config
        }
        (None, Some(uri)) => kube::Config::new(uri),
        (None, None) => {
            kube::Config::incluster().map_err(|source| WatchError::InCluster { source })?
        }
    };
    config.read_timeout = Some(timeouts.read);
    // Count the read timeout from the request, not from when a pooled connection went idle:
    // otherwise a connection idle for a minute would time out a minute early.
    config.reset_reader_on_write = true;
    Ok(config)
}

/// An API client from `--kubeconfig` / in-cluster config / `--master` (see [`config`]), with the
/// default [`Timeouts`].
pub async fn client(kubeconfig: Option<&Path>, master: Option<&str>) -> Result<Client, WatchError> {
    client_from(config(kubeconfig, master, &Timeouts::default()).await?)
}

/// An API client from a configuration built by [`config`].
pub fn client_from(config: kube::Config) -> Result<Client, WatchError> {
    let url = config.cluster_url.to_string();
    Client::try_from(config).map_err(|source| WatchError::Client { url, source })
}

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
    /// topology).
    pub fn needs_full(&self) -> bool {
        self.full || self.nodes > 0
    }

    /// Adds `other` to these changes (changes taken for a sync that failed count for the retry).
    pub fn merge(&mut self, other: Changes) {
        self.services += other.services;
        self.endpoint_slices += other.endpoint_slices;
        self.nodes += other.nodes;
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

/// The three watched kinds, as bits of the "has listed" mask.
const LISTED_SERVICES: u8 = 1;
const LISTED_SLICES: u8 = 2;
const LISTED_NODE: u8 = 4;
const LISTED_ALL: u8 = LISTED_SERVICES | LISTED_SLICES | LISTED_NODE;

/// State shared between the watcher tasks and the [`ClusterWatch`] handle.
struct Shared {
    state: RwLock<ClusterState>,
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
    fn new(started: SystemTime) -> Shared {
        Shared {
            state: RwLock::new(ClusterState::default()),
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

/// Starts the Service, EndpointSlice and Node watches with the default options. Must be called
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
        Api::all(client),
        base.fields(&format!("metadata.name={node_name}")),
        options,
        shared.clone(),
        Some(node_name),
    );
    ClusterWatch {
        shared,
        generation: generation_rx,
        listed: listed_rx,
        tasks: vec![
            tokio::spawn(services),
            tokio::spawn(slices),
            tokio::spawn(node),
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

    /// A copy of the current state.
    pub fn snapshot(&self) -> ClusterState {
        self.with_state(ClusterState::clone)
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
    /// A copy of the current state.
    pub fn snapshot(&self) -> ClusterState {
        self.shared
            .state
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
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
    fn convert(obj: &Self, dropped: &mut Vec<Rejected>) -> Result<Option<Self::Model>, Rejected>;
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
    Some(ServiceName {
        namespace: meta.namespace.clone()?,
        name: meta.name.clone()?,
    })
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
    ) -> Result<Option<model::EndpointSlice>, Rejected> {
        convert::endpoint_slice_noting(obj, dropped)
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
        let service = ServiceName {
            namespace: obj.namespace()?,
            name: obj.labels().get(convert::LABEL_SERVICE_NAME)?.clone(),
        };
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
    fn convert(obj: &Self, _dropped: &mut Vec<Rejected>) -> Result<Option<model::Node>, Rejected> {
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

/// A fixed delay between attempts (tests); production uses kube's client-go-like default.
struct FixedBackoff(Duration);

impl Iterator for FixedBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        Some(self.0)
    }
}

impl Backoff for FixedBackoff {
    fn reset(&mut self) {}
}

fn backoff(options: &WatchOptions) -> Box<dyn Backoff> {
    match options.retry_delay {
        Some(delay) => Box::new(FixedBackoff(delay)),
        None => Box::new(DefaultBackoff::default()),
    }
}

/// A backoff that starts over only after the API server answered with data.
///
/// kube's stream backoff resets on every `Ok` item, and the watcher yields `Event::Init` before
/// each list attempt, whether the list then succeeds or not: against an API server that was
/// never reachable the delay stayed at its first step (about one attempt a second, each logged
/// as "reachable again") instead of growing to its 30 s ceiling.
struct ProgressBackoff {
    inner: Box<dyn Backoff>,
    /// Set by the stream for every event but `Init`; taken by `reset`.
    answered: Arc<std::sync::atomic::AtomicBool>,
}

impl Iterator for ProgressBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        self.inner.next()
    }
}

impl Backoff for ProgressBackoff {
    fn reset(&mut self) {
        if self
            .answered
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            self.inner.reset();
        }
    }
}

/// Whether an event shows that the API server answered: everything but the `Init` the watcher
/// yields before it even tries to list.
fn is_answer<K>(event: &Event<K>) -> bool {
    !matches!(event, Event::Init)
}

/// One kind's watch: applies events to the shared state until the handle is dropped.
async fn run<K: Kind>(
    api: Api<K>,
    config: watcher::Config,
    options: WatchOptions,
    shared: Arc<Shared>,
    node_name: Option<String>,
) {
    let mut applier = Applier::<K>::new(shared, node_name);
    let answered = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = Arc::clone(&answered);
    // The flag is set before the backoff sees the item, so a real answer resets the delay at
    // once and an `Init` alone never does.
    let events = watcher::watcher(api, config).inspect(move |item| {
        if matches!(item, Ok(event) if is_answer(event)) {
            flag.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    });
    let mut stream = std::pin::pin!(events.backoff(ProgressBackoff {
        inner: backoff(&options),
        answered,
    }));
    let mut lost = false;
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => {
                if lost && is_answer(&event) {
                    tracing::info!(
                        kind = K::NAME,
                        "{} watch: API server reachable again",
                        K::NAME
                    );
                    lost = false;
                }
                applier.apply(event);
            }
            Err(watcher::Error::WatchError(status)) if status.code == 410 => {
                // Routine (history compacted while we were away, or a long quiet watch): the
                // watcher relists; the current state stays until the relist completes.
                tracing::info!(
                    kind = K::NAME,
                    "{} watch: resource version expired ({}); relisting",
                    K::NAME,
                    status.message
                );
            }
            Err(err) => {
                if lost {
                    tracing::debug!(kind = K::NAME, error = %err, "{} watch still failing", K::NAME);
                } else {
                    tracing::warn!(
                        kind = K::NAME,
                        "lost the API server ({} watch): {}; keeping the last known state and retrying",
                        K::NAME,
                        error_chain(&err)
                    );
                    lost = true;
                }
            }
        }
    }
    // With a backoff the watcher stream never ends; say so if it ever does.
    tracing::error!(
        kind = K::NAME,
        "{} watch ended; its objects are no longer updated",
        K::NAME
    );
}

/// Applies one kind's watcher events to the shared state.
struct Applier<K: Kind> {
    shared: Arc<Shared>,
    /// The objects of a relist in progress (`Init` … `InitDone`), and its rejected objects.
    relist: Option<Relist<K>>,
    /// resourceVersion of each object last reported as invalid, so a relist does not report it
    /// again.
    warned: HashMap<K::Key, String>,
    /// For the Node watch: the name watched, and whether it was present after the last event.
    node_name: Option<String>,
    node_present: Option<bool>,
}

struct Relist<K: Kind> {
    objects: BTreeMap<K::Key, K::Model>,
    rejected: BTreeMap<String, Rejected>,
    /// Trigger times by object key: recorded only for objects the relist changed.
    triggers: Vec<(K::Key, (ServiceName, SystemTime))>,
}

/// The outcome of converting one object.
enum Converted<K: Kind> {
    Use(K::Key, K::Model),
    /// Not used (invalid or ignored): absent downstream.
    Absent(K::Key, Option<Rejected>),
    /// No name at all: the API never sends this; nothing to key it by.
    Unkeyed,
}

impl<K: Kind> Applier<K> {
    fn new(shared: Arc<Shared>, node_name: Option<String>) -> Applier<K> {
        Applier {
            shared,
            relist: None,
            warned: HashMap::new(),
            node_name,
            node_present: None,
        }
    }

    fn apply(&mut self, event: Event<K>) {
        match event {
            Event::Init => {
                self.relist = Some(Relist {
                    objects: BTreeMap::new(),
                    rejected: BTreeMap::new(),
                    triggers: Vec::new(),
                });
            }
            Event::InitApply(obj) => {
                let converted = self.convert(&obj);
                let trigger = K::trigger(&obj).zip(K::key(&obj)).map(|(t, k)| (k, t));
                let Some(relist) = self.relist.as_mut() else {
                    // kube-runtime always sends Init first; if not, treat it as a plain apply
                    // rather than losing the object.
                    self.apply_one(converted);
                    return;
                };
                match converted {
                    Converted::Use(key, model) => {
                        relist.objects.insert(key, model);
                    }
                    Converted::Absent(key, Some(rejected)) => {
                        relist.rejected.insert(key.to_string(), rejected);
                    }
                    Converted::Absent(_, None) | Converted::Unkeyed => {}
                }
                relist.triggers.extend(trigger);
            }
            Event::InitDone => self.finish_relist(),
            Event::Apply(obj) => {
                let converted = self.convert(&obj);
                if self.apply_one(converted) {
                    self.note_trigger(&obj);
                }
            }
            Event::Delete(obj) => {
                let Some(key) = K::key(&obj) else { return };
                self.warned.remove(&key);
                if self.apply_one(Converted::Absent(key, None)) {
                    self.note_trigger(&obj);
                }
            }
        }
        self.check_node();
    }

    /// Converts `obj`, logging an invalid one once per resourceVersion.
    fn convert(&mut self, obj: &K) -> Converted<K> {
        let Some(key) = K::key(obj) else {
            tracing::warn!(kind = K::NAME, "{} without a name ignored", K::NAME);
            return Converted::Unkeyed;
        };
        let mut dropped = Vec::new();
        match K::convert(obj, &mut dropped) {
            Ok(Some(model)) => {
                let version = obj.resource_version().unwrap_or_default();
                if dropped.is_empty() {
                    self.warned.remove(&key);
                } else if self.warned.get(&key) != Some(&version) {
                    for report in &dropped {
                        tracing::warn!("{report}");
                    }
                    self.warned.insert(key.clone(), version);
                }
                Converted::Use(key, model)
            }
            Ok(None) => {
                self.warned.remove(&key);
                tracing::debug!(kind = K::NAME, "{} {key} not proxied", K::NAME);
                Converted::Absent(key, None)
            }
            Err(rejected) => {
                let version = obj.resource_version().unwrap_or_default();
                if self.warned.get(&key) != Some(&version) {
                    // Every part is object text: escaped, or a newline in a name could forge
                    // a log line.
                    let object = printable(&rejected.object);
                    let field = printable(&rejected.field);
                    let value = printable(&rejected.value);
                    tracing::warn!(
                        object = %object,
                        field = %field,
                        value = %value,
                        "{object} skipped: {field} = \"{value}\": {}",
                        printable(&rejected.reason)
                    );
                    self.warned.insert(key.clone(), version);
                }
                Converted::Absent(key, Some(rejected))
            }
        }
    }

    /// Inserts, replaces or removes one object; true if the state changed.
    fn apply_one(&mut self, converted: Converted<K>) -> bool {
        let (key, model, rejected) = match converted {
            Converted::Use(key, model) => (key, Some(model), None),
            Converted::Absent(key, rejected) => (key, None, rejected),
            Converted::Unkeyed => return false,
        };
        {
            let mut all = lock(&self.shared.rejected);
            let id = (K::NAME, key.to_string());
            match rejected {
                Some(r) => all.insert(id, r),
                None => all.remove(&id),
            };
        }
        // The state is written before the change is recorded: a sync loop that takes the
        // changes and then reads the state always sees what it was told about.
        let (changed, owners, services) = {
            let mut state = self
                .shared
                .state
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            let services = state.services.len();
            let map = K::map_mut(&mut state);
            let (changed, owners) = match model {
                Some(model) => {
                    if map.get(&key) == Some(&model) {
                        (false, [None, None])
                    } else {
                        let new_owner = K::service_of(&model);
                        let old = map.insert(key, model);
                        (true, [old.as_ref().and_then(K::service_of), new_owner])
                    }
                }
                None => match map.remove(&key) {
                    Some(old) => (true, [K::service_of(&old), None]),
                    None => (false, [None, None]),
                },
            };
            (changed, owners, services)
        };
        if changed {
            let mut changes = lock(&self.shared.changes);
            *K::counter(&mut changes) += 1;
            changes.note_services(owners.into_iter().flatten(), tracking_limit(services));
            drop(changes);
            self.shared.bump();
        }
        changed
    }

    fn note_trigger(&self, obj: &K) {
        if let Some(trigger) = K::trigger(obj) {
            record_triggers(&self.shared, std::iter::once(trigger));
        }
    }

    /// Replaces this kind's objects with the relisted ones in one step.
    fn finish_relist(&mut self) {
        let Some(relist) = self.relist.take() else {
            return;
        };
        {
            let mut all = lock(&self.shared.rejected);
            all.retain(|(kind, _), _| *kind != K::NAME);
            all.extend(
                relist
                    .rejected
                    .into_iter()
                    .map(|(key, r)| ((K::NAME, key), r)),
            );
        }
        let (changed, owners, services, triggers) = {
            let mut state = self
                .shared
                .state
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            let old = std::mem::replace(K::map_mut(&mut state), relist.objects);
            let services = state.services.len();
            if K::NAME == "Service" && services == 0 && !old.is_empty() {
                // kube-proxy follows such a list silently; it is more often an RBAC change or
                // a broken API server than a cluster whose every Service was deleted at once.
                tracing::warn!(
                    "the API server listed no Service at all after {} before: every Service \
                     rule is removed at the next sync (check the API server and \
                     nodeproxy's RBAC if that is not expected)",
                    old.len()
                );
            }
            let new = K::map(&state);
            let triggers: Vec<_> = relist
                .triggers
                .into_iter()
                .filter(|(key, _)| old.get(key) != new.get(key))
                .map(|(_, trigger)| trigger)
                .collect();
            let (changed, owners) = differences::<K>(&old, new);
            (changed, owners, services, triggers)
        };
        // Objects gone from the API need no "already warned" memory any more.
        let state = self
            .shared
            .state
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        let known = K::map(&state);
        let rejected = lock(&self.shared.rejected);
        self.warned.retain(|key, _| {
            known.contains_key(key) || rejected.contains_key(&(K::NAME, key.to_string()))
        });
        drop(rejected);
        drop(state);
        if changed > 0 {
            let mut changes = lock(&self.shared.changes);
            *K::counter(&mut changes) += changed;
            changes.note_services(owners, tracking_limit(services));
            drop(changes);
            record_triggers(&self.shared, triggers);
        }
        self.shared.listed.send_modify(|m| *m |= K::LISTED);
        // Also wakes a sync loop waiting for `ready` through `changed`.
        self.shared.bump();
    }

    /// For the Node watch: says loudly when our Node is missing, and when it appears.
    fn check_node(&mut self) {
        let Some(name) = &self.node_name else { return };
        if *self.shared.listed.borrow() & K::LISTED == 0 {
            return; // Not listed yet: absence means nothing.
        }
        let present = self.with_map(|m| m.keys().any(|k| k.to_string() == *name));
        if self.node_present == Some(present) {
            return;
        }
        if present {
            if self.node_present.is_some() {
                tracing::info!(node = %name, "Node {name} found");
            }
        } else {
            let rejected = lock(&self.shared.rejected).contains_key(&(K::NAME, name.clone()));
            if rejected {
                tracing::warn!(
                    node = %name,
                    "Node {name} is invalid (see above): NodePorts and local-traffic detection wait for a valid one"
                );
            } else {
                tracing::warn!(
                    node = %name,
                    "Node {name} not found: NodePorts and local-traffic detection wait for it; check --hostname-override"
                );
            }
        }
        self.node_present = Some(present);
    }

    fn with_map<R>(&self, f: impl FnOnce(&BTreeMap<K::Key, K::Model>) -> R) -> R {
        f(K::map(
            &self
                .shared
                .state
                .read()
                .unwrap_or_else(PoisonError::into_inner),
        ))
    }
}

/// An error with its causes, `outer: cause: root`: kube's top-level messages ("error reading a
/// body from connection") hide the part an operator needs ("timed out", "connection refused").
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        // Some layers repeat their cause's message in their own.
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// How many keys were added, removed or changed between two versions of one kind, and the
/// Services of the old and new versions of those objects.
fn differences<K: Kind>(
    old: &BTreeMap<K::Key, K::Model>,
    new: &BTreeMap<K::Key, K::Model>,
) -> (u64, BTreeSet<ServiceName>) {
    let mut count = 0usize;
    let mut owners = BTreeSet::new();
    for (k, v) in old {
        let now = new.get(k);
        if now != Some(v) {
            count += 1;
            owners.extend(K::service_of(v));
            owners.extend(now.and_then(K::service_of));
        }
    }
    for (k, v) in new {
        if !old.contains_key(k) {
            count += 1;
            owners.extend(K::service_of(v));
        }
    }
    (u64::try_from(count).unwrap_or(u64::MAX), owners)
}

fn record_triggers(shared: &Shared, triggers: impl IntoIterator<Item = (ServiceName, SystemTime)>) {
    let mut changes = lock(&shared.changes);
    for (service, at) in triggers {
        if at < shared.started {
            continue;
        }
        let times = changes.trigger_times.entry(service).or_default();
        if !times.contains(&at) {
            times.push(at);
            times.sort();
            times.truncate(MAX_TRIGGER_TIMES_PER_SERVICE);
        }
    }
}

#[cfg(test)]
mod tests;
