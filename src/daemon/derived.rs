//! What the sync thread derives from the Services after each sync (the health-check node ports'
//! Services, the UDP serving endpoints the conntrack reconciler compares, the
//! no-local-endpoints gauges), cached per Service so that a sync of a few changed Services
//! recomputes only theirs: at 10k Services a pass over the cluster costs more than the sync.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use crate::conntrack::UdpService;
use crate::health::HealthCheckService;
use crate::model::{
    ClusterState, EndpointSlice, IpFamily, Protocol, Service, ServiceName, ServicePortName,
    TrafficPolicy, endpoints_for,
};
use crate::ruleset::categorize::{NodeView, categorize};

use super::FAMILIES;

/// Per family, in [`FAMILIES`] order: `(internal, external)` Local-policy Service ports that
/// have endpoints, but none on this node.
pub(super) type NoLocal = [(usize, usize); 2];

/// Serving endpoints (ready, or terminating but serving) of UDP Service ports, per family.
pub(super) type UdpEndpoints = BTreeMap<(IpFamily, ServicePortName), BTreeSet<IpAddr>>;

/// The UDP ports of one Service, as the conntrack reconciler sees them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) struct Udp {
    /// What decides whether the reconciler runs: it does when these change.
    pub endpoints: UdpEndpoints,
    /// What the reconciler is given.
    pub services: Vec<(IpFamily, UdpService)>,
}

/// Everything derived from one Service.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) struct Derived {
    pub health_check: Option<HealthCheckService>,
    /// `None` when the Service has no UDP port with a ClusterIP.
    pub udp: Option<Udp>,
    pub no_local: NoLocal,
}

impl Derived {
    /// `slices`: all of the Service's EndpointSlices, of every family.
    pub(super) fn of(svc: &Service, slices: &[&EndpointSlice], node: &NodeView<'_>) -> Derived {
        let mut udp = Udp::default();
        let mut no_local = NoLocal::default();
        for (i, f) in FAMILIES.into_iter().enumerate() {
            let Some(cluster_ip) = svc.cluster_ip(f) else {
                continue;
            };
            let family_slices: Vec<&EndpointSlice> =
                slices.iter().copied().filter(|s| s.family == f).collect();
            let ips: Vec<IpAddr> = std::iter::once(cluster_ip)
                .chain(svc.external_ips.iter().copied())
                .chain(svc.load_balancer_ips.iter().copied())
                .filter(|ip| IpFamily::of(ip) == f)
                .collect();
            let external_ips = svc
                .external_ips
                .iter()
                .chain(&svc.load_balancer_ips)
                .any(|ip| IpFamily::of(ip) == f);
            for port in &svc.ports {
                let eps = endpoints_for(&family_slices, port);
                if port.protocol == Protocol::Udp {
                    let serving: Vec<IpAddr> = eps
                        .iter()
                        .filter(|ep| ep.conditions.ready || ep.conditions.serving)
                        .map(|ep| ep.addr)
                        .collect();
                    udp.endpoints
                        .insert((f, svc.port_name(port)), serving.iter().copied().collect());
                    udp.services.push((
                        f,
                        UdpService {
                            ips: ips.clone(),
                            port: port.port,
                            node_port: port.node_port,
                            serving_endpoints: serving,
                        },
                    ));
                }
                let c = categorize(&eps, node);
                if !c.has_endpoints || !c.local.is_empty() {
                    continue;
                }
                if svc.internal_traffic_policy == TrafficPolicy::Local {
                    no_local[i].0 += 1;
                }
                if svc.external_traffic_policy == TrafficPolicy::Local
                    && (port.node_port.is_some() || external_ips)
                {
                    no_local[i].1 += 1;
                }
            }
        }
        Derived {
            health_check: health_check(svc, slices, node.name),
            udp: (!udp.endpoints.is_empty()).then_some(udp),
            no_local,
        }
    }
}

/// The health-check node port of an `externalTrafficPolicy: Local` Service, with its ready
/// endpoints on this node (terminating ones do not count, so a draining node fails the check).
/// An endpoint is counted once however many ports it serves.
fn health_check(
    svc: &Service,
    slices: &[&EndpointSlice],
    node_name: &str,
) -> Option<HealthCheckService> {
    if svc.external_traffic_policy != TrafficPolicy::Local {
        return None;
    }
    let port = svc.health_check_node_port?;
    let mut local = BTreeSet::new();
    for p in &svc.ports {
        for ep in endpoints_for(slices, p) {
            if ep.node_name == Some(node_name) && ep.conditions.ready {
                local.insert(ep.addr);
            }
        }
    }
    Some(HealthCheckService {
        namespace: svc.name.namespace().to_owned(),
        name: svc.name.name().to_owned(),
        port,
        local_endpoints: local.len(),
    })
}

/// What an update of the caches changed, for the work that follows a sync.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Delta {
    /// The families whose UDP serving endpoints changed (every family on the first build).
    pub udp_families: BTreeSet<IpFamily>,
    /// Whether the health-check Services changed.
    pub health_checks: bool,
}

/// [`Derived`] of every Service as of the last successful sync, stored by aspect so that each
/// consumer reads only the Services it concerns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Caches {
    /// False until the first build: everything counts as changed then (stale conntrack entries
    /// may predate a restart).
    built: bool,
    health_checks: BTreeMap<ServiceName, HealthCheckService>,
    udp: BTreeMap<ServiceName, Udp>,
    /// Only the Services with a non-zero count.
    no_local: BTreeMap<ServiceName, NoLocal>,
    no_local_total: NoLocal,
}

