//! Kubernetes Events (events.k8s.io/v1) where the Service's owner looks: a `Warning` on a
//! Service the kernel rejected (quarantined on this node), a `Normal` one when it is programmed
//! again, and a `Normal` `Starting` on the Node when the daemon starts. `kubectl describe
//! service` then says why this node does not serve it.
//!
//! Events never stand in the sync's way: the sync thread hands each one over a bounded channel
//! ([`EventSink::send`] never blocks; a full queue drops the Event and counts it), and a task on
//! the daemon's runtime publishes them through kube-runtime's [`Recorder`] (which turns repeats
//! of one Event into a series). A failed publish is logged and counted, not retried: the next
//! change of the Service's state brings a new Event.
//!
//! A Service that flaps between rejected and programmed must not flood the API server, so on
//! top of the Recorder's series each Event passes a [`Limiter`]: per object a burst of
//! [`PER_OBJECT_BURST`], then one per [`PER_OBJECT_INTERVAL`] (client-go's spam filter refills
//! at the same pace), and overall a burst of [`GLOBAL_BURST`], then one per
//! [`GLOBAL_INTERVAL`]. An Event over the limit is held as its object's latest state and
//! published once the object's budget allows, so the last word on a Service is never a stale
//! Warning; one it replaces is dropped, counted and logged at debug.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::mpsc;

use crate::metrics::Metrics;
use crate::model::{ClusterState, ServiceName};
use crate::report;
use crate::sync::{Rejection, SyncOutcome};
use crate::token_bucket::{Rate, TokenBucket};

/// Per object (a Service, the Node): this many Events at once…
pub(super) const PER_OBJECT_BURST: u32 = 5;
/// …then one per this long: a Service flapping every sync costs the API server a handful of
/// writes per five minutes, and a Service that breaks once still gets its Warning and its
/// recovery at once.
pub(super) const PER_OBJECT_INTERVAL: Duration = Duration::from_secs(300);
/// Overall: this many Events at once…
pub(super) const GLOBAL_BURST: u32 = 30;
/// …then one per this long (30 a minute): many Services rejected at once (a kernel without a
/// feature) are reported without one node's proxy hammering the API server.
pub(super) const GLOBAL_INTERVAL: Duration = Duration::from_secs(2);

/// Events waiting for the publisher; beyond this the sync thread drops them (and counts them).
const QUEUE: usize = 256;
/// How often Events held back by the rate limit are tried again.
const RETRY_HELD: Duration = Duration::from_secs(10);
/// How long one publish may take: a slow API server delays Events, not the queue forever.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);
/// The API server refuses a note longer than this (kube-runtime's `Event::note`).
const MAX_NOTE: usize = 1024;
/// The reporting controller (`reportingController`); the instance is the node's name.
const CONTROLLER: &str = "nodeproxy";

/// One Event to publish.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Notice {
    pub(super) regarding: ObjectReference,
    pub(super) warning: bool,
    pub(super) reason: &'static str,
    pub(super) action: &'static str,
    pub(super) note: String,
}

/// What the rate limit counts Events by: kind, namespace and name of the object.
type ObjectKey = (String, String, String);

impl Notice {
    fn key(&self) -> ObjectKey {
        let r = &self.regarding;
        (
            r.kind.clone().unwrap_or_default(),
            r.namespace.clone().unwrap_or_default(),
            r.name.clone().unwrap_or_default(),
        )
    }

    /// The `Starting` Event on Node `node`, as kube-proxy records it (its uid is the node's
    /// name, which is what `kubectl describe node` looks for).
    pub(super) fn starting(node: &str) -> Notice {
        Notice {
            regarding: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(node.into()),
                uid: Some(node.into()),
                ..ObjectReference::default()
            },
            warning: false,
            reason: "Starting",
            action: "StartNodeproxy",
            note: format!("Starting nodeproxy {}.", env!("CARGO_PKG_VERSION")),
        }
    }

    /// The Warning on a Service the kernel refused on `node`.
    pub(super) fn rejected(
        name: &ServiceName,
        uid: Option<&str>,
        why: &Rejection,
        node: &str,
    ) -> Notice {
        Notice {
            regarding: service_ref(name, uid),
            warning: true,
            reason: "KernelRejected",
            action: "Quarantine",
            note: bounded(format!(
                "node {node}: the kernel refused {why}; the Service is left out of this node's \
                 rules (quarantined) until it or its endpoints change"
            )),
        }
    }

    /// The Normal Event on a Service programmed again on `node` after its quarantine.
    pub(super) fn programmed(name: &ServiceName, uid: Option<&str>, node: &str) -> Notice {
        Notice {
            regarding: service_ref(name, uid),
            warning: false,
            reason: "Programmed",
            action: "Release",
            note: format!(
                "node {node}: the kernel accepted the Service's rules after its quarantine; this \
                 node serves it again"
            ),
        }
    }
}

