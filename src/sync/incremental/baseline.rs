//! The incremental path's bookkeeping: what it knows about the last full sync beyond the
//! applied tables (settings, Nodes, contested keys, every Service's claims, the origins of each
//! Service's elements, and how chains and sets are reached and used), kept up to date as change
//! syncs commit.

use super::*;

/// A chain or a set of our table.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Object {
    Chain(String),
    Set(String),
}

/// What the incremental path knows about the last full sync beyond the applied tables.
pub(in crate::sync) struct Baseline {
    pub(super) settings: Settings,
    pub(super) nodes: BTreeMap<String, Node>,
    /// Services that the last full build shows cannot be rebuilt alone: those involved in a
    /// contested key, and those owning elements of an object that no verdict reaches.
    pub(super) contested: Contested,
    pub(super) families: BTreeMap<IpFamily, Layout>,
    /// Per Service, the origins of its applied elements and its claims ([`Held`]): one map for
    /// both, since nearly every Service has both (two maps by Service held 3.10 MiB at 10k
    /// Services × 10 endpoints, 13.95 at 50k × 5; this one 2.06 and 9.07).
    pub(super) held: HashMap<ServiceName, Held>,
    /// Who claims each address . protocol . port and each NodePort, winner or not. A changed
    /// Service that claims one held by an unchanged Service takes the full path: which of
    /// them gets the key decides elements of the unchanged one too, possibly in other maps
    /// (found by fuzzing: an added Service taking an externalIP from a younger one left the
    /// younger one's elements in place).
    pub(super) claims: HashMap<ClaimKey, Holders>,
    /// Where each origin's elements are in the applied tables.
    pub(in crate::sync) index: super::index::ElementIndex,
    /// The chains of the last full build, before lowering.
    pub(super) chains: BuiltChains,
}

/// A build's chains per family and name, as built (before lowering): a rebuilt chain equal to
/// one of these lowers to the chain the kernel holds, since change syncs never alter chains
/// or set definitions. Comparing them spares a change sync lowering the fixed chains again
/// and comparing their bytes (about a third of its time in the sync thread, by perf).
#[derive(Debug, Default)]
pub(in crate::sync) struct BuiltChains(BTreeMap<IpFamily, HashMap<String, ruleset::Chain>>);

impl BuiltChains {
    pub(in crate::sync) fn of(ruleset: &ruleset::Ruleset) -> BuiltChains {
        BuiltChains(
            ruleset
                .tables
                .iter()
                .map(|t| {
                    let chains = t.chains.iter().map(|c| (c.name.clone(), c.clone()));
                    (t.family, chains.collect())
                })
                .collect(),
        )
    }

    /// Whether every chain of `table` is one of these, unchanged.
    pub(super) fn hold_all(&self, table: &ruleset::Table) -> bool {
        let Some(known) = self.0.get(&table.family) else {
            return false;
        };
        table.chains.iter().all(|c| known.get(&c.name) == Some(c))
    }
}

/// What the baseline holds of one Service.
#[derive(Debug, Default)]
pub(super) struct Held {
    /// The origins of the Service's applied elements (one per Service port and builder
    /// module; every element of a port shares it). Holding them keeps their addresses from
    /// being reused, so an element belongs to a Service exactly when its origin's address is
    /// one of these.
    pub(super) origins: Vec<Arc<ServicePortName>>,
    /// The Service's claims ([`Baseline::claims`] by Service), so that a change replaces a
    /// Service's claims without walking everyone's.
    claims: Box<[ClaimKey]>,
}

impl Held {
    fn is_empty(&self) -> bool {
        self.origins.is_empty() && self.claims.is_empty()
    }
}

/// An address . protocol . port, or a NodePort (no address), that a Service claims.
pub(super) type ClaimKey = (Option<std::net::IpAddr>, Protocol, u16);

/// The Services claiming one key, sorted: almost always one, which a `BTreeSet` would hold in
/// a node for eleven (a 640-byte allocation per key, 8 MB at 10k Services).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Holders(Vec<ServiceName>);

impl Holders {
    pub(super) fn insert(&mut self, name: &ServiceName) {
        if let Err(at) = self.0.binary_search(name) {
            // Nearly every key has one holder: grown by `insert`, the vector would hold four.
            self.0.reserve_exact(1);
            self.0.insert(at, name.clone());
        }
    }

