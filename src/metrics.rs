//! Prometheus metrics: kube-proxy's names, types, labels and buckets where the meaning is the same,
//! plus nodeproxy's own `nodeproxy_*` series.
//!
//! Dashboards and alerts written for kube-proxy's nftables mode keep working because the
//! `kubeproxy_*` series below match upstream exactly, including the `ip_family` label (values
//! `IPv4` / `IPv6`) that kube-proxy ≥ 1.33 puts on its sync metrics. nodeproxy programs both
//! families in one sync, so a sync that covered both is recorded once per family, which is what a
//! dual-stack kube-proxy (one proxier per family) would have exported.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets, linear_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use hyper::StatusCode;

use crate::http::{self, Handler};
use crate::model::IpFamily;

/// The content type of [`Metrics::encode`]'s output (OpenMetrics text; Prometheus asks for it and
/// parses it natively).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Which kind of sync a duration belongs to (kube-proxy splits the histogram the same way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncKind {
    /// Every object rewritten/reconciled (start-up, periodic, after a failure).
    Full,
    /// Only what changed since the last sync.
    Partial,
}

/// The `traffic_policy` label of `kubeproxy_sync_proxy_rules_no_local_endpoints_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// `internalTrafficPolicy: Local`.
    Internal,
    /// `externalTrafficPolicy: Local`.
    External,
}

