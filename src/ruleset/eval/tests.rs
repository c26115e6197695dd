//! Evaluator semantics on small hand-built tables: chain control flow, hooks, lookups, forks and
//! the errors for what is not modelled. Each rule that should run sets a distinct mark bit so
//! the trace shows exactly which rules ran, in which order.

use crate::ruleset::Comment;
use std::net::{IpAddr, SocketAddr};

use super::*;
use crate::ruleset::{BaseChain, ChainType, Element, Hook, Rule, Set, Table};

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

fn sock(text: &str) -> SocketAddr {
    text.parse().unwrap()
}

fn base(name: &str, kind: ChainType, hook: Hook, priority: i32, rules: Vec<Vec<Stmt>>) -> Chain {
    Chain {
        name: name.into(),
        comment: String::new(),
        base: Some(BaseChain {
            kind,
            hook,
            priority,
        }),
        rules: rules.into_iter().map(Rule::new).collect(),
    }
}

fn regular(name: &str, rules: Vec<Vec<Stmt>>) -> Chain {
    Chain {
        name: name.into(),
        comment: String::new(),
        base: None,
        rules: rules.into_iter().map(Rule::new).collect(),
    }
}

fn ruleset(chains: Vec<Chain>, sets: Vec<Set>) -> Ruleset {
    Ruleset {
        tables: vec![Table {
            family: IpFamily::V4,
            name: "t".into(),
            comment: String::new(),
            owned: false,
            sets,
            chains,
        }],
    }
}

fn jump(c: &str) -> Stmt {
    Stmt::Verdict(Verdict::Jump(c.into()))
}

fn goto(c: &str) -> Stmt {
    Stmt::Verdict(Verdict::Goto(c.into()))
}

fn mark(bit: u32) -> Stmt {
    Stmt::MarkOr(bit)
}

fn packet(origin: Origin) -> Packet {
    Packet {
        src: ip("198.51.100.10"),
        dst: ip("203.0.113.20"),
        proto: Protocol::Tcp,
        dport: 80,
        origin,
        iif: None,
    }
}

const NODE: [&str; 1] = ["192.0.2.11"];

fn eval(rs: &Ruleset, origin: Origin) -> Result<Trace, EvalError> {
    let local: Vec<IpAddr> = NODE.iter().map(|a| ip(a)).collect();
    evaluate(rs, &local, packet(origin))
}

/// The (chain, mark bit) of every mark-setting rule that ran, in order.
fn marks(branch: &Branch) -> Vec<(String, String)> {
    branch
        .steps
        .iter()
        .filter_map(|s| match s {
            Step::Rule { chain, text, .. } if text.contains("meta mark set meta mark |") => {
                Some((chain.clone(), text.rsplit(' ').next().unwrap_or("").into()))
            }
            _ => None,
        })
        .collect()
}

fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

fn pre(rules: Vec<Vec<Stmt>>) -> Chain {
    base("pre", ChainType::Filter, Hook::Prerouting, 0, rules)
}

#[test]
fn jump_returns_to_the_rule_after_the_jump() {
    let rs = ruleset(
        vec![
            pre(vec![vec![jump("a")], vec![mark(1)]]),
            regular("a", vec![vec![mark(2)]]),
        ],
        vec![],
    );
    let t = eval(&rs, Origin::External).unwrap();
    let b = &t.branches[0];
    assert_eq!(
        marks(b),
        pairs(&[("a", "0x00000002"), ("pre", "0x00000001")])
    );
    assert!(b.steps.contains(&Step::Return {
        from: "a".into(),
        to: "pre".into()
    }));
    assert_eq!(t.fate(), Some(Fate::Accept));
}

#[test]
fn goto_does_not_return_to_its_chain_but_to_the_last_jump_caller() {
    let rs = ruleset(
        vec![
            pre(vec![vec![jump("a")], vec![mark(1)]]),
            regular("a", vec![vec![goto("b")], vec![mark(4)]]),
            regular("b", vec![vec![mark(2)]]),
        ],
        vec![],
    );
    let b = &eval(&rs, Origin::External).unwrap().branches[0];
    // mark 4 (after the goto in `a`) never runs; `b` falls off back to `pre`.
    assert_eq!(
        marks(b),
        pairs(&[("b", "0x00000002"), ("pre", "0x00000001")])
    );
    assert!(b.steps.contains(&Step::Return {
        from: "b".into(),
        to: "pre".into()
    }));
}