fn service_ref(name: &ServiceName, uid: Option<&str>) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Service".into()),
        namespace: Some(name.namespace().to_owned()),
        name: Some(name.name().to_owned()),
        uid: uid.map(str::to_owned),
        ..ObjectReference::default()
    }
}

/// `note` cut to what the API server accepts, at a character boundary.
fn bounded(mut note: String) -> String {
    if note.len() > MAX_NOTE {
        let mut end = MAX_NOTE - '…'.len_utf8();
        while !note.is_char_boundary(end) {
            end -= 1;
        }
        note.truncate(end);
        note.push('…');
    }
    note
}

/// The sync thread's end of the publisher: cheap to clone, never blocks.
#[derive(Clone)]
pub(super) struct EventSink {
    tx: Option<mpsc::Sender<Notice>>,
    metrics: Metrics,
    node: String,
}

impl EventSink {
    /// A sink that publishes nothing (tests of the writer).
    pub(super) fn disabled() -> EventSink {
        EventSink {
            tx: None,
            metrics: Metrics::new(),
            node: String::new(),
        }
    }

    /// Hands `notice` to the publisher, or drops and counts it when the queue is full.
    pub(super) fn send(&self, notice: Notice) {
        let Some(tx) = &self.tx else { return };
        if let Err(e) = tx.try_send(notice) {
            let notice = match e {
                mpsc::error::TrySendError::Full(n) | mpsc::error::TrySendError::Closed(n) => n,
            };
            self.metrics.inc_events_dropped("queue_full");
            tracing::debug!(
                "Event {} on {:?} dropped: the publisher is behind",
                notice.reason,
                notice.key()
            );
        }
    }

    /// The Events for a sync's quarantines and releases; `state` is what the sync built from
    /// (whole or scoped: it holds every Service the outcome names), for their uids.
    pub(super) fn quarantine_changes(&self, outcome: &SyncOutcome, state: &ClusterState) {
        if self.tx.is_none() {
            return;
        }
        let uid = |name: &ServiceName| {
            state
                .services
                .get(name)
                .and_then(|s| s.uid.as_ref())
                .map(ToString::to_string)
        };
        for (name, why) in &outcome.newly_quarantined {
            self.send(Notice::rejected(
                name,
                uid(name).as_deref(),
                why,
                &self.node,
            ));
        }
        for name in &outcome.released {
            self.send(Notice::programmed(name, uid(name).as_deref(), &self.node));
        }
    }
}

/// Starts the publisher on the current runtime; it ends once every sink is dropped and what
/// they queued is published (Events still held by the rate limit are dropped then).
pub(super) fn spawn(client: kube::Client, node: &str, metrics: Metrics) -> EventSink {
    let (tx, rx) = mpsc::channel(QUEUE);
    let reporter = Reporter {
        controller: CONTROLLER.into(),
        instance: Some(node.into()),
    };
    let recorder = Recorder::new(client, reporter);
    tokio::spawn(publish_loop(recorder, rx, metrics.clone()));
    EventSink {
        tx: Some(tx),
        metrics,
        node: node.into(),
    }
}