impl PolicyKind {
    fn label(self) -> &'static str {
        match self {
            PolicyKind::Internal => "internal",
            PolicyKind::External => "external",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FamilyLabels {
    ip_family: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabels {
    ip_family: &'static str,
    traffic_policy: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabels {
    code: u16,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;
type F64Gauge = Gauge<f64, AtomicU64>;

fn family_label(family: IpFamily) -> FamilyLabels {
    FamilyLabels {
        // kube-proxy's label values are the API's `v1.IPFamily` strings, which `Display` matches.
        ip_family: match family {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        },
    }
}

/// kube-proxy's sync duration buckets: 1 ms × 2^0..14 (1 ms … 16.384 s).
fn sync_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// kube-proxy's network programming buckets. Upstream's `merge` helper starts from a zero-valued
/// slice, so its first bucket is `le="0"`; it is kept so that bucket-wise queries line up.
fn network_programming_histogram() -> Histogram {
    let buckets = std::iter::once(0.0)
        .chain(linear_buckets(0.25, 0.25, 2)) // 0.25 s, 0.5 s
        .chain(linear_buckets(1.0, 1.0, 59)) // 1 … 59 s
        .chain(linear_buckets(60.0, 5.0, 12)) // 60 … 115 s
        .chain(linear_buckets(120.0, 30.0, 7)); // 2 … 5 min
    Histogram::new(buckets)
}

fn seconds_since_epoch(at: SystemTime) -> f64 {
    // A clock before 1970 is a broken clock; 0 is the honest "unknown" for a timestamp gauge.
    at.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// All metrics nodeproxy exports. Cheap to clone; clones share the same series.
#[derive(Clone, Debug)]
pub struct Metrics {
    registry: Arc<Registry>,
    sync_duration: HistogramFamily<FamilyLabels>,
    sync_full_duration: HistogramFamily<FamilyLabels>,
    sync_partial_duration: HistogramFamily<FamilyLabels>,
    network_programming: HistogramFamily<FamilyLabels>,
    last_sync: Family<FamilyLabels, F64Gauge>,
    last_queued: Family<FamilyLabels, F64Gauge>,
    endpoint_changes: Family<FamilyLabels, Counter>,
    service_changes: Family<FamilyLabels, Counter>,
    no_local_endpoints: Family<PolicyLabels, Gauge>,
    sync_failures: Family<FamilyLabels, Counter>,
    healthz: Family<CodeLabels, Counter>,
    livez: Family<CodeLabels, Counter>,
    conntrack_deleted: Family<FamilyLabels, Counter>,
    quarantined: Gauge,
    address_conflicts: Gauge,
    drift_repairs: Family<FamilyLabels, Counter>,
    kernel_rejections: Family<KindLabels, Counter>,
    events_dropped: Family<ReasonLabels, Counter>,
    transaction_bytes: Histogram,
    transaction_messages: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every series registered (and none observed yet).
    pub fn new() -> Metrics {
        let hist = || HistogramFamily::<FamilyLabels>::new_with_constructor(sync_histogram as _);
        let m = Metrics {
            registry: Arc::new(Registry::default()),
            sync_duration: hist(),
            sync_full_duration: hist(),
            sync_partial_duration: hist(),
            network_programming: HistogramFamily::new_with_constructor(
                network_programming_histogram as _,
            ),
            last_sync: Family::default(),
            last_queued: Family::default(),
            endpoint_changes: Family::default(),
            service_changes: Family::default(),
            no_local_endpoints: Family::default(),
            sync_failures: Family::default(),
            healthz: Family::default(),
            livez: Family::default(),
            conntrack_deleted: Family::default(),
            quarantined: Gauge::default(),
            address_conflicts: Gauge::default(),
            drift_repairs: Family::default(),
            kernel_rejections: Family::default(),
            events_dropped: Family::default(),
            // 256 B … 64 MiB: one-element changes up to cold loads of very large clusters.
            transaction_bytes: Histogram::new(exponential_buckets(256.0, 4.0, 10)),
            // 1 … 262144 netlink messages.
            transaction_messages: Histogram::new(exponential_buckets(1.0, 4.0, 10)),
        };
        let mut r = Registry::default();
        // Counters are registered without `_total`: the encoder appends it (OpenMetrics rule).
        r.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            m.sync_duration.clone(),
        );
        r.register(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            m.sync_full_duration.clone(),
        );
        r.register(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            m.sync_partial_duration.clone(),
        );
        r.register(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            m.network_programming.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            m.last_sync.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            m.last_queued.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            m.endpoint_changes.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            m.service_changes.clone(),
        );
        // A gauge despite the `_total` suffix, exactly as upstream defines it.
        r.register(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            m.no_local_endpoints.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_nftables_sync_failures",
            "Cumulative proxy nftables sync failures",
            m.sync_failures.clone(),
        );
        r.register(
            "kubeproxy_proxy_healthz",
            "Cumulative proxy healthz HTTP status",
            m.healthz.clone(),
        );
        r.register(
            "kubeproxy_proxy_livez",
            "Cumulative proxy livez HTTP status",
            m.livez.clone(),
        );
        r.register(
            "kubeproxy_conntrack_reconciler_deleted_entries",
            "Cumulative conntrack flows deleted by conntrack reconciler",
            m.conntrack_deleted.clone(),
        );
        r.register(
            "nodeproxy_quarantined_services",
            "Service ports left out of the ruleset because the kernel rejected their objects",
            m.quarantined.clone(),
        );
        r.register(
            "nodeproxy_service_address_conflicts",
            "Address and port claims a Service lost to another at the last full sync \
             (ClusterIP before load-balancer IP before externalIP, then the older Service)",
            m.address_conflicts.clone(),
        );
        r.register(
            "nodeproxy_drift_repairs",
            "Times the kernel's tables differed from what nodeproxy last wrote and were repaired",
            m.drift_repairs.clone(),
        );
        r.register(
            "nodeproxy_kernel_rejections",
            "Operations the kernel rejected in nodeproxy's transactions, by kind (not_found, \
             exists, busy, permission, invalid, other), including those a retry or a \
             quarantine then resolved",
            m.kernel_rejections.clone(),
        );
        r.register(
            "nodeproxy_events_dropped",
            "Kubernetes Events not published, by reason (rate_limited: suppressed by the per-object \
             or overall rate limit; queue_full: the publisher was behind; publish_failed: the API \
             server refused or did not answer)",
            m.events_dropped.clone(),
        );
        r.register(
            "nodeproxy_transaction_bytes",
            "Size in bytes of each nftables netlink transaction sent",
            m.transaction_bytes.clone(),
        );
        r.register(
            "nodeproxy_transaction_messages",
            "Number of netlink messages in each nftables transaction sent",
            m.transaction_messages.clone(),
        );
        Metrics {
            registry: Arc::new(r),
            ..m
        }
    }

    /// One sync's duration, for every family it covered: feeds the overall histogram and the
    /// full or partial one.
    pub fn observe_sync(&self, families: &[IpFamily], kind: SyncKind, duration: Duration) {
        let secs = duration.as_secs_f64();
        for &f in families {
            let l = family_label(f);
            self.sync_duration.get_or_create(&l).observe(secs);
            match kind {
                SyncKind::Full => self.sync_full_duration.get_or_create(&l).observe(secs),
                SyncKind::Partial => self.sync_partial_duration.get_or_create(&l).observe(secs),
            }
        }
    }

    /// Time from an EndpointSlice change (its `endpoints.kubernetes.io/last-change-trigger-time`)
    /// to the rules being programmed.
    pub fn observe_network_programming(&self, family: IpFamily, latency: Duration) {
        self.network_programming
            .get_or_create(&family_label(family))
            .observe(latency.as_secs_f64());
    }

    /// A sync succeeded at `at`.
    pub fn set_last_sync_timestamp(&self, families: &[IpFamily], at: SystemTime) {
        for &f in families {
            self.last_sync
                .get_or_create(&family_label(f))
                .set(seconds_since_epoch(at));
        }
    }

    /// A change was queued for the next sync at `at`.
    pub fn set_last_queued_timestamp(&self, families: &[IpFamily], at: SystemTime) {
        for &f in families {
            self.last_queued
                .get_or_create(&family_label(f))
                .set(seconds_since_epoch(at));
        }
    }

    /// `n` EndpointSlice changes seen.
    pub fn add_endpoint_changes(&self, family: IpFamily, n: u64) {
        self.endpoint_changes
            .get_or_create(&family_label(family))
            .inc_by(n);
    }

    /// `n` Service changes seen.
    pub fn add_service_changes(&self, family: IpFamily, n: u64) {
        self.service_changes
            .get_or_create(&family_label(family))
            .inc_by(n);
    }

    /// How many Services with a Local `policy` have no local endpoints (set after each sync).
    pub fn set_no_local_endpoints(&self, family: IpFamily, policy: PolicyKind, services: usize) {
        let labels = PolicyLabels {
            ip_family: family_label(family).ip_family,
            traffic_policy: policy.label(),
        };
        self.no_local_endpoints
            .get_or_create(&labels)
            .set(i64::try_from(services).unwrap_or(i64::MAX));
    }

    /// A transaction for `family`'s table failed.
    pub fn inc_sync_failures(&self, family: IpFamily) {
        self.sync_failures
            .get_or_create(&family_label(family))
            .inc();
    }

    /// `/healthz` answered with `code`.
    pub fn inc_healthz(&self, code: u16) {
        self.healthz.get_or_create(&CodeLabels { code }).inc();
    }

    /// `/livez` answered with `code`.
    pub fn inc_livez(&self, code: u16) {
        self.livez.get_or_create(&CodeLabels { code }).inc();
    }

    /// The conntrack reconciler deleted `n` stale flows.
    pub fn add_conntrack_deleted(&self, family: IpFamily, n: u64) {
        self.conntrack_deleted
            .get_or_create(&family_label(family))
            .inc_by(n);
    }

    /// How many address and port claims a Service lost to another at the last full sync.
    pub fn set_address_conflicts(&self, n: usize) {
        self.address_conflicts
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// How many Service ports are currently quarantined.
    pub fn set_quarantined_services(&self, n: usize) {
        self.quarantined.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Drift (someone else changed or deleted our table) was found in `family` and repaired.
    pub fn inc_drift_repairs(&self, family: IpFamily) {
        self.drift_repairs
            .get_or_create(&family_label(family))
            .inc();
    }

    /// The kernel rejected one operation of ours; `kind` is `nft::ReplyKind::label`.
    pub fn inc_kernel_rejections(&self, kind: &'static str) {
        self.kernel_rejections
            .get_or_create(&KindLabels { kind })
            .inc();
    }

    /// A Kubernetes Event was not published; `reason` is `rate_limited`, `queue_full` or
    /// `publish_failed`.
    pub fn inc_events_dropped(&self, reason: &'static str) {
        self.events_dropped
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// One netlink transaction was sent.
    pub fn observe_transaction(&self, messages: usize, bytes: usize) {
        // usize → f64 loses precision only above 2^53, far beyond any netlink batch.
        self.transaction_messages.observe(messages as f64);
        self.transaction_bytes.observe(bytes as f64);
    }

    /// The registry in OpenMetrics text format (see [`CONTENT_TYPE`]).
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// The metrics server's routes (kube-proxy's `--metrics-bind-address`): `/metrics`, a plain
/// `/healthz`, and `/proxyMode`.
pub fn handler(metrics: Metrics) -> Handler {
    const TEXT: &str = "text/plain; charset=utf-8";
    Arc::new(move |req| match req.uri().path() {
        "/metrics" => match metrics.encode() {
            Ok(text) => http::respond(StatusCode::OK, CONTENT_TYPE, text),
            Err(e) => http::respond(
                StatusCode::INTERNAL_SERVER_ERROR,
                TEXT,
                format!("encoding metrics failed: {e}\n"),
            ),
        },
        "/healthz" => http::respond(StatusCode::OK, TEXT, "ok"),
        "/proxyMode" => http::respond(StatusCode::OK, TEXT, "nftables"),
        _ => http::not_found(),
    })
}

#[cfg(test)]
mod tests;
