//! When the daemon syncs: the coalescing schedule (pure, unit-tested), the loop that sends the
//! sync thread its requests, and the logs, health and metrics after each sync.

use super::*;

/// The timing of the sync loop.
#[derive(Debug, Clone, Copy)]
pub(super) struct LoopConfig {
    pub(super) min_sync_period: Duration,
    pub(super) sync_period: Duration,
}

/// When the next sync runs, and of which kind; pure, so the coalescing is unit-tested.
#[derive(Debug, Clone)]
pub(super) struct Schedule {
    pub(super) cfg: LoopConfig,
    /// A change (or a failed sync) waits to be synced.
    pub(super) pending: bool,
    /// The next sync reads the kernel back.
    pub(super) verify: bool,
    /// The sync under way is the periodic verification (nothing was pending).
    pub(super) periodic: bool,
    /// The sync under way verifies only because the sync period came due while changes kept
    /// coming (not at start-up or after a failure): if nobody else committed since our last
    /// transaction, the change sync itself is the verification, with no full rebuild.
    pub(super) due_only: bool,
    pub(super) last_start: Option<Instant>,
    /// `last_start` before the sync under way, for [`Schedule::verified_quietly`].
    pub(super) previous_start: Option<Instant>,
    pub(super) retry_at: Option<Instant>,
    pub(super) backoff: Duration,
    pub(super) next_verify: Instant,
}

impl Schedule {
    pub(super) fn new(cfg: LoopConfig, now: Instant) -> Schedule {
        Schedule {
            cfg,
            // The first sync is due at once, and verifies: the kernel may hold a previous
            // instance's rules, which are reconciled, not flushed.
            pending: true,
            verify: true,
            periodic: false,
            due_only: false,
            last_start: None,
            previous_start: None,
            retry_at: None,
            backoff: Duration::ZERO,
            next_verify: now + cfg.sync_period,
        }
    }

    pub(super) fn changed(&mut self) {
        self.pending = true;
    }

    /// When the next sync is due.
    pub(super) fn due(&self, now: Instant) -> Instant {
        if !self.pending {
            return self.next_verify;
        }
        let mut at = self
            .last_start
            .map_or(now, |t| t + self.cfg.min_sync_period);
        if let Some(r) = self.retry_at {
            at = at.max(r);
        }
        at
    }

    /// A sync starts now; returns whether it verifies.
    pub(super) fn start(&mut self, now: Instant) -> bool {
        // Nothing changed: this is the periodic verification.
        self.periodic = !self.pending;
        // A change sync that falls due after the verification verifies too: under a steady
        // stream of changes (one per sync period is enough) there is never an idle sync, and
        // a table changed by someone else would otherwise never be repaired.
        self.due_only = !self.periodic && !self.verify && now >= self.next_verify;
        if self.periodic || now >= self.next_verify {
            self.verify = true;
        }
        self.previous_start = self.last_start;
        self.last_start = Some(now);
        self.verify
    }

    /// The periodic verification found that nobody else had committed and sent nothing (one
    /// netlink round trip): it does not hold the next change back by `min_sync_period`, which
    /// paces syncs, not checks. Without this, a change arriving just after a verification
    /// waited up to `min_sync_period` (the daemon bench's idle maximum went from 8 ms to 0.5 s).
    pub(super) fn verified_quietly(&mut self) {
        self.last_start = self.previous_start;
    }

    pub(super) fn succeeded(&mut self, started: Instant) {
        // Only a sync that read the kernel back postpones the next verification.
        if self.verify {
            self.next_verify = started + self.cfg.sync_period;
        }
        self.pending = false;
        self.verify = false;
        self.retry_at = None;
        self.backoff = Duration::ZERO;
    }

    /// Returns the delay before the retry.
    pub(super) fn failed(&mut self, now: Instant) -> Duration {
        self.pending = true;
        self.verify = true;
        self.backoff = if self.backoff.is_zero() {
            FIRST_BACKOFF
        } else {
            self.backoff.saturating_mul(2)
        }
        .min(self.cfg.sync_period);
        self.retry_at = Some(now + self.backoff);
        self.backoff
    }
}