async fn publish_loop(recorder: Recorder, mut rx: mpsc::Receiver<Notice>, metrics: Metrics) {
    let mut limiter = Limiter::new(Limits::DEFAULT);
    let mut held: BTreeMap<ObjectKey, Notice> = BTreeMap::new();
    let mut retry = tokio::time::interval(RETRY_HELD);
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            notice = rx.recv() => {
                let Some(notice) = notice else { return };
                let key = notice.key();
                // An Event held for this object is older than this one: this one wins.
                if let Some(old) = held.remove(&key) {
                    suppressed(&metrics, &old);
                }
                if limiter.admit(&key, Instant::now()) {
                    publish(&recorder, &notice, &metrics).await;
                } else {
                    tracing::debug!(
                        "Event {} on {key:?} held back by the rate limit",
                        notice.reason
                    );
                    held.insert(key, notice);
                }
            }
            _ = retry.tick() => {
                let now = Instant::now();
                let ready: Vec<ObjectKey> = held
                    .keys()
                    .filter(|k| limiter.admit(k, now))
                    .cloned()
                    .collect();
                for key in ready {
                    if let Some(notice) = held.remove(&key) {
                        publish(&recorder, &notice, &metrics).await;
                    }
                }
                limiter.forget_idle(now);
            }
        }
    }
}

fn suppressed(metrics: &Metrics, notice: &Notice) {
    metrics.inc_events_dropped("rate_limited");
    tracing::debug!(
        "Event {} on {:?} suppressed by the rate limit (a newer one replaces it)",
        notice.reason,
        notice.key()
    );
}

async fn publish(recorder: &Recorder, notice: &Notice, metrics: &Metrics) {
    let event = Event {
        type_: if notice.warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: notice.reason.into(),
        note: Some(notice.note.clone()),
        action: notice.action.into(),
        secondary: None,
    };
    let failure =
        match tokio::time::timeout(PUBLISH_TIMEOUT, recorder.publish(&event, &notice.regarding))
            .await
        {
            Ok(Ok(())) => return,
            Ok(Err(e)) => report::chain(&e).to_string(),
            Err(_) => format!("no answer within {PUBLISH_TIMEOUT:?}"),
        };
    metrics.inc_events_dropped("publish_failed");
    tracing::warn!(
        "cannot record Event {} on {:?}: {failure}",
        notice.reason,
        notice.key()
    );
}

/// The rate limit's parameters: per object and overall, a burst and then one Event per
/// interval.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub(super) per_object: Rate,
    pub(super) global: Rate,
}

impl Limits {
    pub(super) const DEFAULT: Limits = Limits {
        per_object: Rate {
            burst: PER_OBJECT_BURST,
            interval: PER_OBJECT_INTERVAL,
        },
        global: Rate {
            burst: GLOBAL_BURST,
            interval: GLOBAL_INTERVAL,
        },
    };
}

/// `bucket` after one more Event at `now`, if it has a token for it. An Event over the limit is
/// refused, not delayed (the publisher holds it as its object's latest state instead), so a
/// token that would have to be waited for is not taken.
fn admit_one(bucket: TokenBucket, now: Instant, rate: Rate) -> Option<TokenBucket> {
    let (after, wait) = bucket.take(now, rate)?;
    wait.is_zero().then_some(after)
}

/// The per-object and overall rate limit; pure, so it is unit-tested with made-up instants.
#[derive(Debug)]
pub(super) struct Limiter {
    limits: Limits,
    global: TokenBucket,
    objects: BTreeMap<ObjectKey, TokenBucket>,
}

impl Limiter {
    pub(super) fn new(limits: Limits) -> Limiter {
        Limiter {
            limits,
            global: TokenBucket::FULL,
            objects: BTreeMap::new(),
        }
    }

    /// Whether an Event about `key` may be published at `now`; if so, it is counted (in both
    /// budgets: one refused by either costs neither).
    pub(super) fn admit(&mut self, key: &ObjectKey, now: Instant) -> bool {
        let object = self.objects.get(key).copied().unwrap_or(TokenBucket::FULL);
        let Some(object) = admit_one(object, now, self.limits.per_object) else {
            return false;
        };
        let Some(global) = admit_one(self.global, now, self.limits.global) else {
            return false;
        };
        self.global = global;
        self.objects.insert(key.clone(), object);
        true
    }

    /// Forgets the objects whose budget is whole again: remembering them would change nothing,
    /// and Services come and go.
    pub(super) fn forget_idle(&mut self, now: Instant) {
        self.objects.retain(|_, b| !b.is_full(now));
    }

    #[cfg(test)]
    pub(super) fn tracked(&self) -> usize {
        self.objects.len()
    }
}

#[cfg(test)]
mod tests;
