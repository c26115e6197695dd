//! The sync thread: the one writer ([`Syncer`]) on its own OS thread, the requests it serves,
//! and what runs after each successful sync (health-check node ports, the UDP conntrack
//! reconciler, the per-Service caches).

use std::sync::Arc;

use super::events::EventSink;
use super::*;

/// One request to the sync thread.
pub(super) struct Request {
    pub(super) work: Work,
    pub(super) reply: oneshot::Sender<Reply>,
}

/// The writer's answer: the sync's result, and the kinds of the operations the kernel rejected
/// on the way (also when a retry or a quarantine made the sync succeed).
pub(super) struct Reply {
    pub(super) result: Result<Synced, NftError>,
    pub(super) rejected: Vec<ReplyKind>,
}

/// What the sync thread is asked to sync.
pub(super) enum Work {
    /// Every Service, from the whole state; `verify` reads the kernel back first.
    Full {
        state: Arc<ClusterState>,
        verify: bool,
    },
    /// Only the `changed` Services, from `scoped` (`ClusterState::subset(changed)` of the
    /// state). If the syncer cannot do that, the sync thread syncs everything from a snapshot it
    /// takes itself.
    Changed {
        scoped: ClusterState,
        changed: BTreeSet<ServiceName>,
        /// The sync period came due: if anyone else committed since our last transaction (or
        /// a full rebuild is overdue), everything is synced from a read-back instead.
        verify: bool,
    },
    /// The periodic verification with nothing changed: repair whatever someone else changed.
    /// The sync thread takes a snapshot only if the kernel's ruleset generation says someone
    /// did (or a full rebuild is overdue).
    Verify,
}

impl Work {
    /// The state the request carries: whole or scoped, it has the Nodes.
    pub(super) fn state(&self) -> Option<&ClusterState> {
        match self {
            Work::Full { state, .. } => Some(state),
            Work::Changed { scoped, .. } => Some(scoped),
            Work::Verify => None,
        }
    }
}

/// What the sync thread did for one request.
pub(super) struct Synced {
    pub(super) outcome: SyncOutcome,
    /// Which path ran: every Service rebuilt (or the kernel read back), or only the changed ones.
    pub(super) kind: SyncKind,
    /// How many Services were rebuilt.
    pub(super) rebuilt: usize,
    /// The state synced: whole (shared with the watches until one of them writes), or scoped
    /// to the changed Services.
    pub(super) state: Arc<ClusterState>,
    /// Per family: (internal, external) Local-policy Service ports without local endpoints.
    pub(super) no_local: Vec<(IpFamily, usize, usize)>,
    /// Per family: UDP conntrack entries deleted.
    pub(super) conntrack_deleted: Vec<(IpFamily, usize)>,
    /// Address and port claims lost to another Service at the last full sync.
    pub(super) address_conflicts: usize,
}

/// A successful sync, before what follows it.
pub(super) struct Done {
    pub(super) outcome: SyncOutcome,
    pub(super) kind: SyncKind,
    pub(super) rebuilt: usize,
    pub(super) state: Arc<ClusterState>,
    pub(super) delta: Delta,
}

/// Deletes a family's stale UDP conntrack entries given every UDP Service port of the family;
/// returns how many were deleted.
pub(super) type ReconcileUdp =
    Box<dyn FnMut(IpFamily, &[UdpService]) -> Result<usize, ConntrackError> + Send>;

