//! One watch's loop: kube-runtime events, with backoff, applied to the shared state as
//! validated model objects, each change noted for the incremental sync.

use super::*;
use crate::report;

/// A fixed delay between attempts (tests); production uses kube's client-go-like default.
pub(super) struct FixedBackoff(Duration);

impl Iterator for FixedBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        Some(self.0)
    }
}

impl Backoff for FixedBackoff {
    fn reset(&mut self) {}
}

pub(super) fn backoff(options: &WatchOptions) -> Box<dyn Backoff> {
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
pub(super) struct ProgressBackoff {
    pub(super) inner: Box<dyn Backoff>,
    /// Set by the stream for every event but `Init`; taken by `reset`.
    pub(super) answered: Arc<std::sync::atomic::AtomicBool>,
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
pub(super) fn is_answer<K>(event: &Event<K>) -> bool {
    !matches!(event, Event::Init)
}

/// One kind's watch: applies events to the shared state until the handle is dropped.
pub(super) async fn run<K: Kind>(
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
                    tracing::debug!(kind = K::NAME, error = %report::chain(&err), "{} watch still failing", K::NAME);
                } else {
                    tracing::warn!(
                        kind = K::NAME,
                        "lost the API server ({} watch): {}; keeping the last known state and retrying",
                        K::NAME,
                        report::chain(&err)
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
pub(super) struct Applier<K: Kind> {
    pub(super) shared: Arc<Shared>,
    /// The objects of a relist in progress (`Init` … `InitDone`), and its rejected objects.
    pub(super) relist: Option<Relist<K>>,
    /// resourceVersion of each object last reported as invalid, so a relist does not report it
    /// again.
    pub(super) warned: HashMap<K::Key, String>,
    /// For the Node watch: the name watched, and whether it was present after the last event.
    pub(super) node_name: Option<String>,
    pub(super) node_present: Option<bool>,
    /// The endpoints' shared nodes and zones (EndpointSlices only).
    pub(super) names: NameTable,
}

pub(super) struct Relist<K: Kind> {
    pub(super) objects: BTreeMap<K::Key, K::Model>,
    pub(super) rejected: BTreeMap<String, Rejected>,
    /// Trigger times by object key: recorded only for objects the relist changed.
    pub(super) triggers: Vec<(K::Key, (ServiceName, SystemTime))>,
}

/// The outcome of converting one object.
pub(super) enum Converted<K: Kind> {
    Use(K::Key, K::Model),
    /// Not used (invalid or ignored): absent downstream.
    Absent(K::Key, Option<Rejected>),
    /// No name at all: the API never sends this; nothing to key it by.
    Unkeyed,
}

impl<K: Kind> Applier<K> {
    pub(super) fn new(shared: Arc<Shared>, node_name: Option<String>) -> Applier<K> {
        Applier {
            shared,
            relist: None,
            warned: HashMap::new(),
            node_name,
            node_present: None,
            names: NameTable::default(),
        }
    }

    pub(super) fn apply(&mut self, event: Event<K>) {
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
    pub(super) fn convert(&mut self, obj: &K) -> Converted<K> {
        let Some(key) = K::key(obj) else {
            tracing::warn!(kind = K::NAME, "{} without a name ignored", K::NAME);
            return Converted::Unkeyed;
        };
        let mut dropped = Vec::new();
        match K::convert(obj, &mut dropped, &mut self.names) {
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
    pub(super) fn apply_one(&mut self, converted: Converted<K>) -> bool {
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
            let mut shared = self
                .shared
                .state
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            let services = shared.services.len();
            // Compared before `make_mut`, which copies a state a sync still holds: an event
            // that changes nothing copies nothing.
            let current = K::map(&shared).get(&key);
            let (changed, owners) = match model {
                Some(model) if current == Some(&model) => (false, [None, None]),
                Some(model) => {
                    let new_owner = K::service_of(&model);
                    let old = K::map_mut(Arc::make_mut(&mut shared)).insert(key, model);
                    (true, [old.as_ref().and_then(K::service_of), new_owner])
                }
                None if current.is_none() => (false, [None, None]),
                None => {
                    let old = K::map_mut(Arc::make_mut(&mut shared)).remove(&key);
                    (true, [old.as_ref().and_then(K::service_of), None])
                }
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

    pub(super) fn note_trigger(&self, obj: &K) {
        if let Some(trigger) = K::trigger(obj) {
            record_triggers(&self.shared, std::iter::once(trigger));
        }
    }

    /// Replaces this kind's objects with the relisted ones in one step.
    pub(super) fn finish_relist(&mut self) {
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
        // Rebuilt in one go, which fills the B-tree's nodes: a list arrives in key order, and
        // inserted in key order a B-tree keeps its leaves about half full (3.2 of the model's
        // 19.4 MB at 10k Services × 10 endpoints). Outside the lock: the syncer reads the state.
        let objects: BTreeMap<_, _> = relist.objects.into_iter().collect();
        let (changed, owners, services, triggers) = {
            let mut shared = self
                .shared
                .state
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            let state = Arc::make_mut(&mut shared);
            let old = std::mem::replace(K::map_mut(state), objects);
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
            let new = K::map(state);
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
    pub(super) fn check_node(&mut self) {
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

    pub(super) fn with_map<R>(&self, f: impl FnOnce(&BTreeMap<K::Key, K::Model>) -> R) -> R {
        f(K::map(
            &self
                .shared
                .state
                .read()
                .unwrap_or_else(PoisonError::into_inner),
        ))
    }
}

/// How many keys were added, removed or changed between two versions of one kind, and the
/// Services of the old and new versions of those objects.
pub(super) fn differences<K: Kind>(
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

pub(super) fn record_triggers(
    shared: &Shared,
    triggers: impl IntoIterator<Item = (ServiceName, SystemTime)>,
) {
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