fn node_view<'a>(state: &'a ClusterState, node_name: &'a str) -> NodeView<'a> {
    NodeView {
        name: node_name,
        zone: state.nodes.get(node_name).and_then(|n| n.zone.as_deref()),
    }
}

fn slices_of<'s, 'a>(
    index: &'s HashMap<&ServiceName, Vec<&'a EndpointSlice>>,
    name: &ServiceName,
) -> &'s [&'a EndpointSlice] {
    index.get(name).map(Vec::as_slice).unwrap_or_default()
}

impl Caches {
    pub(super) fn is_built(&self) -> bool {
        self.built
    }

    /// Recomputes every Service from the whole state.
    pub(super) fn rebuild(&mut self, state: &ClusterState, node_name: &str) -> Delta {
        let index = state.slices_by_service();
        let node = node_view(state, node_name);
        let mut fresh = Caches {
            built: true,
            ..Caches::default()
        };
        for svc in state.services.values() {
            let derived = Derived::of(svc, slices_of(&index, &svc.name), &node);
            fresh.replace(&svc.name, Some(derived));
        }
        let delta = if self.built {
            Delta {
                udp_families: FAMILIES
                    .into_iter()
                    .filter(|&f| udp_differs(&self.udp, &fresh.udp, f))
                    .collect(),
                health_checks: self.health_checks != fresh.health_checks,
            }
        } else {
            Delta {
                udp_families: FAMILIES.into_iter().collect(),
                health_checks: true,
            }
        };
        *self = fresh;
        delta
    }

    /// Recomputes the `changed` Services from `scoped`, which holds them (those that still
    /// exist), all their EndpointSlices and the Nodes. Only after a [`Caches::rebuild`].
    pub(super) fn update(
        &mut self,
        scoped: &ClusterState,
        changed: &BTreeSet<ServiceName>,
        node_name: &str,
    ) -> Delta {
        let index = scoped.slices_by_service();
        let node = node_view(scoped, node_name);
        let mut delta = Delta::default();
        for name in changed {
            let derived = scoped
                .services
                .get(name)
                .map(|svc| Derived::of(svc, slices_of(&index, name), &node));
            let old = self.replace(name, derived);
            let new = self.get(name);
            if old.health_check != new.health_check {
                delta.health_checks = true;
            }
            for f in FAMILIES {
                if !family_endpoints(old.udp.iter(), f).eq(family_endpoints(new.udp.iter(), f)) {
                    delta.udp_families.insert(f);
                }
            }
        }
        delta
    }

    /// What is cached for `name` (the default for an unknown Service).
    fn get(&self, name: &ServiceName) -> Derived {
        Derived {
            health_check: self.health_checks.get(name).cloned(),
            udp: self.udp.get(name).cloned(),
            no_local: self.no_local.get(name).copied().unwrap_or_default(),
        }
    }

    /// Stores `derived` for `name` (`None`: the Service is gone); returns what was stored.
    fn replace(&mut self, name: &ServiceName, derived: Option<Derived>) -> Derived {
        let old = self.get(name);
        let new = derived.unwrap_or_default();
        match new.health_check {
            Some(h) => self.health_checks.insert(name.clone(), h),
            None => self.health_checks.remove(name),
        };
        match new.udp {
            Some(u) => self.udp.insert(name.clone(), u),
            None => self.udp.remove(name),
        };
        for (total, (o, n)) in self
            .no_local_total
            .iter_mut()
            .zip(old.no_local.iter().zip(&new.no_local))
        {
            total.0 = total.0.saturating_sub(o.0) + n.0;
            total.1 = total.1.saturating_sub(o.1) + n.1;
        }
        if new.no_local == NoLocal::default() {
            self.no_local.remove(name);
        } else {
            self.no_local.insert(name.clone(), new.no_local);
        }
        old
    }

    /// The health-check node ports to serve.
    pub(super) fn health_checks(&self) -> Vec<HealthCheckService> {
        self.health_checks.values().cloned().collect()
    }

    pub(super) fn has_health_checks(&self) -> bool {
        !self.health_checks.is_empty()
    }

    /// Every UDP Service port of `family`, for the conntrack reconciler.
    pub(super) fn udp_services(&self, family: IpFamily) -> Vec<UdpService> {
        self.udp
            .values()
            .flat_map(|u| &u.services)
            .filter(|(f, _)| *f == family)
            .map(|(_, s)| s.clone())
            .collect()
    }

    /// `(internal, external)` for `family`: kube-proxy's `no_local_endpoints_total` gauges.
    pub(super) fn no_local(&self, family: IpFamily) -> (usize, usize) {
        FAMILIES
            .iter()
            .position(|&f| f == family)
            .and_then(|i| self.no_local_total.get(i).copied())
            .unwrap_or_default()
    }
}

/// The UDP serving endpoints of `family` among `udp`, in order.
fn family_endpoints<'a>(
    udp: impl Iterator<Item = &'a Udp>,
    family: IpFamily,
) -> impl Iterator<Item = (&'a (IpFamily, ServicePortName), &'a BTreeSet<IpAddr>)> {
    udp.flat_map(|u| u.endpoints.iter())
        .filter(move |((f, _), _)| *f == family)
}

/// Whether the UDP serving endpoints of `family` differ between two caches.
fn udp_differs(
    a: &BTreeMap<ServiceName, Udp>,
    b: &BTreeMap<ServiceName, Udp>,
    f: IpFamily,
) -> bool {
    !family_endpoints(a.values(), f).eq(family_endpoints(b.values(), f))
}