/// The sync thread's state: the one writer, plus what runs after each successful sync.
pub(super) struct Writer<K: Kernel> {
    pub(super) syncer: Syncer<K>,
    pub(super) settings: Settings,
    pub(super) health: ProxyHealth,
    pub(super) runtime: Handle,
    /// A copy of the whole current state, for a request to sync the changed Services that the
    /// syncer can only do by syncing everything.
    pub(super) full_state: Box<dyn Fn() -> Arc<ClusterState> + Send>,
    /// `conntrack::reconcile_udp`; replaced in tests, which must not touch the host's table.
    pub(super) reconcile_udp: ReconcileUdp,
    /// The health-check node port servers and the addresses they were created for.
    pub(super) health_checks: Option<(Vec<IpAddr>, HealthCheckServers)>,
    /// What was derived from each Service at the last successful sync.
    pub(super) caches: Caches,
    /// Families whose last UDP conntrack reconciliation failed (e.g. a netlink timeout): retried
    /// on the next sync, since the stale entries would otherwise stay until the next change of
    /// a UDP Service's endpoints.
    pub(super) conntrack_retry: BTreeSet<IpFamily>,
    /// When every Service was last rebuilt: a verification that finds the kernel unchanged
    /// still rebuilds everything after [`FULL_REBUILD_PERIOD`].
    pub(super) last_full_rebuild: Option<Instant>,
    /// Marked around every job, read by the systemd watchdog (`notify`).
    pub(super) progress: Progress,
    /// The test-only fault switch [`notify::HANG_WRITER_ENV`].
    pub(super) hang_switch: Option<std::path::PathBuf>,
    /// [`ruleset::address_warnings`] of the last full sync: each is logged when it appears,
    /// not at every full sync while it lasts.
    pub(super) address_warnings: BTreeSet<String>,
    /// Clashes between Services over one address and port at the last full sync.
    pub(super) address_conflicts: usize,
    /// Where the Events about quarantined and released Services go.
    pub(super) events: EventSink,
}

impl<K: Kernel> Writer<K> {
    pub(super) fn new(
        syncer: Syncer<K>,
        settings: Settings,
        health: ProxyHealth,
        runtime: Handle,
        full_state: Box<dyn Fn() -> Arc<ClusterState> + Send>,
    ) -> Self {
        Writer {
            syncer,
            settings,
            health,
            runtime,
            full_state,
            reconcile_udp: Box::new(conntrack::reconcile_udp),
            health_checks: None,
            caches: Caches::default(),
            conntrack_retry: BTreeSet::new(),
            last_full_rebuild: None,
            progress: Progress::default(),
            hang_switch: None,
            address_warnings: BTreeSet::new(),
            address_conflicts: 0,
            events: EventSink::disabled(),
        }
    }

    pub(super) fn serve(mut self, requests: mpsc::Receiver<Request>) {
        while let Ok(req) = requests.recv() {
            self.progress.busy();
            notify::hang_if_switched(self.hang_switch.as_deref());
            let result = self.handle(req.work);
            let rejected = self.syncer.take_rejections();
            self.progress.idle();
            // The loop only stops waiting for a reply when the daemon is exiting.
            let _ = req.reply.send(Reply { result, rejected });
        }
        // The daemon is exiting and the rules stay: the next start adopts them without
        // reading their elements back if nobody changes anything meanwhile (`sync::seal`).
        self.progress.busy();
        match self.syncer.seal() {
            Ok(true) => tracing::info!("sealed our tables for the next start"),
            Ok(false) => tracing::info!(
                "our tables are not sealed: the kernel may have changed since our last sync, \
                 so the next start reads them back"
            ),
            Err(e) => tracing::warn!(
                "could not seal our tables (the next start reads them back): {}",
                crate::report::chain(&e)
            ),
        }
        self.progress.idle();
    }