#[test]
fn goto_from_a_base_chain_ends_it_with_the_policy_when_the_target_falls_off() {
    let rs = ruleset(
        vec![
            pre(vec![vec![goto("a")], vec![mark(1)]]),
            regular("a", vec![vec![mark(2)]]),
        ],
        vec![],
    );
    let b = &eval(&rs, Origin::External).unwrap().branches[0];
    assert_eq!(marks(b), pairs(&[("a", "0x00000002")]));
    assert!(b.steps.contains(&Step::Accepted {
        chain: "pre".into(),
        by_policy: true
    }));
}

#[test]
fn return_goes_back_to_the_caller_and_skips_the_rest_of_the_chain() {
    let rs = ruleset(
        vec![
            pre(vec![vec![jump("a")], vec![mark(1)]]),
            regular(
                "a",
                vec![
                    vec![mark(2)],
                    vec![Stmt::Verdict(Verdict::Return)],
                    vec![mark(4)],
                ],
            ),
        ],
        vec![],
    );
    let b = &eval(&rs, Origin::External).unwrap().branches[0];
    assert_eq!(
        marks(b),
        pairs(&[("a", "0x00000002"), ("pre", "0x00000001")])
    );
}

#[test]
fn accept_ends_the_base_chain_but_later_base_chains_of_the_hook_still_run() {
    // Declared out of priority order: the evaluator must sort by priority.
    let rs = ruleset(
        vec![
            base(
                "late",
                ChainType::Filter,
                Hook::Prerouting,
                20,
                vec![vec![mark(2)]],
            ),
            base(
                "early",
                ChainType::Filter,
                Hook::Prerouting,
                -110,
                vec![vec![jump("a")], vec![mark(1)]],
            ),
            regular("a", vec![vec![Stmt::Verdict(Verdict::Accept)]]),
        ],
        vec![],
    );
    let b = &eval(&rs, Origin::External).unwrap().branches[0];
    assert_eq!(marks(b), pairs(&[("late", "0x00000002")]));
    let hooks: Vec<&str> = b
        .steps
        .iter()
        .filter_map(|s| match s {
            Step::Hook { chain, .. } => Some(chain.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(hooks, ["early", "late"]);
}

#[test]
fn drop_in_a_jumped_chain_ends_the_path_before_routing() {
    let rs = ruleset(
        vec![
            pre(vec![vec![jump("a")], vec![mark(1)]]),
            regular("a", vec![vec![Stmt::Verdict(Verdict::Drop)]]),
            base(
                "fwd",
                ChainType::Filter,
                Hook::Forward,
                0,
                vec![vec![mark(2)]],
            ),
        ],
        vec![],
    );
    let b = &eval(&rs, Origin::External).unwrap().branches[0];
    assert_eq!(b.fate, Fate::Drop);
    assert_eq!(b.route, None);
    assert_eq!(b.decided_by.as_ref().unwrap().chain, "a");
    assert!(marks(b).is_empty());
}

#[test]
fn the_route_follows_the_destination_and_the_origin() {
    let chains = vec![
        base("in", ChainType::Filter, Hook::Input, 0, vec![vec![mark(1)]]),
        base(
            "fwd",
            ChainType::Filter,
            Hook::Forward,
            0,
            vec![vec![mark(2)]],
        ),
        base(
            "out",
            ChainType::Filter,
            Hook::Output,
            0,
            vec![vec![mark(4)]],
        ),
        base(
            "post",
            ChainType::Nat,
            Hook::Postrouting,
            100,
            vec![vec![mark(8)]],
        ),
    ];
    let rs = ruleset(chains, vec![]);
    let local: Vec<IpAddr> = vec![ip("192.0.2.11")];
    let run = |dst: &str, origin| {
        let mut p = packet(origin);
        p.dst = ip(dst);
        let b = evaluate(&rs, &local, p).unwrap().branches.remove(0);
        let chains: Vec<String> = marks(&b).into_iter().map(|(c, _)| c).collect();
        (b.route, chains)
    };
    assert_eq!(
        run("192.0.2.11", Origin::External),
        (Some(Route::Input), vec!["in".to_string()])
    );
    assert_eq!(
        run("203.0.113.20", Origin::Pod),
        (Some(Route::Forward), vec!["fwd".into(), "post".into()])
    );
    assert_eq!(
        run("203.0.113.20", Origin::Host),
        (Some(Route::Output), vec!["out".into(), "post".into()])
    );
    assert_eq!(
        run("127.0.0.1", Origin::Host),
        (
            Some(Route::OutputLocal),
            vec!["out".into(), "post".into(), "in".into()]
        )
    );
}

fn verdict_map(name: &str, elems: Vec<(Vec<Atom>, Verdict)>) -> Set {
    Set {
        name: name.into(),
        comment: String::new(),
        key: vec![KeyField::Daddr, KeyField::L4Proto, KeyField::ThDport],
        data: Some(SetData::Verdict),
        typeof_: false,
        kind: Default::default(),
        elements: elems
            .into_iter()
            .map(|(key, v)| Element {
                key: key.into(),
                data: Some(ElemData::Verdict(v)),
                comment: None,
                origin: None,
            })
            .collect(),
    }
}

#[test]
fn a_vmap_miss_goes_on_with_the_next_rule_and_a_hit_applies_the_verdict() {
    let key = vec![KeyField::Daddr, KeyField::L4Proto, KeyField::ThDport];
    let vm = |map: &str| Stmt::Vmap {
        key: key.clone(),
        map: map.into(),
    };
    let hit = vec![
        Atom::Addr(ip("203.0.113.20")),
        Atom::Proto(Protocol::Tcp),
        Atom::Port(80),
    ];
    let miss = vec![
        Atom::Addr(ip("203.0.113.20")),
        Atom::Proto(Protocol::Udp),
        Atom::Port(80),
    ];
    let rs = ruleset(
        vec![
            pre(vec![
                vec![vm("m1")],
                vec![mark(1)],
                vec![vm("m2")],
                vec![mark(4)],
            ]),
            regular("a", vec![vec![mark(2)]]),
        ],
        vec![
            verdict_map("m1", vec![(miss, Verdict::Jump("a".into()))]),
            verdict_map("m2", vec![(hit, Verdict::Goto("a".into()))]),
        ],
    );
    let b = &eval(&rs, Origin::External).unwrap().branches[0];
    assert_eq!(
        marks(b),
        pairs(&[("pre", "0x00000001"), ("a", "0x00000002")])
    );
    let Some(Step::Rule { notes, .. }) = b
        .steps
        .iter()
        .find(|s| matches!(s, Step::Rule { text, .. } if text.contains("@m2")))
    else {
        panic!("the vmap rule is not in the trace: {:?}", b.steps);
    };
    assert_eq!(
        notes,
        &["@m2: 203.0.113.20 . tcp . 80 : goto a".to_string()]
    );
}

/// A `dnat` map keyed by `numgen random mod k` over `targets`, with element comments.
fn dnat_map(name: &str, targets: &[&str]) -> Set {
    let k = u32::try_from(targets.len()).unwrap();
    Set {
        name: name.into(),
        comment: String::new(),
        key: vec![KeyField::Numgen { modulus: k }],
        data: Some(SetData::Value(vec![KeyField::Daddr, KeyField::ThDport])),
        typeof_: true,
        kind: Default::default(),
        elements: targets
            .iter()
            .enumerate()
            .map(|(slot, t)| {
                let t = sock(t);
                Element {
                    key: [Atom::Int(u32::try_from(slot).unwrap())].into(),
                    data: Some(ElemData::Value(
                        [Atom::Addr(t.ip()), Atom::Port(t.port())].into(),
                    )),
                    comment: Some(Comment::from(format!("{name} slot {slot}"))),
                    origin: None,
                }
            })
            .collect(),
    }
}

fn dnat(map: &str, k: u32) -> Stmt {
    Stmt::DnatMap {
        key: vec![KeyField::Numgen { modulus: k }],
        map: map.into(),
    }
}

fn nat_pre(rules: Vec<Vec<Stmt>>) -> Chain {
    base("nat-pre", ChainType::Nat, Hook::Prerouting, -100, rules)
}

#[test]
fn numgen_forks_into_every_slot_and_the_packet_follows_each_target() {
    let rs = ruleset(
        vec![
            nat_pre(vec![vec![dnat("eps", 3)]]),
            base(
                "post",
                ChainType::Nat,
                Hook::Postrouting,
                100,
                // Only the branch whose target is the client itself matches (a hairpin).
                vec![vec![
                    Stmt::CtStatusDnat,
                    Stmt::AddrMatch {
                        field: AddrField::Daddr,
                        negate: false,
                        net: "198.51.100.10/32".parse().unwrap(),
                    },
                    Stmt::Masquerade { fully_random: true },
                ]],
            ),
        ],
        vec![dnat_map(
            "eps",
            &[
                "198.51.100.30:8080",
                "198.51.100.10:8080",
                "192.0.2.11:8080",
            ],
        )],
    );
    let t = eval(&rs, Origin::Pod).unwrap();
    assert_eq!(t.branches.len(), 3);
    assert_eq!(
        t.dnat_targets(),
        vec![
            sock("192.0.2.11:8080"),
            sock("198.51.100.10:8080"),
            sock("198.51.100.30:8080")
        ]
    );
    let self_branch = t.branch_to(sock("198.51.100.10:8080")).unwrap();
    assert!(self_branch.masquerade.is_some());
    assert_eq!(self_branch.route, Some(Route::Forward));
    assert!(
        t.branch_to(sock("198.51.100.30:8080"))
            .unwrap()
            .masquerade
            .is_none()
    );
    // DNAT to the node's own address is delivered locally: input, no postrouting.
    let local = t.branch_to(sock("192.0.2.11:8080")).unwrap();
    assert_eq!(local.route, Some(Route::Input));
    assert_eq!(t.masqueraded(), None, "branches disagree");
    assert_eq!(
        t.branch_to(sock("198.51.100.30:8080"))
            .unwrap()
            .dnat
            .as_ref()
            .unwrap()
            .comment
            .as_deref(),
        Some("eps slot 0")
    );
}

#[test]
fn nested_numgens_enumerate_every_combination() {
    let pick = |slot: u32| vec![Atom::Int(slot)];
    let outer = Set {
        name: "outer".into(),
        comment: String::new(),
        key: vec![KeyField::Numgen { modulus: 2 }],
        data: Some(SetData::Verdict),
        typeof_: true,
        kind: Default::default(),
        elements: (0..2)
            .map(|slot| Element {
                key: pick(slot).into(),
                data: Some(ElemData::Verdict(Verdict::Goto(format!("c{slot}").into()))),
                comment: None,
                origin: None,
            })
            .collect(),
    };
    let rs = ruleset(
        vec![
            nat_pre(vec![vec![Stmt::Vmap {
                key: vec![KeyField::Numgen { modulus: 2 }],
                map: "outer".into(),
            }]]),
            regular("c0", vec![vec![dnat("m0", 3)]]),
            regular("c1", vec![vec![dnat("m1", 2)]]),
        ],
        vec![
            outer,
            dnat_map(
                "m0",
                &["198.51.100.1:1", "198.51.100.2:1", "198.51.100.3:1"],
            ),
            dnat_map("m1", &["198.51.100.4:1", "198.51.100.5:1"]),
        ],
    );
    let t = eval(&rs, Origin::External).unwrap();
    let choices: Vec<Vec<u32>> = t.branches.iter().map(|b| b.choices.clone()).collect();
    assert_eq!(
        choices,
        [vec![0, 0], vec![0, 1], vec![0, 2], vec![1, 0], vec![1, 1]]
    );
    assert_eq!(t.dnat_targets().len(), 5);
}

#[test]
fn nat_chains_after_a_dnat_at_the_same_hook_are_skipped_and_ct_status_dnat_holds_later() {
    let rs = ruleset(
        vec![
            nat_pre(vec![
                vec![Stmt::CtStatusDnat, mark(4)],
                vec![dnat("eps", 1)],
            ]),
            base(
                "nat-pre-late",
                ChainType::Nat,
                Hook::Prerouting,
                -50,
                vec![vec![mark(1)]],
            ),
            base(
                "fwd",
                ChainType::Filter,
                Hook::Forward,
                0,
                vec![vec![Stmt::CtStatusDnat, mark(2)]],
            ),
        ],
        vec![dnat_map("eps", &["198.51.100.30:8080"])],
    );
    let b = &eval(&rs, Origin::External).unwrap().branches[0];
    assert_eq!(marks(b), pairs(&[("fwd", "0x00000002")]));
    assert!(b.steps.contains(&Step::NatSkipped {
        hook: Hook::Prerouting,
        chain: "nat-pre-late".into()
    }));
}

#[test]
fn masquerade_names_the_rule_that_set_the_mark() {
    let rs = ruleset(
        vec![
            pre(vec![vec![mark(0x4000)]]),
            base(
                "post",
                ChainType::Nat,
                Hook::Postrouting,
                100,
                vec![vec![
                    Stmt::MarkTest { mask: 0x4000 },
                    Stmt::MarkXor(0x4000),
                    Stmt::Masquerade { fully_random: true },
                ]],
            ),
        ],
        vec![],
    );
    let b = &eval(&rs, Origin::External).unwrap().branches[0];
    let m = b.masquerade.as_ref().unwrap();
    assert_eq!(m.marked_by.as_ref().unwrap().chain, "pre");
    assert_eq!(m.by.chain, "post");
}

#[test]
fn a_statement_the_kernel_would_refuse_here_is_an_error_naming_it() {
    // dnat in a filter chain.
    let rs = ruleset(
        vec![pre(vec![vec![dnat("eps", 1)]])],
        vec![dnat_map("eps", &["198.51.100.30:8080"])],
    );
    let err = eval(&rs, Origin::External).unwrap_err().to_string();
    assert!(
        err.contains("dnat ip to numgen random mod 1 map @eps"),
        "{err}"
    );
    // masquerade before postrouting.
    let rs = ruleset(
        vec![nat_pre(vec![vec![Stmt::Masquerade { fully_random: true }]])],
        vec![],
    );
    let err = eval(&rs, Origin::External).unwrap_err().to_string();
    assert!(err.contains("`masquerade fully-random`"), "{err}");
    // An IPv6 prefix in an IPv4 table.
    let rs = ruleset(
        vec![pre(vec![vec![Stmt::AddrMatch {
            field: AddrField::Saddr,
            negate: false,
            net: "2001:db8::/32".parse().unwrap(),
        }]])],
        vec![],
    );
    let err = eval(&rs, Origin::External).unwrap_err().to_string();
    assert!(err.contains("ip saddr 2001:db8::/32"), "{err}");
}

#[test]
fn missing_sets_and_chains_and_loops_are_errors() {
    let rs = ruleset(vec![pre(vec![vec![jump("nowhere")]])], vec![]);
    assert!(matches!(
        eval(&rs, Origin::External),
        Err(EvalError::BadTarget { .. })
    ));
    let rs = ruleset(
        vec![pre(vec![vec![Stmt::InSet {
            key: vec![KeyField::Daddr],
            set: "nothing".into(),
        }]])],
        vec![],
    );
    assert!(matches!(
        eval(&rs, Origin::External),
        Err(EvalError::BadSet { .. })
    ));
    let rs = ruleset(
        vec![
            pre(vec![vec![jump("a")]]),
            regular("a", vec![vec![jump("a")]]),
        ],
        vec![],
    );
    assert!(matches!(
        eval(&rs, Origin::External),
        Err(EvalError::TooDeep { .. })
    ));
    let rs = ruleset(
        vec![
            pre(vec![vec![goto("a")]]),
            regular("a", vec![vec![goto("b")]]),
            regular("b", vec![vec![goto("a")]]),
        ],
        vec![],
    );
    assert_eq!(eval(&rs, Origin::External), Err(EvalError::Loop));
    let rs = ruleset(vec![pre(vec![vec![jump("pre")]])], vec![]);
    assert!(matches!(
        eval(&rs, Origin::External),
        Err(EvalError::BadTarget { .. })
    ));
}

#[test]
fn a_packet_mixing_families_is_refused_and_other_family_tables_are_ignored() {
    let rs = ruleset(vec![pre(vec![vec![Stmt::Verdict(Verdict::Drop)]])], vec![]);
    let mut p = packet(Origin::External);
    p.dst = ip("2001:db8::1");
    assert!(matches!(
        evaluate(&rs, &[], p.clone()),
        Err(EvalError::MixedFamilies { .. })
    ));
    p.src = ip("2001:db8::2");
    let t = evaluate(&rs, &[], p).unwrap();
    assert_eq!(t.fate(), Some(Fate::Accept));
}

fn range_set(name: &str, source: &str) -> Set {
    Set {
        name: name.into(),
        comment: String::new(),
        key: [
            KeyField::Daddr,
            KeyField::L4Proto,
            KeyField::ThDport,
            KeyField::Saddr,
        ]
        .into(),
        data: None,
        typeof_: false,
        elements: vec![Element {
            key: [
                Atom::Addr(ip("203.0.113.20")),
                Atom::Proto(Protocol::Tcp),
                Atom::Port(80),
                Atom::Net(source.parse().unwrap()),
            ]
            .into(),
            data: None,
            comment: None,
            origin: None,
        }],
        kind: SetKind::Interval,
    }
}

#[test]
fn a_negated_lookup_in_an_interval_set_matches_sources_outside_the_ranges() {
    let check = vec![vec![
        Stmt::NotInSet {
            key: [
                KeyField::Daddr,
                KeyField::L4Proto,
                KeyField::ThDport,
                KeyField::Saddr,
            ]
            .into(),
            set: "allow".into(),
        },
        Stmt::Verdict(Verdict::Drop),
    ]];
    // The packet's source 198.51.100.10 is inside 198.51.100.0/24: not dropped.
    let rs = ruleset(
        vec![pre(check.clone())],
        vec![range_set("allow", "198.51.100.0/24")],
    );
    assert_eq!(
        eval(&rs, Origin::External).unwrap().fate(),
        Some(Fate::Accept)
    );
    // Outside 192.0.2.0/24: dropped.
    let rs = ruleset(vec![pre(check)], vec![range_set("allow", "192.0.2.0/24")]);
    assert_eq!(
        eval(&rs, Origin::External).unwrap().fate(),
        Some(Fate::Drop)
    );
}

#[test]
fn an_update_of_a_dynamic_set_goes_on_and_its_set_starts_empty() {
    let pin_key = vec![
        KeyField::Saddr,
        KeyField::Daddr,
        KeyField::L4Proto,
        KeyField::ThDport,
    ];
    let pins = Set {
        name: "pins".into(),
        comment: String::new(),
        key: pin_key.clone(),
        data: None,
        typeof_: true,
        elements: vec![],
        kind: SetKind::Dynamic,
    };
    let rs = ruleset(
        vec![pre(vec![
            // No connection was seen before: the client has no pin.
            vec![
                Stmt::InSet {
                    key: pin_key.clone(),
                    set: "pins".into(),
                },
                Stmt::Verdict(Verdict::Drop),
            ],
            vec![
                Stmt::UpdateSet {
                    key: pin_key,
                    set: "pins".into(),
                    timeout_secs: 2,
                    data: None,
                },
                Stmt::Verdict(Verdict::Accept),
            ],
        ])],
        vec![pins],
    );
    assert_eq!(
        eval(&rs, Origin::External).unwrap().fate(),
        Some(Fate::Accept)
    );
}

#[test]
fn a_random_match_forks_into_a_branch_per_value() {
    // numgen random mod 3 0 drop: one branch of three drops.
    let rs = ruleset(
        vec![pre(vec![vec![
            Stmt::RandomIs {
                modulus: 3,
                value: 0,
            },
            Stmt::Verdict(Verdict::Drop),
        ]])],
        vec![],
    );
    let t = eval(&rs, Origin::External).unwrap();
    let fates: Vec<Fate> = t.branches.iter().map(|b| b.fate).collect();
    assert_eq!(fates, vec![Fate::Drop, Fate::Accept, Fate::Accept]);
}