pub(super) async fn sync_loop(
    cluster: &mut ClusterWatch,
    settings: &Settings,
    health: &ProxyHealth,
    metrics: &Metrics,
    cfg: LoopConfig,
    writer: mpsc::Sender<Request>,
    shutdown: tokio_watch::Receiver<bool>,
) -> Result<(), DaemonError> {
    let mut schedule = Schedule::new(cfg, Instant::now());
    // systemd is told READY=1 after the first successful sync, not before: `systemctl start`
    // then returns once the rules are programmed.
    let mut notified_ready = false;
    // Changes taken for a sync that failed: they count for the retry.
    let mut carried = Changes::default();
    loop {
        let due = schedule.due(Instant::now());
        tokio::select! {
            biased;
            () = stopped(shutdown.clone()) => {
                notify::stopping();
                return Ok(());
            }
            () = cluster.changed() => {
                schedule.changed();
                for f in FAMILIES {
                    health.queued_update(f);
                }
                metrics.set_last_queued_timestamp(&FAMILIES, SystemTime::now());
                continue;
            }
            () = tokio::time::sleep_until(due.into()) => {}
        }
        let started = Instant::now();
        let verify = schedule.start(started);
        // The changes before the state: the watch writes the state before it records a change,
        // so the state read next covers at least the changes taken (a change that lands in
        // between is also in the next batch, and syncing a Service twice is harmless).
        let mut changes = cluster.take_changes();
        changes.merge(std::mem::take(&mut carried));
        // A failed sync is retried verifying, so it always takes the full path too.
        let quiet_check = verify && schedule.periodic && changes == Changes::default();
        let work = if quiet_check {
            Work::Verify
        } else if changes.needs_full() || (verify && !schedule.due_only) {
            Work::Full {
                state: cluster.snapshot(),
                verify,
            }
        } else {
            let changed = changes.services_changed.clone();
            Work::Changed {
                scoped: cluster.with_state(|s| s.subset(&changed)),
                changed,
                verify,
            }
        };
        if let Some(node) = work.state().and_then(|s| s.nodes.get(&settings.node_name)) {
            health.set_node(node.deleting, node.to_be_deleted);
        }
        let (reply, answer) = oneshot::channel();
        writer
            .send(Request { work, reply })
            .map_err(|_| DaemonError::SyncThread)?;
        // Not raced against shutdown: the transaction in flight always finishes.
        let Reply { result, rejected } = answer.await.map_err(|_| DaemonError::SyncThread)?;
        for kind in rejected {
            metrics.inc_kernel_rejections(kind.label());
        }
        match result {
            Ok(synced) => {
                schedule.succeeded(started);
                if quiet_check && synced.rebuilt == 0 && !synced.outcome.full {
                    schedule.verified_quietly();
                }
                record_success(&synced, &changes, health, metrics);
                let status = format!("last sync {}: {}", jiff::Timestamp::now(), synced.outcome);
                if notified_ready {
                    notify::status(&status);
                } else {
                    notify::ready(&status);
                    notified_ready = true;
                }
            }
            Err(e) => {
                let delay = schedule.failed(Instant::now());
                let e = report::chain(&e);
                tracing::error!(
                    "sync failed: {e}; retrying with a full read-back in {:.1} s",
                    delay.as_secs_f64()
                );
                notify::status(&format!(
                    "sync failed at {}: {e}; retrying in {:.1} s",
                    jiff::Timestamp::now(),
                    delay.as_secs_f64()
                ));
                for f in FAMILIES {
                    metrics.inc_sync_failures(f);
                }
                carried = changes;
            }
        }
    }
}

/// Logs, health and metrics after a successful sync.
pub(super) fn record_success(
    synced: &Synced,
    changes: &Changes,
    health: &ProxyHealth,
    metrics: &Metrics,
) {
    let outcome = &synced.outcome;
    let now = SystemTime::now();
    let changed = outcome.report.empty_plans < outcome.report.tables || outcome.drift_repaired;
    if changed {
        tracing::info!(
            "{outcome}; {} Service(s) rebuilt ({} Service, {} EndpointSlice, {} Node change(s))",
            synced.rebuilt,
            changes.services,
            changes.endpoint_slices,
            changes.nodes
        );
    } else {
        tracing::debug!("{outcome}: nothing to change");
    }
    for f in FAMILIES {
        health.updated(f);
    }
    health.set_quarantined(
        outcome
            .quarantined
            .iter()
            .map(|(name, _)| name.to_string())
            .collect(),
    );
    metrics.set_quarantined_services(outcome.quarantined.len());
    metrics.set_address_conflicts(synced.address_conflicts);
    metrics.observe_sync(&FAMILIES, synced.kind, outcome.duration);
    metrics.set_last_sync_timestamp(&FAMILIES, now);
    if outcome.report.messages > 0 {
        metrics.observe_transaction(outcome.report.messages, outcome.report.bytes);
    }
    for &f in &outcome.drift_families {
        tracing::warn!("our {f} table had been changed by someone else; repaired");
        metrics.inc_drift_repairs(f);
    }
    // nodeproxy programs both families in every sync, so each change is counted for each family,
    // as a dual-stack kube-proxy's two proxiers would (see `metrics`).
    for f in FAMILIES {
        metrics.add_service_changes(f, changes.services);
        metrics.add_endpoint_changes(f, changes.endpoint_slices);
    }
    // A Service with a trigger time had a slice changed, so the synced state has its slices
    // whether it was whole or scoped.
    let mut families: BTreeMap<&ServiceName, BTreeSet<IpFamily>> = BTreeMap::new();
    if !changes.trigger_times.is_empty() {
        for s in synced.state.slices.values() {
            if changes.trigger_times.contains_key(&s.service) {
                families.entry(&s.service).or_default().insert(s.family);
            }
        }
    }
    for (svc, times) in &changes.trigger_times {
        let Some(families) = families.get(svc) else {
            continue;
        };
        for t in times {
            let Ok(latency) = now.duration_since(*t) else {
                continue;
            };
            for &f in families {
                metrics.observe_network_programming(f, latency);
            }
        }
    }
    for &(f, internal, external) in &synced.no_local {
        metrics.set_no_local_endpoints(f, PolicyKind::Internal, internal);
        metrics.set_no_local_endpoints(f, PolicyKind::External, external);
    }
    for &(f, n) in &synced.conntrack_deleted {
        metrics.add_conntrack_deleted(f, n as u64);
    }
}