    pub(super) fn handle(&mut self, work: Work) -> Result<Synced, NftError> {
        let done = match work {
            Work::Full { state, verify } => {
                // A verification that falls due while changes keep coming reads back only
                // when someone else committed, as the idle one does: at 10k Services the
                // read-back costs more than half a second, every sync period.
                let verify = verify && self.verification_needs_full()?;
                self.sync_all(state, verify)?
            }
            Work::Verify => {
                if self.verification_needs_full()? {
                    self.sync_all((self.full_state)(), true)?
                } else {
                    tracing::debug!(
                        "verified: no nftables transaction since ours, the kernel holds what \
                         we applied"
                    );
                    return Ok(self.verified_unchanged());
                }
            }
            // The caches are only ever updated from a complete build; the loop starts with a
            // full sync, so this is only a safeguard.
            Work::Changed { .. } if !self.caches.is_built() => {
                self.sync_all((self.full_state)(), false)?
            }
            Work::Changed { verify: true, .. } if self.verification_needs_full()? => {
                self.sync_all((self.full_state)(), true)?
            }
            Work::Changed {
                scoped, changed, ..
            } => {
                match self
                    .syncer
                    .sync_changed(&scoped, &changed, &self.settings)?
                {
                    Incremental::Done(outcome) => {
                        let outcome = *outcome;
                        let delta = self
                            .caches
                            .update(&scoped, &changed, &self.settings.node_name);
                        Done {
                            // Reading the kernel back is a full sync whatever was rebuilt.
                            kind: if outcome.full {
                                SyncKind::Full
                            } else {
                                SyncKind::Partial
                            },
                            outcome,
                            rebuilt: changed.len(),
                            state: Arc::new(scoped),
                            delta,
                        }
                    }
                    Incremental::NeedsFull(why) => {
                        tracing::debug!("syncing every Service: {why}");
                        self.sync_all((self.full_state)(), false)?
                    }
                }
            }
        };
        self.events.quarantine_changes(&done.outcome, &done.state);
        let addrs = health_check_addresses(&done.state, &self.settings);
        self.sync_health_checks(
            addrs,
            done.kind == SyncKind::Full || done.delta.health_checks,
        );
        let mut families = std::mem::take(&mut self.conntrack_retry);
        families.extend(done.delta.udp_families.iter().copied());
        let conntrack_deleted = self.reconcile_conntrack(&families);
        let no_local = self.no_local();
        Ok(Synced {
            outcome: done.outcome,
            kind: done.kind,
            rebuilt: done.rebuilt,
            state: done.state,
            no_local,
            conntrack_deleted,
            address_conflicts: self.address_conflicts,
        })
    }

    /// Whether a verification must read back and rebuild every Service: someone else committed
    /// since our last transaction, or a full rebuild is overdue. Otherwise the kernel holds what
    /// we applied, and one netlink round trip proved it.
    pub(super) fn verification_needs_full(&mut self) -> Result<bool, NftError> {
        Ok(self.rebuild_overdue() || !self.syncer.kernel_unchanged()?)
    }

    /// Every Service is rebuilt and compared at least every `FULL_REBUILD_PERIOD`.
    pub(super) fn rebuild_overdue(&self) -> bool {
        self.last_full_rebuild
            .is_none_or(|t| t.elapsed() >= FULL_REBUILD_PERIOD)
    }

    /// Syncs every Service of `state` and rebuilds the caches from it.
    pub(super) fn sync_all(
        &mut self,
        state: Arc<ClusterState>,
        verify: bool,
    ) -> Result<Done, NftError> {
        let outcome = self.syncer.sync(&state, &self.settings, verify)?;
        self.last_full_rebuild = Some(Instant::now());
        let warnings: BTreeSet<String> = crate::ruleset::address_warnings(&state, &self.settings)
            .into_iter()
            .collect();
        for warning in warnings.difference(&self.address_warnings) {
            tracing::warn!("{warning}");
        }
        self.address_warnings = warnings;
        self.address_conflicts = IpFamily::ALL
            .iter()
            .map(|&f| crate::ruleset::Claims::new(&state, f).clashes.len())
            .sum();
        let delta = self.caches.rebuild(&state, &self.settings.node_name);
        Ok(Done {
            outcome,
            kind: SyncKind::Full,
            rebuilt: state.services.len(),
            state,
            delta,
        })
    }

