//! The table's fixed layout: base chains and their hooks, the dispatch maps and sets every
//! element goes into, the `pick` chains and maps per endpoint count, the Local-policy chains.

use super::*;

/// kube-proxy's hook layout since 1.34: filter checks that need the pre-DNAT destination at
/// -110, service DNAT at dstnat (-100), no-endpoint and invalid-port checks after DNAT at filter
/// (0), masquerade at srcnat (100). Other components rely on these priorities.
pub(super) const PRIO_DSTNAT: i32 = -100;
pub(super) const PRIO_FILTER: i32 = 0;
pub(super) const PRIO_SRCNAT: i32 = 100;

/// One kind of `pick` chain: which key it reads, which names and comments it gets.
pub(super) struct PickKind {
    pub(super) chain: fn(usize) -> String,
    pub(super) map: fn(usize) -> String,
    pub(super) key: fn() -> Vec<KeyField>,
    /// What the map's key is, for its comment.
    pub(super) map_what: &'static str,
    /// What traffic the chain DNATs, for its comment.
    pub(super) chain_what: &'static str,
    /// The chain picks among this node's endpoints (a Local traffic policy's list).
    pub(super) local: bool,
}

pub(super) const PICK_KINDS: [PickKind; 4] = [
    PickKind {
        chain: names::pick_chain,
        map: names::pick_map,
        key: service_key,
        map_what: "service address . protocol . port . slot to endpoint",
        chain_what: "DNAT service address traffic to one of",
        local: false,
    },
    PickKind {
        chain: names::local_pick_chain,
        map: names::local_pick_map,
        key: service_key,
        map_what: "external address . protocol . port . slot to local endpoint",
        chain_what: "DNAT external address traffic to one of",
        local: true,
    },
    PickKind {
        chain: names::nodeport_pick_chain,
        map: names::nodeport_pick_map,
        key: nodeport_key,
        map_what: "protocol . NodePort . slot to endpoint",
        chain_what: "DNAT NodePort traffic to one of",
        local: false,
    },
    PickKind {
        chain: names::nodeport_local_pick_chain,
        map: names::nodeport_local_pick_map,
        key: nodeport_key,
        map_what: "protocol . NodePort . slot to local endpoint",
        chain_what: "DNAT NodePort traffic to one of",
        local: true,
    },
];

/// The `pick` maps and chains of one kind, one per endpoint count in use.
pub(super) fn pick_objects(
    kind: &PickKind,
    picks: Picks,
    sets: &mut Vec<Set>,
    chains: &mut Vec<Chain>,
    contested: &mut Contested,
) {
    for (k, elements) in picks {
        let modulus = u32::try_from(k).unwrap_or(u32::MAX);
        let mut key = (kind.key)();
        key.push(KeyField::Numgen { modulus });
        let local = if kind.local { " local" } else { "" };
        // The count is in the name: nft keeps the comment and the `typeof` description in one
        // 256-byte userdata, so map comments must stay short.
        let mut s = set(
            &(kind.map)(k),
            kind.map_what,
            key.clone(),
            Some(SetData::Value(vec![KeyField::Daddr, KeyField::ThDport])),
            elements,
            contested,
        );
        s.typeof_ = true;
        sets.push(s);
        chains.push(chain(
            &(kind.chain)(k),
            &format!(
                "{} {k}{local} endpoints, uniformly at random",
                kind.chain_what
            ),
            None,
            vec![vec![Stmt::DnatMap {
                key,
                map: (kind.map)(k),
            }]],
        ));
    }
}

/// The rules of a Local-policy chain for external traffic (kube-proxy's `external-` chain with
/// ETP=Local, §2.5), reading `cluster_picks` and `local_picks`, maps keyed by `key`: traffic
/// from pods goes to the cluster-wide endpoints as if it came back from the load balancer;
/// traffic from the node itself too, masqueraded (its source would be the node or VIP
/// address); everything else to this node's endpoints, unmasqueraded so the client address is
/// kept. With no local endpoint the lookup misses, the packet leaves without DNAT, and the
/// `drop` element of the no-endpoint check stops it.
pub(super) fn local_policy_rules(
    local: Option<Stmt>,
    mark: u32,
    key: fn() -> Vec<KeyField>,
    cluster_picks: &str,
    local_picks: &str,
) -> Vec<Vec<Stmt>> {
    let mut rules = Vec::new();
    if let Some(local) = local {
        rules.push(vec![local, vmap(key(), cluster_picks)]);
    }
    rules.push(vec![
        Stmt::FibLocal {
            field: AddrField::Saddr,
        },
        Stmt::MarkOr(mark),
        vmap(key(), cluster_picks),
    ]);
    rules.push(vec![vmap(key(), local_picks)]);
    rules
}

