//! A hand-written ruleset covering every statement and every set/map shape, for ip and ip6.

use std::net::IpAddr;

use nodeproxy::model::{IpFamily, Protocol, ServiceName, ServicePortName};
use nodeproxy::ruleset::*;

pub fn spn(ns: &str, name: &str, port: &str) -> ServicePortName {
    ServicePortName {
        service: ServiceName::new(ns, name),
        port: port.into(),
        protocol: Protocol::Tcp,
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

pub fn elem(key: Vec<Atom>, data: Option<ElemData>, origin: Option<ServicePortName>) -> Element {
    Element {
        key: key.into(),
        data,
        comment: origin.as_ref().map(|o| o.to_string().into()),
        origin: origin.map(std::sync::Arc::new),
    }
}

fn set(
    name: &str,
    comment: &str,
    key: Vec<KeyField>,
    data: Option<SetData>,
    typeof_: bool,
    elements: Vec<Element>,
) -> Set {
    Set {
        name: name.into(),
        comment: comment.into(),
        key,
        data,
        typeof_,
        elements,
        kind: SetKind::Hash,
    }
}

fn chain(
    name: &str,
    comment: &str,
    base: Option<(ChainType, Hook, i32)>,
    rules: Vec<Vec<Stmt>>,
) -> Chain {
    Chain {
        name: name.into(),
        comment: comment.into(),
        base: base.map(|(kind, hook, priority)| BaseChain {
            kind,
            hook,
            priority,
        }),
        rules: rules.into_iter().map(Rule::new).collect(),
    }
}

use KeyField::*;

fn jump(c: &str) -> Stmt {
    Stmt::Verdict(Verdict::Jump(c.into()))
}
fn goto(c: &str) -> ElemData {
    ElemData::Verdict(Verdict::Goto(c.into()))
}

/// The sample table for `family`; `a`, `b` are two service addresses, `e1`, `e2` endpoints.
pub fn table(family: IpFamily) -> Table {
    let (a, b, e1, e2, net8, net12, misc): (&str, &str, &str, &str, &str, &str, Vec<&str>) =
        match family {
            IpFamily::V4 => (
                "10.96.0.10",
                "10.96.0.1",
                "10.244.1.5",
                "10.244.2.6",
                "10.0.0.0/8",
                "10.16.0.0/12",
                vec!["10.1.0.0/16", "10.1.2.0/24", "10.1.2.3/32"],
            ),
            IpFamily::V6 => (
                "fd00:96::10",
                "fd00:96::1",
                "fd00:244:1::5",
                "fd00:244:2::6",
                "fd00::/48",
                "2001:db8:1000::/36",
                vec!["2001:db8:1:2::/64", "2001:db8::1/128"],
            ),
        };
    let loopback = match family {
        IpFamily::V4 => "127.0.0.0/8",
        IpFamily::V6 => "::1/128",
    };
    let dns = spn("kube-system", "kube-dns", "dns");
    let api = spn("default", "kubernetes", "https");
    let svc3 = |addr: &str, p: Protocol, port: u16| {
        vec![Atom::Addr(ip(addr)), Atom::Proto(p), Atom::Port(port)]
    };
    let mut firewall_allow = set(
        "firewall-allow",
        "LB IP . protocol . port . allowed source range",
        vec![Daddr, L4Proto, ThDport, Saddr],
        None,
        false,
        match family {
            IpFamily::V4 => ["10.0.0.0/8", "192.0.2.0/24", "198.51.100.7"],
            IpFamily::V6 => ["fd00::/48", "2001:db8:1000::/36", "2001:db8::7"],
        }
        .iter()
        .map(|n| {
            let mut k = svc3(a, Protocol::Tcp, 80);
            k.push(Atom::Net(
                n.parse().unwrap_or_else(|_| ipnet::IpNet::from(ip(n))),
            ));
            elem(k, None, Some(api.clone()))
        })
        .collect(),
    );
    firewall_allow.kind = SetKind::Interval;
    let mut pins = set(
        "affinity-slot-0",
        "pinned clients",
        vec![Saddr, Daddr, L4Proto, ThDport],
        None,
        true,
        vec![],
    );
    pins.kind = SetKind::Dynamic;
    // Session affinity's map of pins (client . service → endpoint address), keyed by two
    // hashes in IPv6 (nft 1.0.6 cannot write a longer key with data), and its pick map.
    let (pin_type, pin_typeof, pin_key) = match family {
        IpFamily::V4 => (
            vec![Saddr, Daddr, L4Proto, ThDport],
            false,
            vec![Saddr, CtOrigDaddr, L4Proto, ThDport],
        ),
        IpFamily::V6 => (
            vec![Numgen { modulus: 2 }; 2],
            true,
            [1, 2]
                .map(|seed| Jhash {
                    input: HashInput::ClientServiceAddress,
                    seed,
                })
                .to_vec(),
        ),
    };
    let mut address_pins = set(
        "affinity-pins",
        "client . service to its endpoint",
        pin_type,
        Some(SetData::Value(vec![Daddr])),
        pin_typeof,
        vec![],
    );
    address_pins.kind = SetKind::Dynamic;
    let affinity_pick = set(
        "affinity-pick",
        "service . index to an endpoint address",
        vec![Daddr, L4Proto, ThDport, Numgen { modulus: 2 }],
        Some(SetData::Value(vec![Daddr])),
        true,
        vec![elem(
            {
                let mut k = svc3(a, Protocol::Tcp, 80);
                k.push(Atom::Int(0));
                k
            },
            Some(ElemData::Value([Atom::Addr(ip(e1))].into())),
            Some(api.clone()),
        )],
    );
    let sets = vec![
        set(
            "firewall-ips",
            "",
            vec![Daddr, L4Proto, ThDport],
            None,
            false,
            vec![elem(svc3(a, Protocol::Tcp, 80), None, Some(api.clone()))],
        ),
        firewall_allow,
        pins,
        address_pins,
        affinity_pick,
        set(
            "cluster-ips",
            "ClusterIPs of all services",
            vec![Daddr],
            None,
            false,
            vec![
                elem(vec![Atom::Addr(ip(b))], None, Some(api.clone())),
                elem(vec![Atom::Addr(ip(a))], None, Some(dns.clone())),
            ],
        ),
        set(
            "service-ips",
            "dispatch: service address . protocol . port",
            vec![Daddr, L4Proto, ThDport],
            Some(SetData::Verdict),
            false,
            vec![
                elem(
                    svc3(a, Protocol::Udp, 53),
                    Some(goto("pick-2")),
                    Some(dns.clone()),
                ),
                elem(
                    svc3(b, Protocol::Tcp, 443),
                    Some(goto("pick-1")),
                    Some(api.clone()),
                ),
            ],
        ),
        set(
            "service-nodeports",
            "dispatch: protocol . nodeport",
            vec![L4Proto, ThDport],
            Some(SetData::Verdict),
            false,
            vec![elem(
                vec![Atom::Proto(Protocol::Tcp), Atom::Port(30443)],
                Some(goto("pick-1")),
                Some(api.clone()),
            )],
        ),
        set(
            "no-endpoint-services",
            "services without endpoints",
            vec![Daddr, L4Proto, ThDport],
            Some(SetData::Verdict),
            false,
            vec![
                elem(
                    svc3(a, Protocol::Tcp, 9999),
                    Some(ElemData::Verdict(Verdict::Drop)),
                    None,
                ),
                elem(
                    svc3(a, Protocol::Sctp, 9998),
                    Some(ElemData::Verdict(Verdict::Accept)),
                    None,
                ),
                elem(
                    svc3(a, Protocol::Tcp, 9997),
                    Some(ElemData::Verdict(Verdict::Jump("reject-chain".into()))),
                    None,
                ),
            ],
        ),
        set(
            "hairpin-connections",
            "",
            vec![Saddr, Daddr, L4Proto, ThDport],
            None,
            false,
            vec![elem(
                vec![
                    Atom::Addr(ip(e1)),
                    Atom::Addr(ip(e1)),
                    Atom::Proto(Protocol::Udp),
                    Atom::Port(53),
                ],
                None,
                None,
            )],
        ),
        set(
            "endpoints-plain",
            "address . port by service",
            vec![Daddr, L4Proto, ThDport],
            Some(SetData::Value(vec![Daddr, ThDport])),
            false,
            vec![elem(
                svc3(a, Protocol::Udp, 53),
                Some(ElemData::Value([Atom::Addr(ip(e1)), Atom::Port(53)].into())),
                Some(dns.clone()),
            )],
        ),
        set(
            "eps-k1",
            "one endpoint",
            vec![Daddr, L4Proto, ThDport, Numgen { modulus: 1 }],
            Some(SetData::Value(vec![Daddr, ThDport])),
            true,
            vec![elem(
                {
                    let mut k = svc3(b, Protocol::Tcp, 443);
                    k.push(Atom::Int(0));
                    k
                },
                Some(ElemData::Value(
                    [Atom::Addr(ip(e1)), Atom::Port(6443)].into(),
                )),
                Some(api.clone()),
            )],
        ),
        set(
            "eps-k2",
            "two endpoints",
            vec![Daddr, L4Proto, ThDport, Numgen { modulus: 2 }],
            Some(SetData::Value(vec![Daddr, ThDport])),
            true,
            vec![
                elem(
                    {
                        let mut k = svc3(a, Protocol::Udp, 53);
                        k.push(Atom::Int(0));
                        k
                    },
                    Some(ElemData::Value([Atom::Addr(ip(e1)), Atom::Port(53)].into())),
                    Some(dns.clone()),
                ),
                elem(
                    {
                        let mut k = svc3(a, Protocol::Udp, 53);
                        k.push(Atom::Int(1));
                        k
                    },
                    Some(ElemData::Value([Atom::Addr(ip(e2)), Atom::Port(53)].into())),
                    Some(dns.clone()),
                ),
            ],
        ),
    ];
    let mut sets = sets;
    sets.push(set(
        "random-k2",
        "random index to a chain",
        vec![Daddr, L4Proto, ThDport, Numgen { modulus: 2 }],
        Some(SetData::Verdict),
        true,
        vec![elem(
            {
                let mut k = svc3(a, Protocol::Udp, 53);
                k.push(Atom::Int(1));
                k
            },
            Some(goto("affinity-2s-slot-0")),
            Some(dns.clone()),
        )],
    ));
    let mut pick2 = vec![
        vec![
            Stmt::AddrMatch {
                field: AddrField::Saddr,
                negate: true,
                net: net8.parse().unwrap(),
            },
            jump("mark-for-masquerade"),
        ],
        vec![
            Stmt::AddrMatch {
                field: AddrField::Daddr,
                negate: false,
                net: net12.parse().unwrap(),
            },
            Stmt::Verdict(Verdict::Accept),
        ],
    ];
    for m in misc {
        pick2.push(vec![
            Stmt::AddrMatch {
                field: AddrField::Daddr,
                negate: false,
                net: m.parse().unwrap(),
            },
            Stmt::Verdict(Verdict::Drop),
        ]);
    }
    pick2.push(vec![Stmt::DnatMap {
        key: vec![Daddr, L4Proto, ThDport, Numgen { modulus: 2 }],
        map: "eps-k2".into(),
    }]);
    let chains = vec![
        chain(
            "firewall-check",
            "",
            None,
            vec![vec![
                Stmt::InSet {
                    key: vec![Daddr, L4Proto, ThDport],
                    set: "firewall-ips".into(),
                },
                Stmt::NotInSet {
                    key: vec![Daddr, L4Proto, ThDport, Saddr],
                    set: "firewall-allow".into(),
                },
                Stmt::Verdict(Verdict::Drop),
            ]],
        ),
        chain(
            "filter-output-pre-dnat",
            "",
            Some((ChainType::Filter, Hook::Output, -110)),
            vec![vec![Stmt::CtStateNew, jump("firewall-check")]],
        ),
        chain(
            "affinity-2s-slot-0",
            "",
            None,
            vec![
                vec![Stmt::UpdateSet {
                    key: vec![Saddr, Daddr, L4Proto, ThDport],
                    set: "affinity-slot-0".into(),
                    timeout_secs: 2,
                    data: None,
                }],
                vec![Stmt::UpdateSet {
                    key: vec![Saddr, Daddr, L4Proto, ThDport],
                    set: "affinity-slot-0".into(),
                    timeout_secs: 10800,
                    data: None,
                }],
            ],
        ),
        chain(
            "affinity-2s-pick-3",
            "",
            None,
            vec![
                vec![
                    Stmt::InSet {
                        key: vec![Saddr, Daddr, L4Proto, ThDport],
                        set: "affinity-slot-0".into(),
                    },
                    Stmt::Verdict(Verdict::Goto("affinity-2s-slot-0".into())),
                ],
                vec![
                    Stmt::InSet {
                        key: vec![Saddr, Daddr, L4Proto, ThDport],
                        set: "affinity-slot-0".into(),
                    },
                    Stmt::DeleteFromSet {
                        key: vec![Saddr, Daddr, L4Proto, ThDport],
                        set: "affinity-slot-0".into(),
                        data: None,
                    },
                ],
                vec![Stmt::Vmap {
                    key: vec![Daddr, L4Proto, ThDport, Numgen { modulus: 2 }],
                    map: "random-k2".into(),
                }],
                vec![
                    Stmt::RandomIs {
                        modulus: 3,
                        value: 0,
                    },
                    Stmt::Verdict(Verdict::Goto("affinity-2s-slot-0".into())),
                ],
            ],
        ),
        chain(
            "affinity-2s-pinned",
            "",
            None,
            vec![
                vec![
                    Stmt::DaddrFromMap {
                        key: pin_key.clone(),
                        map: "affinity-pins".into(),
                    },
                    jump("affinity-2s-pick-3"),
                ],
                vec![Stmt::DaddrFromMap {
                    key: vec![CtOrigDaddr, L4Proto, ThDport, Numgen { modulus: 3 }],
                    map: "affinity-pick".into(),
                }],
                vec![Stmt::UpdateSet {
                    key: pin_key.clone(),
                    set: "affinity-pins".into(),
                    timeout_secs: 2,
                    data: Some(Daddr),
                }],
                vec![Stmt::DeleteFromSet {
                    key: pin_key,
                    set: "affinity-pins".into(),
                    data: Some(Daddr),
                }],
                vec![Stmt::DaddrRestore],
            ],
        ),
        chain(
            "nat-prerouting",
            "DNAT of service traffic",
            Some((ChainType::Nat, Hook::Prerouting, -100)),
            vec![vec![jump("services")]],
        ),
        chain(
            "nat-output",
            "",
            Some((ChainType::Nat, Hook::Output, -100)),
            vec![vec![jump("services")]],
        ),
        chain(
            "nat-postrouting",
            "",
            Some((ChainType::Nat, Hook::Postrouting, 100)),
            vec![vec![jump("masquerading")]],
        ),
        chain(
            "filter-input",
            "",
            Some((ChainType::Filter, Hook::Input, 0)),
            vec![vec![
                Stmt::CtStateNew,
                Stmt::Vmap {
                    key: vec![Daddr, L4Proto, ThDport],
                    map: "no-endpoint-services".into(),
                },
            ]],
        ),
        chain(
            "filter-prerouting",
            "",
            Some((ChainType::Filter, Hook::Prerouting, -110)),
            vec![vec![Stmt::CtStateNew, jump("firewall-check")]],
        ),
        chain(
            "services",
            "",
            None,
            vec![
                vec![Stmt::Vmap {
                    key: vec![Daddr, L4Proto, ThDport],
                    map: "service-ips".into(),
                }],
                vec![
                    Stmt::InSet {
                        key: vec![Daddr],
                        set: "cluster-ips".into(),
                    },
                    Stmt::Reject,
                ],
                vec![Stmt::Vmap {
                    key: vec![L4Proto, ThDport],
                    map: "service-nodeports".into(),
                }],
            ],
        ),
        chain(
            "masquerading",
            "",
            None,
            vec![
                vec![
                    Stmt::MarkTest { mask: 0x4000 },
                    Stmt::MarkXor(0x4000),
                    Stmt::Masquerade { fully_random: true },
                ],
                vec![
                    Stmt::CtStatusDnat,
                    Stmt::InSet {
                        key: vec![Saddr, Daddr, L4Proto, ThDport],
                        set: "hairpin-connections".into(),
                    },
                    Stmt::Masquerade { fully_random: true },
                ],
                vec![
                    Stmt::InSet {
                        key: vec![Daddr, L4Proto, ThDport],
                        set: "endpoints-plain".into(),
                    },
                    Stmt::Masquerade {
                        fully_random: false,
                    },
                ],
            ],
        ),
        chain(
            "mark-for-masquerade",
            "",
            None,
            vec![vec![Stmt::MarkOr(0x4000)]],
        ),
        chain("reject-chain", "", None, vec![vec![Stmt::Reject]]),
        chain(
            "pick-1",
            "services with one endpoint",
            None,
            vec![vec![Stmt::DnatMap {
                key: vec![Daddr, L4Proto, ThDport, Numgen { modulus: 1 }],
                map: "eps-k1".into(),
            }]],
        ),
        chain("pick-2", "", None, pick2),
        chain(
            "dispatch",
            "",
            None,
            vec![vec![Stmt::Verdict(Verdict::Goto("pick-1".into()))]],
        ),
        chain(
            "by-source",
            "local-traffic detectors and local-address checks",
            None,
            vec![
                vec![
                    Stmt::FibLocal {
                        field: AddrField::Saddr,
                    },
                    Stmt::MarkOr(0x4000),
                    Stmt::Vmap {
                        key: vec![Daddr, L4Proto, ThDport],
                        map: "service-ips".into(),
                    },
                ],
                vec![
                    Stmt::FibLocal {
                        field: AddrField::Daddr,
                    },
                    Stmt::AddrMatch {
                        field: AddrField::Daddr,
                        negate: true,
                        net: loopback.parse().unwrap(),
                    },
                    Stmt::Vmap {
                        key: vec![L4Proto, ThDport],
                        map: "service-nodeports".into(),
                    },
                ],
                vec![
                    Stmt::Iifname {
                        name: "cni0".into(),
                        prefix: false,
                        negate: false,
                    },
                    Stmt::Verdict(Verdict::Accept),
                ],
                vec![
                    Stmt::Iifname {
                        name: "veth".into(),
                        prefix: true,
                        negate: false,
                    },
                    Stmt::Verdict(Verdict::Accept),
                ],
                vec![
                    Stmt::Iifname {
                        name: "cali".into(),
                        prefix: true,
                        negate: true,
                    },
                    Stmt::Verdict(Verdict::Drop),
                ],
                vec![
                    Stmt::Iifname {
                        name: "br-pods".into(),
                        prefix: false,
                        negate: true,
                    },
                    Stmt::Verdict(Verdict::Drop),
                ],
            ],
        ),
    ];
    Table {
        family,
        name: "nodeproxy".into(),
        comment: "rules of nodeproxy".into(),
        owned: false,
        sets,
        chains,
    }
}