    /// The answer to a verification that found nothing to do: no Service rebuilt, nothing
    /// derived changed; only a failed conntrack clean-up is retried.
    pub(super) fn verified_unchanged(&mut self) -> Synced {
        let families = std::mem::take(&mut self.conntrack_retry);
        let conntrack_deleted = self.reconcile_conntrack(&families);
        Synced {
            outcome: SyncOutcome::default(),
            kind: SyncKind::Partial,
            rebuilt: 0,
            state: Arc::default(),
            no_local: self.no_local(),
            conntrack_deleted,
            address_conflicts: self.address_conflicts,
        }
    }

    /// Per family: (internal, external) Local-policy Service ports without local endpoints.
    pub(super) fn no_local(&self) -> Vec<(IpFamily, usize, usize)> {
        FAMILIES
            .into_iter()
            .map(|f| {
                let (i, e) = self.caches.no_local(f);
                (f, i, e)
            })
            .collect()
    }

    /// Serves the health-check node ports on `addrs`. The wanted ports are passed to the servers
    /// only when they may have `changed` (or the addresses did): at 10k Services that list is
    /// not rebuilt for every sync. A port that failed to open is retried then.
    pub(super) fn sync_health_checks(&mut self, addrs: Option<Vec<IpAddr>>, changed: bool) {
        let wanted = self.caches.has_health_checks();
        if !wanted && self.health_checks.is_none() {
            return;
        }
        let Some(addrs) = addrs else {
            if wanted && changed {
                tracing::warn!(
                    "no address of node {} is selected by --nodeport-addresses: health-check \
                     node ports are not served",
                    self.settings.node_name
                );
            }
            self.health_checks = None;
            return;
        };
        match &mut self.health_checks {
            Some((bound, servers)) if *bound == addrs => {
                if changed {
                    servers.sync(self.caches.health_checks());
                }
            }
            slot => {
                // New addresses (or the first time): listeners on the old ones close.
                let servers = HealthCheckServers::new(
                    addrs.clone(),
                    self.health.clone(),
                    self.runtime.clone(),
                );
                slot.insert((addrs, servers))
                    .1
                    .sync(self.caches.health_checks());
            }
        }
    }

    /// Runs the UDP conntrack reconciler for each family whose UDP serving endpoints changed in
    /// this (successful) sync.
    pub(super) fn reconcile_conntrack(
        &mut self,
        families: &BTreeSet<IpFamily>,
    ) -> Vec<(IpFamily, usize)> {
        let mut out = Vec::new();
        for &f in families {
            let services = self.caches.udp_services(f);
            match (self.reconcile_udp)(f, &services) {
                Ok(0) => {}
                Ok(n) => {
                    tracing::info!("deleted {n} stale {f} UDP conntrack entr(y/ies)");
                    out.push((f, n));
                }
                Err(e) => {
                    tracing::warn!(
                        "UDP conntrack reconciliation ({f}) failed, retried on the next sync: {}",
                        report::chain(&e)
                    );
                    self.conntrack_retry.insert(f);
                }
            }
        }
        out
    }
}

/// Where the health-check node ports listen: the Node's addresses that `--nodeport-addresses`
/// selects (the same addresses NodePorts answer on), or every address for `all`. `None` when
/// nothing is selected (the Node has no matching address, or is not known yet).
pub(super) fn health_check_addresses(
    state: &ClusterState,
    settings: &Settings,
) -> Option<Vec<IpAddr>> {
    let npa = &settings.nodeport_addresses;
    if FAMILIES.iter().all(|&f| npa.all_of(f)) {
        return Some(Vec::new());
    }
    let node = state.nodes.get(&settings.node_name)?;
    let addrs: Vec<IpAddr> = node
        .internal_ips
        .iter()
        .chain(&node.external_ips)
        .copied()
        .filter(|ip| {
            let f = IpFamily::of(ip);
            !ip.is_loopback() && npa.selects(*ip, node.primary_ip(f) == Some(*ip))
        })
        .collect();
    (!addrs.is_empty()).then_some(addrs)
}
