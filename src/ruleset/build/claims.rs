//! Who gets an address and port that several Services claim: ClusterIP over load-balancer IP
//! over externalIP, then the older Service, then the name ([`Claims`]).

use super::*;

/// Which kind of address a Service claims a key with; lower wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum AddressKind {
    /// Allocated by the API server: never shared, never taken over.
    ClusterIp,
    /// Written by a load-balancer controller into the status.
    LoadBalancerIp,
    /// Written by whoever may edit the Service's spec (CVE-2020-8554).
    ExternalIp,
}

impl fmt::Display for AddressKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AddressKind::ClusterIp => "ClusterIP",
            AddressKind::LoadBalancerIp => "load-balancer IP",
            AddressKind::ExternalIp => "externalIP",
        })
    }
}

/// A Service's claim on one `address . protocol . port`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Claim<'a> {
    pub kind: AddressKind,
    /// Seconds since the epoch; a Service without a creation time counts as the newest.
    pub created: i64,
    pub service: &'a ServiceName,
}

/// Two Services claiming the same `address . protocol . port`: which one keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clash<'a> {
    pub addr: IpAddr,
    pub protocol: crate::model::Protocol,
    pub port: u16,
    pub winner: Claim<'a>,
    pub loser: Claim<'a>,
}

impl fmt::Display for Clash<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Service {} claims {} {}:{}/{} that Service {} has as its {}: {} keeps it ({}), \
             {} gets no rule for it",
            self.loser.service,
            self.loser.kind,
            self.addr,
            self.port,
            self.protocol,
            self.winner.service,
            self.winner.kind,
            self.winner.service,
            if self.winner.kind != self.loser.kind {
                "ClusterIP before load-balancer IP before externalIP"
            } else if self.winner.created != self.loser.created {
                "created first"
            } else {
                "same kind and creation time: first by namespace/name"
            },
            self.loser.service,
        )
    }
}

/// Who keeps each Service address and port of one family. kube-proxy lets the rules of two
/// Services collide and the last one written wins, so a Service whose externalIP (or LB IP) is
/// another's ClusterIP takes that ClusterIP's traffic (CVE-2020-8554); here the decision cannot
/// be gamed by choosing a name: a ClusterIP (allocated by the API server) before a load-balancer
/// IP before an externalIP, then the older Service, and only then namespace/name. The loser gets
/// no element at all for that key, in any map (no dangling reject or firewall entry either).
pub struct Claims<'a> {
    pub(super) winners: HashMap<(IpAddr, crate::model::Protocol, u16), Claim<'a>>,
    pub clashes: Vec<Clash<'a>>,
}

impl<'a> Claims<'a> {
    pub fn new(state: &'a ClusterState, family: IpFamily) -> Claims<'a> {
        // Sized for one port per Service, the common case: grown by doubling, every key was
        // hashed again at each step.
        let mut winners: HashMap<(IpAddr, crate::model::Protocol, u16), Claim<'a>> =
            HashMap::with_capacity(state.services.len());
        let mut clashes = Vec::new();
        for svc in state.services.values() {
            // Only Services with a ClusterIP of the family are programmed in it.
            let Some(cluster_ip) = svc.cluster_ip(family) else {
                continue;
            };
            let created = svc.created.unwrap_or(i64::MAX);
            let mut addrs: Vec<(IpAddr, AddressKind)> = vec![(cluster_ip, AddressKind::ClusterIp)];
            addrs.extend(
                svc.load_balancer_ips
                    .iter()
                    .map(|ip| (*ip, AddressKind::LoadBalancerIp)),
            );
            addrs.extend(
                svc.external_ips
                    .iter()
                    .map(|ip| (*ip, AddressKind::ExternalIp)),
            );
            // A Service's own address listed twice counts once, as its best kind.
            addrs.retain(|(ip, _)| IpFamily::of(ip) == family);
            addrs.sort();
            addrs.dedup_by_key(|(ip, _)| *ip);
            for port in &svc.ports {
                for (addr, kind) in &addrs {
                    let claim = Claim {
                        kind: *kind,
                        created,
                        service: &svc.name,
                    };
                    let key = (*addr, port.protocol, port.port);
                    match winners.entry(key) {
                        Entry::Vacant(v) => {
                            v.insert(claim);
                        }
                        Entry::Occupied(mut o) => {
                            if o.get().service == claim.service {
                                continue;
                            }
                            let (winner, loser) = if claim < *o.get() {
                                (claim.clone(), o.insert(claim))
                            } else {
                                (o.get().clone(), claim)
                            };
                            clashes.push(Clash {
                                addr: *addr,
                                protocol: port.protocol,
                                port: port.port,
                                winner,
                                loser,
                            });
                        }
                    }
                }
            }
        }
        // A third claimant can beat the one a clash was first decided for: name the final
        // winner in every report.
        for clash in &mut clashes {
            if let Some(w) = winners.get(&(clash.addr, clash.protocol, clash.port)) {
                if w.service == clash.loser.service {
                    std::mem::swap(&mut clash.winner, &mut clash.loser);
                }
                if w.service != clash.winner.service {
                    clash.winner = w.clone();
                }
            }
        }
        Claims { winners, clashes }
    }

    /// The Services of every clash: each depends on the others, so a change to any of them
    /// needs a full build (see `sync::incremental`).
    pub(super) fn contested(&self) -> impl Iterator<Item = ServiceName> + '_ {
        self.clashes
            .iter()
            .flat_map(|c| [c.winner.service.clone(), c.loser.service.clone()])
    }

    /// Whether `service` keeps `addr . protocol . port` (true for a key nobody else claims).
    pub(super) fn keeps(
        &self,
        service: &ServiceName,
        addr: IpAddr,
        protocol: crate::model::Protocol,
        port: u16,
    ) -> bool {
        self.winners
            .get(&(addr, protocol, port))
            .is_none_or(|w| w.service == service)
    }
}