    pub(super) fn remove(&mut self, name: &ServiceName) {
        if let Ok(at) = self.0.binary_search(name) {
            self.0.remove(at);
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &ServiceName> {
        self.0.iter()
    }
}

pub(super) fn claim_keys(svc: &Service) -> Vec<ClaimKey> {
    let addrs = svc
        .cluster_ips
        .iter()
        .chain(&svc.external_ips)
        .chain(&svc.load_balancer_ips);
    let mut keys: Vec<ClaimKey> = addrs
        .flat_map(|a| {
            svc.ports
                .iter()
                .map(move |p| (Some(*a), p.protocol, p.port))
        })
        .collect();
    keys.extend(
        svc.ports
            .iter()
            .filter_map(|p| Some((None, p.protocol, p.node_port?))),
    );
    keys
}

/// How the objects of one applied table are used.
#[derive(Debug)]
pub(super) struct Layout {
    /// Elements not built for a Service (the Node's addresses), by set: they never change
    /// without a Node or settings change.
    pub(super) unowned: BTreeMap<String, BTreeMap<ElemBytes, WireElem>>,
    /// How many elements' verdicts go to each chain.
    pub(super) verdicts: HashMap<String, usize>,
    /// Per chain: the objects beyond the fixed ones that its rules reach (itself included if it
    /// is not fixed).
    pub(super) reach: HashMap<String, Vec<Object>>,
    /// Per object beyond the fixed ones: how many chains with verdicts going to them reach it.
    pub(super) support: HashMap<Object, usize>,
}

impl Baseline {
    /// Records what the incremental path needs after a successful full sync of `applied`, built
    /// from `nodes` and `settings`. `None` when a table is unknown; then every incremental
    /// attempt goes to the full path.
    pub(in crate::sync) fn new(
        applied: &BTreeMap<IpFamily, Option<WireTable>>,
        settings: &Settings,
        nodes: &BTreeMap<String, Node>,
        mut contested: Contested,
    ) -> Option<Baseline> {
        // The objects a build holds whatever the Services.
        let fixed_state = ClusterState {
            nodes: nodes.clone(),
            ..ClusterState::default()
        };
        let mut fixed: BTreeMap<IpFamily, BTreeSet<Object>> = BTreeMap::new();
        for table in ruleset::build(&fixed_state, settings).tables {
            let objects = fixed.entry(table.family).or_default();
            objects.extend(table.chains.iter().map(|c| Object::Chain(c.name.clone())));
            objects.extend(table.sets.iter().map(|s| Object::Set(s.name.clone())));
        }

        let mut families = BTreeMap::new();
        let mut index = super::index::ElementIndex::default();
        let mut held: HashMap<ServiceName, Held> = HashMap::new();
        for family in IpFamily::ALL {
            let table = applied.get(&family)?.as_ref()?;
            let fixed = fixed.remove(&family).unwrap_or_default();
            let mut unowned: BTreeMap<String, BTreeMap<ElemBytes, WireElem>> = BTreeMap::new();
            let mut verdicts: HashMap<String, usize> = HashMap::new();
            for (name, set) in &table.sets {
                if set.is_dynamic() {
                    continue;
                }
                let mut runs = index.set_runs(family, name);
                for (key, elem) in &set.elements {
                    if let Some(chain) = elem.chain() {
                        match verdicts.get_mut(chain) {
                            Some(n) => *n += 1,
                            None => {
                                verdicts.insert(chain.to_owned(), 1);
                            }
                        }
                    }
                    let Some(origin) = &elem.origin else {
                        runs.push(0, key);
                        unowned
                            .entry(name.clone())
                            .or_default()
                            .insert(key.clone(), elem.clone());
                        continue;
                    };
                    if runs.push(address(origin), key) {
                        add_origin(&mut held, origin);
                    }
                }
            }
            let reach = reach(table, &fixed);
            let mut support: HashMap<Object, usize> = HashMap::new();
            for (chain, objects) in &reach {
                if verdicts.get(chain).is_some_and(|n| *n > 0) {
                    for o in objects {
                        *support.entry(o.clone()).or_default() += 1;
                    }
                }
            }
            // An object that no verdict reaches exists because elements were left in its map
            // (a `pick-<k>` map holding a contested Service's endpoints): whether it stays
            // depends on those elements' Services, which therefore take the full path, like
            // contested ones.
            let mut unreached: BTreeSet<&str> = BTreeSet::new();
            for (name, objects) in &reach {
                let chain = Object::Chain(name.clone());
                if !fixed.contains(&chain) && !support.contains_key(&chain) {
                    unreached.extend(objects.iter().filter_map(|o| match o {
                        Object::Set(s) => Some(s.as_str()),
                        Object::Chain(_) => None,
                    }));
                }
            }
            for name in table.sets.keys() {
                let o = Object::Set(name.clone());
                if !fixed.contains(&o) && !support.contains_key(&o) {
                    unreached.insert(name);
                }
            }
            for name in unreached {
                let owners = table.sets.get(name).into_iter().flat_map(|s| {
                    s.elements
                        .values()
                        .filter_map(|e| e.origin.as_ref().map(|o| o.service.clone()))
                });
                contested.extend(owners);
            }
            families.insert(
                family,
                Layout {
                    unowned,
                    verdicts,
                    reach,
                    support,
                },
            );
        }
        // Kept until the next full sync: without the slack their growth by doubling left.
        for held in held.values_mut() {
            held.origins.shrink_to_fit();
        }
        index.shrink_to_fit();
        Some(Baseline {
            settings: settings.clone(),
            nodes: nodes.clone(),
            contested,
            families,
            held,
            claims: HashMap::new(),
            index,
            chains: BuiltChains::default(),
        })
    }

    /// Records the claims of `services`, the whole state the full build was made from.
    pub(in crate::sync) fn with_claims(
        mut self,
        services: &BTreeMap<ServiceName, Service>,
    ) -> Baseline {
        self.claims.clear();
        for held in self.held.values_mut() {
            held.claims = Box::default();
        }
        for (name, svc) in services {
            self.claim(name, svc);
        }
        self.held.retain(|_, held| !held.is_empty());
        self
    }

    /// The origins of `name`'s applied elements.
    pub(super) fn origins_of(&self, name: &ServiceName) -> &[Arc<ServicePortName>] {
        self.held.get(name).map_or(&[], |held| &held.origins)
    }

    /// Forgets the origins of `name`'s applied elements, and returns them.
    pub(super) fn take_origins(&mut self, name: &ServiceName) -> Vec<Arc<ServicePortName>> {
        self.held
            .get_mut(name)
            .map(|held| std::mem::take(&mut held.origins))
            .unwrap_or_default()
    }

    /// Records the chains of the full build the applied tables were lowered from.
    pub(in crate::sync) fn with_chains(mut self, chains: BuiltChains) -> Baseline {
        self.chains = chains;
        self
    }

    pub(super) fn claim(&mut self, name: &ServiceName, svc: &Service) {
        let keys = claim_keys(svc);
        for key in &keys {
            self.claims.entry(*key).or_default().insert(name);
        }
        self.held.entry(name.clone()).or_default().claims = keys.into_boxed_slice();
    }

    /// The claims of `changed` replaced by those of their versions in `scoped`; after their
    /// origins were (see `Syncer::commit`), since a Service left with neither is forgotten.
    pub(super) fn reclaim(&mut self, scoped: &ClusterState, changed: &BTreeSet<ServiceName>) {
        for name in changed {
            let keys = self
                .held
                .get_mut(name)
                .map(|held| std::mem::take(&mut held.claims))
                .unwrap_or_default();
            for key in keys {
                if let Some(holders) = self.claims.get_mut(&key) {
                    holders.remove(name);
                    if holders.is_empty() {
                        self.claims.remove(&key);
                    }
                }
            }
        }
        for name in changed {
            if let Some(svc) = scoped.services.get(name) {
                self.claim(name, svc);
            }
            if self.held.get(name).is_some_and(Held::is_empty) {
                self.held.remove(name);
            }
        }
    }
}

/// Notes `origin` among its Service's origins.
pub(super) fn add_origin(held: &mut HashMap<ServiceName, Held>, origin: &Arc<ServicePortName>) {
    match held.get_mut(&origin.service) {
        Some(held) => {
            if !held.origins.iter().any(|o| Arc::ptr_eq(o, origin)) {
                held.origins.push(origin.clone());
            }
        }
        None => {
            let origins = vec![origin.clone()];
            held.insert(
                origin.service.clone(),
                Held {
                    origins,
                    claims: Box::default(),
                },
            );
        }
    }
}

/// The chains and sets the rules of `chain` refer to.
pub(super) fn references(table: &WireTable, chain: &str) -> Vec<Object> {
    let Some(c) = table.chains.get(chain) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for rule in &c.rules {
        for e in &rule.exprs {
            out.extend(e.set_ref().map(Object::Set));
            out.extend(e.updated_set().map(Object::Set));
            out.extend(e.chain_ref().map(Object::Chain));
        }
    }
    out
}

/// For each chain of `table`: the objects not in `fixed` that its rules reach, directly or
/// through other chains, itself included when it is not fixed.
pub(super) fn reach(table: &WireTable, fixed: &BTreeSet<Object>) -> HashMap<String, Vec<Object>> {
    let mut out = HashMap::new();
    for name in table.chains.keys() {
        let mut seen: BTreeSet<Object> = BTreeSet::new();
        let mut todo = vec![Object::Chain(name.clone())];
        while let Some(o) = todo.pop() {
            if !seen.insert(o.clone()) {
                continue;
            }
            if let Object::Chain(c) = &o {
                todo.extend(references(table, c));
            }
        }
        out.insert(
            name.clone(),
            seen.into_iter().filter(|o| !fixed.contains(o)).collect(),
        );
    }
    out
}

#[cfg(test)]
impl Baseline {
    /// How the counts maintained incrementally differ from those `fresh` computed from the same
    /// applied tables (empty when they agree).
    pub(in crate::sync) fn differences(
        &self,
        fresh: &Baseline,
        applied: &BTreeMap<IpFamily, Option<WireTable>>,
    ) -> Vec<String> {
        let mut out = Vec::new();
        for (family, mine) in &self.families {
            let Some(theirs) = fresh.families.get(family) else {
                out.push(format!("{family}: no fresh layout"));
                continue;
            };
            let verdicts = |m: &HashMap<String, usize>| -> BTreeMap<String, usize> {
                m.iter()
                    .filter(|(_, n)| **n > 0)
                    .map(|(k, n)| (k.clone(), *n))
                    .collect()
            };
            if verdicts(&mine.verdicts) != verdicts(&theirs.verdicts) {
                out.push(format!(
                    "{family}: verdict counts {:?} != {:?}",
                    verdicts(&mine.verdicts),
                    verdicts(&theirs.verdicts)
                ));
            }
            let support = |m: &HashMap<Object, usize>| -> BTreeMap<Object, usize> {
                m.iter()
                    .filter(|(_, n)| **n > 0)
                    .map(|(k, n)| (k.clone(), *n))
                    .collect()
            };
            if support(&mine.support) != support(&theirs.support) {
                out.push(format!(
                    "{family}: support {:?} != {:?}",
                    support(&mine.support),
                    support(&theirs.support)
                ));
            }
            if mine.unowned != theirs.unowned {
                out.push(format!("{family}: unowned elements differ"));
            }
        }
        let addresses = |o: &HashMap<ServiceName, Held>| {
            o.iter()
                .filter(|(_, held)| !held.origins.is_empty())
                .map(|(n, held)| {
                    let set: BTreeSet<usize> = held.origins.iter().map(address).collect();
                    (n.clone(), set)
                })
                .collect::<BTreeMap<_, _>>()
        };
        if addresses(&self.held) != addresses(&fresh.held) {
            out.push("origins per Service differ".to_string());
        }
        if let Some((name, _)) = self.held.iter().find(|(_, held)| held.is_empty()) {
            out.push(format!("{name} is held with neither origins nor claims"));
        }
        out.extend(self.index_differences(applied));
        let mut inverted: HashMap<ClaimKey, Holders> = HashMap::new();
        for (name, held) in &self.held {
            for key in &held.claims {
                inverted.entry(*key).or_default().insert(name);
            }
        }
        if inverted != self.claims {
            out.push("claims per Service do not invert the claims".to_string());
        }
        out
    }

    /// Where the index finds each origin's elements differently from a walk over `applied`.
    fn index_differences(&self, applied: &BTreeMap<IpFamily, Option<WireTable>>) -> Vec<String> {
        type Found = BTreeSet<(IpFamily, String, ElemBytes)>;
        let mut walked: BTreeMap<OriginAddr, Found> = BTreeMap::new();
        for table in applied.values().flatten() {
            for (name, set) in &table.sets {
                if set.is_dynamic() {
                    continue;
                }
                for (key, elem) in &set.elements {
                    if let Some(o) = &elem.origin {
                        walked.entry(address(o)).or_default().insert((
                            table.family,
                            name.clone(),
                            key.clone(),
                        ));
                    }
                }
            }
        }
        let mut out = Vec::new();
        for origin in self.held.values().flat_map(|held| &held.origins) {
            let a = address(origin);
            let mut found = Found::new();
            for table in applied.values().flatten() {
                self.index
                    .elements_of(table.family, table, a, |name, key, _| {
                        found.insert((table.family, name.to_owned(), key.into()));
                    });
            }
            if found != walked.remove(&a).unwrap_or_default() {
                out.push(format!("the index finds other elements of {origin}"));
            }
        }
        if !walked.is_empty() {
            out.push(format!(
                "{} origin(s) of applied elements are not among the Services' origins",
                walked.len()
            ));
        }
        out
    }

    pub(in crate::sync) fn settings_for_tests(&self) -> &Settings {
        &self.settings
    }

    pub(in crate::sync) fn nodes_for_tests(&self) -> &BTreeMap<String, Node> {
        &self.nodes
    }

    /// Capacity beyond the length of the vectors kept per Service, per claim and in the
    /// index: the syncer keeps them until the next full sync.
    #[cfg(test)]
    pub(in crate::sync) fn spare_capacity(&self) -> usize {
        let origins: usize = self
            .held
            .values()
            .map(|h| h.origins.capacity() - h.origins.len())
            .sum();
        let holders: usize = self
            .claims
            .values()
            .map(|h| h.0.capacity() - h.0.len())
            .sum();
        origins + holders + self.index.spare_capacity()
    }
}