/// 127.0.0.0/8 or ::1/128.
pub(super) fn loopback(family: IpFamily) -> IpNet {
    match family {
        IpFamily::V4 => IpNet::V4(ipnet::Ipv4Net::new_assert(
            std::net::Ipv4Addr::new(127, 0, 0, 0),
            8,
        )),
        IpFamily::V6 => IpNet::V6(ipnet::Ipv6Net::new_assert(
            std::net::Ipv6Addr::LOCALHOST,
            128,
        )),
    }
}

pub(super) fn build_table(
    state: &ClusterState,
    slices: &SlicesByService<'_>,
    settings: &Settings,
    family: IpFamily,
    claims: &Claims<'_>,
    contested: &mut Contested,
) -> Table {
    let c = collect(state, slices, settings, family, claims);
    let mark = settings.mark;
    let node = state.nodes.get(&settings.node_name);
    let all_addresses = settings.nodeport_addresses.all_of(family);

    let verdicts = Some(SetData::Verdict);
    let mut sets = vec![set(
        names::CLUSTER_IPS,
        "active ClusterIPs",
        vec![KeyField::Daddr],
        None,
        c.cluster_ips,
        contested,
    )];
    if !all_addresses {
        sets.push(set(
            names::NODEPORT_IPS,
            "local addresses that accept NodePort traffic (--nodeport-addresses)",
            vec![KeyField::Daddr],
            None,
            c.nodeport_ips,
            contested,
        ));
    }
    sets.extend([
        set(
            names::SERVICE_IPS,
            "ClusterIP, external IP and LoadBalancer IP . protocol . port of services with \
             endpoints: the chain that handles them",
            service_key(),
            verdicts.clone(),
            c.service_ips,
            contested,
        ),
        set(
            names::SERVICE_NODEPORTS,
            "protocol . NodePort of services with endpoints: the chain for its traffic policy",
            nodeport_key(),
            verdicts.clone(),
            c.service_nodeports,
            contested,
        ),
        set(
            names::EXTERNAL_PICKS,
            "external address . protocol . port: the chain that picks a cluster-wide endpoint",
            service_key(),
            verdicts.clone(),
            c.external_picks,
            contested,
        ),
        set(
            names::EXTERNAL_LOCAL_PICKS,
            "external address . protocol . port: the chain that picks an endpoint on this node",
            service_key(),
            verdicts.clone(),
            c.external_local_picks,
            contested,
        ),
        set(
            names::NODEPORT_PICKS,
            "protocol . NodePort: the chain that picks a cluster-wide endpoint",
            nodeport_key(),
            verdicts.clone(),
            c.nodeport_picks,
            contested,
        ),
        set(
            names::NODEPORT_LOCAL_PICKS,
            "protocol . NodePort: the chain that picks an endpoint on this node",
            nodeport_key(),
            verdicts.clone(),
            c.nodeport_local_picks,
            contested,
        ),
        set(
            names::NO_ENDPOINT_SERVICES,
            "service address . protocol . port without usable endpoints: reject or drop",
            service_key(),
            verdicts.clone(),
            c.no_endpoint_services,
            contested,
        ),
        set(
            names::NO_ENDPOINT_NODEPORTS,
            "protocol . NodePort of services without usable endpoints: reject or drop",
            nodeport_key(),
            verdicts,
            c.no_endpoint_nodeports,
            contested,
        ),
        set(
            names::HAIRPIN_CONNECTIONS,
            "endpoint . endpoint . protocol . port: a pod reaching itself through a service",
            vec![
                KeyField::Saddr,
                KeyField::Daddr,
                KeyField::L4Proto,
                KeyField::ThDport,
            ],
            None,
            c.hairpin,
            contested,
        ),
    ]);

    let mut pick_chains = Vec::new();
    for (kind, picks) in PICK_KINDS.iter().zip(c.picks.into_picks()) {
        pick_objects(kind, picks, &mut sets, &mut pick_chains, contested);
    }

    let mut services_rules = Vec::new();
    if settings.masquerade_all {
        services_rules.push(vec![
            in_set(vec![KeyField::Daddr], names::CLUSTER_IPS),
            Stmt::MarkOr(mark),
        ]);
    } else if let Some(not_local) = settings.local_match(node, family, true) {
        // Off-cluster clients that route the service range to a node, and the node itself,
        // must get replies back through it; pod sources keep their address.
        services_rules.push(vec![
            in_set(vec![KeyField::Daddr], names::CLUSTER_IPS),
            not_local,
            Stmt::MarkOr(mark),
        ]);
    }
    services_rules.push(vec![vmap(service_key(), names::SERVICE_IPS)]);
    // NodePorts answer on the selected node addresses, or on every local address but loopback
    // (kube-proxy does not support localhost NodePorts in nftables mode).
    let nodeport_daddr = || {
        if all_addresses {
            vec![
                Stmt::FibLocal {
                    field: AddrField::Daddr,
                },
                Stmt::AddrMatch {
                    field: AddrField::Daddr,
                    negate: true,
                    net: loopback(family),
                },
            ]
        } else {
            vec![in_set(vec![KeyField::Daddr], names::NODEPORT_IPS)]
        }
    };
    let mut nodeport_rule = nodeport_daddr();
    nodeport_rule.push(vmap(nodeport_key(), names::SERVICE_NODEPORTS));
    services_rules.push(nodeport_rule);

    // Only new connections reach the filter checks; in `filter-input` the address is local
    // already, so `all` needs only the loopback exclusion there.
    let mut nodeport_check = if all_addresses {
        vec![Stmt::AddrMatch {
            field: AddrField::Daddr,
            negate: true,
            net: loopback(family),
        }]
    } else {
        vec![in_set(vec![KeyField::Daddr], names::NODEPORT_IPS)]
    };
    nodeport_check.push(vmap(nodeport_key(), names::NO_ENDPOINT_NODEPORTS));

    let mut cluster_ips_check = vec![vec![
        in_set(vec![KeyField::Daddr], names::CLUSTER_IPS),
        Stmt::Reject,
    ]];
    for cidr in settings
        .service_ranges(state)
        .into_iter()
        .filter(|c| IpFamily::of(&c.addr()) == family)
    {
        // An address of the service range that no Service holds: nothing will ever answer,
        // so drop rather than let the packet wander off to the default route.
        cluster_ips_check.push(vec![
            Stmt::AddrMatch {
                field: AddrField::Daddr,
                negate: false,
                net: cidr,
            },
            Stmt::Verdict(Verdict::Drop),
        ]);
    }

    let local = || settings.local_match(node, family, false);
    let mut chains = vec![
        chain(
            names::NAT_PREROUTING,
            "service DNAT for traffic arriving at this node",
            base(ChainType::Nat, Hook::Prerouting, PRIO_DSTNAT),
            vec![vec![jump(names::SERVICES)]],
        ),
        chain(
            names::NAT_OUTPUT,
            "service DNAT for traffic from this node's own processes",
            base(ChainType::Nat, Hook::Output, PRIO_DSTNAT),
            vec![vec![jump(names::SERVICES)]],
        ),
        chain(
            names::NAT_POSTROUTING,
            "masquerade marked and hairpin traffic",
            base(ChainType::Nat, Hook::Postrouting, PRIO_SRCNAT),
            vec![vec![jump(names::MASQUERADING)]],
        ),
        chain(
            names::FILTER_INPUT,
            "reject new connections to NodePorts and services without endpoints",
            base(ChainType::Filter, Hook::Input, PRIO_FILTER),
            vec![
                vec![Stmt::CtStateNew, jump(names::NODEPORT_ENDPOINTS_CHECK)],
                vec![Stmt::CtStateNew, jump(names::SERVICE_ENDPOINTS_CHECK)],
            ],
        ),
        chain(
            names::FILTER_FORWARD,
            "reject new connections to services without endpoints or to invalid ClusterIP ports",
            base(ChainType::Filter, Hook::Forward, PRIO_FILTER),
            vec![
                vec![Stmt::CtStateNew, jump(names::SERVICE_ENDPOINTS_CHECK)],
                vec![Stmt::CtStateNew, jump(names::CLUSTER_IPS_CHECK)],
            ],
        ),
        chain(
            names::FILTER_OUTPUT,
            "reject new local connections to services without endpoints or to invalid ports",
            base(ChainType::Filter, Hook::Output, PRIO_FILTER),
            vec![
                vec![Stmt::CtStateNew, jump(names::SERVICE_ENDPOINTS_CHECK)],
                vec![Stmt::CtStateNew, jump(names::CLUSTER_IPS_CHECK)],
            ],
        ),
        chain(
            names::SERVICES,
            "dispatch by destination: service addresses, then NodePorts on NodePort addresses",
            None,
            services_rules,
        ),
        chain(
            names::EXTERNAL_CLUSTER,
            "externalTrafficPolicy Cluster, external and LoadBalancer IPs: masquerade, any endpoint",
            None,
            vec![vec![
                Stmt::MarkOr(mark),
                vmap(service_key(), names::EXTERNAL_PICKS),
            ]],
        ),
        chain(
            names::EXTERNAL_LOCAL,
            "externalTrafficPolicy Local, external and LoadBalancer IPs: pods and this node to \
             any endpoint, others to local ones",
            None,
            local_policy_rules(
                local(),
                mark,
                service_key,
                names::EXTERNAL_PICKS,
                names::EXTERNAL_LOCAL_PICKS,
            ),
        ),
        chain(
            names::NODEPORT_CLUSTER,
            "externalTrafficPolicy Cluster, NodePorts: masquerade, any endpoint",
            None,
            vec![vec![
                Stmt::MarkOr(mark),
                vmap(nodeport_key(), names::NODEPORT_PICKS),
            ]],
        ),
        chain(
            names::NODEPORT_LOCAL,
            "externalTrafficPolicy Local, NodePorts: pods and this node to any endpoint, others \
             to local ones",
            None,
            local_policy_rules(
                local(),
                mark,
                nodeport_key,
                names::NODEPORT_PICKS,
                names::NODEPORT_LOCAL_PICKS,
            ),
        ),
        chain(
            names::MASQUERADING,
            "masquerade packets marked for it (clearing the mark) and hairpin connections",
            None,
            vec![
                // The mark is cleared before masquerading: a packet re-entering the stack (a
                // VXLAN-encapsulated skb) must not be masqueraded twice (kubernetes#92035).
                vec![
                    Stmt::MarkTest { mask: mark },
                    Stmt::MarkXor(mark),
                    Stmt::Masquerade { fully_random: true },
                ],
                vec![
                    Stmt::CtStatusDnat,
                    in_set(
                        vec![
                            KeyField::Saddr,
                            KeyField::Daddr,
                            KeyField::L4Proto,
                            KeyField::ThDport,
                        ],
                        names::HAIRPIN_CONNECTIONS,
                    ),
                    Stmt::Masquerade { fully_random: true },
                ],
            ],
        ),
        chain(
            names::SERVICE_ENDPOINTS_CHECK,
            "services without usable endpoints (checked after DNAT, so only undelivered traffic)",
            None,
            vec![vec![vmap(service_key(), names::NO_ENDPOINT_SERVICES)]],
        ),
        chain(
            names::NODEPORT_ENDPOINTS_CHECK,
            "NodePorts of services without usable endpoints",
            None,
            vec![nodeport_check],
        ),
        chain(
            names::CLUSTER_IPS_CHECK,
            "reject traffic to ClusterIP ports that no service defines, drop unallocated ones",
            None,
            cluster_ips_check,
        ),
        chain(
            names::REJECT_CHAIN,
            "reject (a verdict map cannot reject directly, so its elements goto here)",
            None,
            vec![vec![Stmt::Reject]],
        ),
    ];
    chains.extend(pick_chains);

    Table {
        family,
        name: names::TABLE.to_string(),
        comment: names::TABLE_COMMENT.to_string(),
        owned: settings.own_tables,
        sets,
        chains,
    }
}
