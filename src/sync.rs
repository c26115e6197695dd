//! The single writer: turns a cluster state into kernel transactions, remembering what it
//! applied, and quarantines Services whose objects the kernel rejects so that one bad Service
//! never blocks the others (upstream fails the whole sync, kubernetes#122611).
//!
//! Steady state diffs the desired tables against what was last applied, in memory: reading a
//! 10k-service table back costs far more than the change itself (the kernel's set dump restarts
//! its hash walk for every netlink message). The kernel is read back on the first sync, after any
//! failure, and on periodic verification, which is how drift (someone flushing or editing our
//! table) is found and repaired.
//!
//! `sync` builds from the whole state; `sync_changed` (in `incremental`) rebuilds only the
//! Services that changed and patches what was applied, falling back to `sync` whenever it
//! cannot prove the result equals a full build.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::{Duration, Instant};

use crate::model::{ClusterState, EndpointSlice, IpFamily, Service, ServiceName};
use crate::nft::{self, Kernel, NftError, RejectedOp, ReplyKind, WireTable};
use crate::ruleset::{self, Settings};

mod incremental;
pub mod seal;

pub use incremental::Incremental;
use seal::Seal;

/// How many times one sync rebuilds after quarantining: each round must quarantine at least one
/// more Service, so this bounds the work when many Services fail at once.
const MAX_QUARANTINE_ROUNDS: usize = 8;

/// A Service excluded from the ruleset because the kernel rejected an object built for it, with
/// what it looked like then: it is retried as soon as it (or its endpoints) change.
#[derive(Debug, Clone)]
struct Quarantined {
    service: Option<Service>,
    slices: Vec<EndpointSlice>,
    reason: String,
}

/// What the kernel refused of a quarantined Service: what the Service's owner is told (in an
/// Event), so it names the object and the kernel's own words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// `add element`, `add chain`, …
    pub op: &'static str,
    /// `element 10.96.0.10 . tcp . 80 : goto pick-1 in map service-ips of table ip nodeproxy`
    pub object: String,
    /// The kernel's error, with its extended ack message when it sent one.
    pub error: String,
}

impl Rejection {
    fn of(e: &RejectedOp) -> Rejection {
        Rejection {
            op: e.op,
            object: e.object.clone(),
            error: match &e.ext_ack {
                Some(m) => format!("{}: {m}", e.errno),
                None => e.errno.to_string(),
            },
        }
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.op, self.object, self.error)
    }
}

/// What one sync did.
#[derive(Debug, Clone, Default)]
pub struct SyncOutcome {
    pub report: nft::SyncReport,
    /// Whether the kernel was read back (first sync, after a failure, or verification).
    pub full: bool,
    /// Objects found in the kernel that differed from what was last applied (only known on a
    /// verification pass): someone else changed our table.
    pub drift_repaired: bool,
    /// The families whose tables were found changed and repaired (see `drift_repaired`).
    pub drift_families: Vec<IpFamily>,
    /// Services excluded from the ruleset, with the kernel's reason.
    pub quarantined: Vec<(ServiceName, String)>,
    /// Services quarantined since the last outcome that reported any (again, for one released
    /// and then refused anew), with what the kernel refused: a sync that fails after
    /// quarantining leaves them to the next successful one.
    pub newly_quarantined: Vec<(ServiceName, Rejection)>,
    /// Services that an earlier outcome reported quarantined and that are programmed now (a
    /// deleted Service is not listed: there is nobody left to tell).
    pub released: Vec<ServiceName>,
    pub duration: Duration,
}

impl fmt::Display for SyncOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} sync in {:.1} ms: {}",
            if self.full { "full" } else { "partial" },
            self.duration.as_secs_f64() * 1e3,
            self.report
        )?;
        if self.drift_repaired {
            write!(f, "; repaired changes made to our table by someone else")?;
        }
        if !self.quarantined.is_empty() {
            write!(f, "; {} Service(s) quarantined", self.quarantined.len())?;
        }
        Ok(())
    }
}

/// Owns the kernel handle; only this type writes to the kernel.
pub struct Syncer<K: Kernel> {
    kernel: K,
    /// What the kernel holds, as far as we know, per family. Empty = unknown: read it back.
    applied: BTreeMap<IpFamily, Option<WireTable>>,
    quarantine: BTreeMap<ServiceName, Quarantined>,
    /// What the last full sync was built from, and how `applied` uses its objects and which
    /// origins each Service's elements carry: what `sync_changed` needs. `None` until a full
    /// sync succeeds, and after any failure.
    baseline: Option<incremental::Baseline>,
    /// The nftables generation at which `applied` is known to be exactly what the kernel holds:
    /// set when a sync starts by reading everything back, carried through each of our own
    /// transactions, dropped when anyone else may have committed in between (see
    /// [`Syncer::kernel_unchanged`]).
    trusted_generation: Option<u32>,
    /// The previous process's seal, checked against the kernel's boot and generation at the
    /// start of the sync in progress: its tables may be adopted without reading their elements
    /// (see [`seal`]). Only for that sync.
    adoption: Option<Seal>,
    /// The salt and digest ([`seal::digest`]) of `applied`'s table of a family, when the sync
    /// that applied it adopted on a seal and so hashed it already, or hashed it while the
    /// kernel applied it ([`Syncer::hashes_while_sending`]): [`Syncer::seal`] writes them
    /// instead of hashing every element again (~3 % of a `--once` re-apply's instructions at
    /// 10k Services). Cleared when any sync starts.
    digests: Vec<(IpFamily, u64, u64)>,
    /// Whether a table sent to the kernel is hashed for [`Syncer::seal`] on a second thread
    /// while the kernel applies it: for a process that seals right after its sync ([`once`]),
    /// whose sending thread waits for the kernel meanwhile (~150 ms of a cold sync at 10k
    /// Services; the hash is ~13 ms of work).
    hashes_while_sending: bool,
    /// Whether this syncer has started a sync before: only its first may adopt on a seal, since
    /// after that a seal written before it started no longer describes what it believes it
    /// applied (and a verification must read back).
    synced_before: bool,
    /// What the kernel rejected since [`Syncer::take_rejections`] was last called, one kind per
    /// operation: full and incremental syncs, including rejections a retry or a quarantine
    /// then resolved.
    rejected: Vec<ReplyKind>,
    /// Whether a full sync records the [`incremental::Baseline`] later change syncs need; a
    /// process that syncs once ([`once`]) does not pay for it.
    keeps_baseline: bool,
    /// Quarantined since the last outcome reported it: [`SyncOutcome::newly_quarantined`].
    fresh: BTreeMap<ServiceName, Rejection>,
    /// The quarantine as the last outcome reported it: whoever has left it since (and still
    /// exists) was released.
    reported: BTreeSet<ServiceName>,
}

/// Frees `value` on a thread of its own, which nothing waits for: freeing the tables applied
/// at 10k Services (hundreds of thousands of small allocations) takes ~10 ms that `--once` then
/// spends exiting instead (a process that exits first leaves the rest to the kernel; nothing in
/// them has an effect when dropped). If no thread can be started, `value` is freed here, with
/// the closure that holds it.
fn drop_later<T: Send + 'static>(value: T) {
    let _ = std::thread::Builder::new()
        .name("nodeproxy-free".into())
        .spawn(move || drop(value));
}

/// `--once`: one sync of `state` from what the kernel holds (read back), through the daemon's
/// apply path. The state is dropped as soon as the ruleset is built: lowering a large ruleset needs
/// that memory, and a one-shot process has no later sync to keep it for. A Service whose objects
/// the kernel rejects is quarantined as the daemon would: left out, warned about, and listed in
/// the outcome; the state for that retry comes from `reload`.
pub fn once<K: Kernel, E: From<NftError>>(
    kernel: K,
    state: ClusterState,
    settings: &Settings,
    mut reload: impl FnMut() -> Result<ClusterState, E>,
) -> Result<SyncOutcome, E> {
    let started = Instant::now();
    let mut syncer = Syncer::new(kernel);
    syncer.keeps_baseline = false;
    syncer.hashes_while_sending = true;
    let mut state = Some(state);
    let mut rounds = 0;
    loop {
        let mut outcome = SyncOutcome::default();
        syncer.start_generation_chain(true)?;
        syncer.prepare_adoption()?;
        let loaded = match state.take() {
            Some(state) => state,
            None => reload()?,
        };
        let effective = if syncer.quarantine.is_empty() {
            loaded
        } else {
            without(&loaded, |name| syncer.quarantine.contains_key(name))
        };
        let desired = ruleset::build(&effective, settings);
        // Freed here, not later: at 50k x 5, freeing it on another thread while lowering
        // allocates may raise the peak RSS (183-191 against 169-181 MiB, four noisy runs each).
        drop(effective);
        let applied = syncer.apply(desired, true, &mut outcome);
        syncer.adoption = None;
        match applied {
            Ok(()) => {
                // For the next process (the daemon, or `--once` again): a failure to seal
                // only costs that process a full read-back.
                let t = Instant::now();
                match syncer.seal() {
                    Ok(sealed) => tracing::debug!(
                        sealed,
                        ms = format!("{:.1}", t.elapsed().as_secs_f64() * 1e3),
                        "sealed our tables for the next start"
                    ),
                    Err(e) => tracing::warn!(
                        "could not seal our tables for the next start (it will read them back): {}",
                        crate::report::chain(&e)
                    ),
                }
                outcome.quarantined = syncer.quarantined();
                syncer.report_quarantine_changes(&mut outcome);
                // The kernel handle closes here, as the caller expects; the tables need not.
                drop_later(std::mem::take(&mut syncer.applied));
                outcome.duration = started.elapsed();
                return Ok(outcome);
            }
            Err(NftError::Rejected { errors }) => {
                syncer.note_rejected(&errors);
                // The state was dropped after the build; the retry reloads it.
                let added = syncer.quarantine_rejected(&errors, None);
                rounds += 1;
                if !added || rounds >= MAX_QUARANTINE_ROUNDS {
                    return Err(NftError::Rejected { errors }.into());
                }
            }
            Err(other) => return Err(other.into()),
        }
    }
}

impl<K: Kernel> Syncer<K> {
    pub fn new(kernel: K) -> Syncer<K> {
        Syncer {
            kernel,
            applied: BTreeMap::new(),
            quarantine: BTreeMap::new(),
            baseline: None,
            trusted_generation: None,
            adoption: None,
            digests: Vec::new(),
            hashes_while_sending: false,
            synced_before: false,
            rejected: Vec::new(),
            keeps_baseline: true,
            fresh: BTreeMap::new(),
            reported: BTreeSet::new(),
        }
    }

    pub fn kernel(&mut self) -> &mut K {
        &mut self.kernel
    }

    /// The kinds of the operations the kernel rejected since the last call (for
    /// `nodeproxy_kernel_rejections_total`).
    pub fn take_rejections(&mut self) -> Vec<ReplyKind> {
        std::mem::take(&mut self.rejected)
    }

    fn note_rejected(&mut self, errors: &[RejectedOp]) {
        self.rejected.extend(errors.iter().map(RejectedOp::kind));
    }

    /// Quarantines the Services the kernel's `errors` name that are not quarantined yet, recording
    /// what they looked like in `state` (when the caller still has it) so that a change releases
    /// them. Returns whether any was added: a rejection that names no new Service cannot be
    /// resolved by quarantining.
    fn quarantine_rejected(&mut self, errors: &[RejectedOp], state: Option<&ClusterState>) -> bool {
        let mut added = false;
        for e in errors {
            let Some(origin) = &e.origin else { continue };
            let name = origin.service.clone();
            if self.quarantine.contains_key(&name) {
                continue;
            }
            tracing::warn!(
                "quarantining Service {name}: the kernel rejected {} {}: {}; it is left out of \
                 the ruleset until it changes",
                e.op,
                e.object,
                e.errno
            );
            let quarantined = Quarantined {
                service: state.and_then(|s| s.services.get(&name).cloned()),
                slices: state
                    .map(|s| {
                        s.slices
                            .values()
                            .filter(|sl| sl.service == name)
                            .cloned()
                            .collect()
                    })
                    .unwrap_or_default(),
                reason: e.to_string(),
            };
            self.fresh.insert(name.clone(), Rejection::of(e));
            self.quarantine.insert(name, quarantined);
            added = true;
        }
        added
    }

    /// Moves the quarantines and releases not reported yet into `outcome`.
    fn report_quarantine_changes(&mut self, outcome: &mut SyncOutcome) {
        if self.fresh.is_empty() && self.reported.is_empty() && self.quarantine.is_empty() {
            return;
        }
        let quarantine = &self.quarantine;
        outcome.newly_quarantined = std::mem::take(&mut self.fresh)
            .into_iter()
            .filter(|(name, _)| quarantine.contains_key(name))
            .collect();
        outcome.released = self
            .reported
            .iter()
            .filter(|name| !quarantine.contains_key(*name))
            .cloned()
            .collect();
        self.reported = quarantine.keys().cloned().collect();
    }

    /// Takes `name` out of quarantine; `exists` says whether the Service is still there to be
    /// reported as released.
    fn release(&mut self, name: &ServiceName, exists: bool) {
        tracing::info!("Service {name} changed: retrying it after quarantine");
        self.quarantine.remove(name);
        if !exists {
            self.reported.remove(name);
            self.fresh.remove(name);
        }
    }

    /// Services currently excluded, with the reason.
    pub fn quarantined(&self) -> Vec<(ServiceName, String)> {
        self.quarantine
            .iter()
            .map(|(name, q)| (name.clone(), q.reason.clone()))
            .collect()
    }

    /// Brings the kernel to the ruleset of `state`. With `verify`, reads our tables back first
    /// (and repairs whatever differs) instead of trusting the last applied state.
    pub fn sync(
        &mut self,
        state: &ClusterState,
        settings: &Settings,
        verify: bool,
    ) -> Result<SyncOutcome, NftError> {
        let started = Instant::now();
        self.baseline = None;
        self.digests.clear();
        self.release_changed(state);
        let mut outcome = SyncOutcome::default();
        self.start_generation_chain(verify)?;
        self.prepare_adoption()?;
        let result = self.sync_rounds(state, settings, verify, &mut outcome);
        self.adoption = None;
        let (contested, chains) = result?;
        if self.keeps_baseline {
            self.baseline =
                incremental::Baseline::new(&self.applied, settings, &state.nodes, contested)
                    .map(|b| b.with_claims(&state.services).with_chains(chains));
        }
        outcome.quarantined = self.quarantined();
        self.report_quarantine_changes(&mut outcome);
        outcome.duration = started.elapsed();
        Ok(outcome)
    }

    /// Builds and applies until the kernel accepts, quarantining what it refuses.
    fn sync_rounds(
        &mut self,
        state: &ClusterState,
        settings: &Settings,
        verify: bool,
        outcome: &mut SyncOutcome,
    ) -> Result<(ruleset::Contested, incremental::BuiltChains), NftError> {
        let mut rounds = 0;
        let mut verify = verify;
        let mut confirmed = false;
        loop {
            let filtered;
            let effective = if self.quarantine.is_empty() {
                state
            } else {
                filtered = without(state, |name| self.quarantine.contains_key(name));
                &filtered
            };
            let (desired, contested) = ruleset::build_noting_contested(effective, settings);
            // The chains as built, for the change syncs to compare theirs with before lowering.
            let chains = if self.keeps_baseline {
                incremental::BuiltChains::of(&desired)
            } else {
                incremental::BuiltChains::default()
            };
            match self.apply(desired, verify, outcome) {
                Ok(()) => return Ok((contested, chains)),
                Err(NftError::Rejected { errors }) => {
                    self.note_rejected(&errors);
                    // The transaction was rolled back, so what the kernel holds is the last
                    // applied state, but that state may itself be unknown now: read it again.
                    self.applied.clear();
                    // A rejection can come from a stale view of the kernel (someone changed our
                    // table, or a read-back missed elements) rather than from a Service: retry
                    // once against a fresh read-back before blaming any Service.
                    if !confirmed {
                        confirmed = true;
                        verify = true;
                        // Fresh means everything read, the elements too: a seal is no
                        // witness against a view the kernel just refused.
                        self.adoption = None;
                        self.start_generation_chain(true)?;
                        *outcome = SyncOutcome::default();
                        continue;
                    }
                    let added = self.quarantine_rejected(&errors, Some(state));
                    rounds += 1;
                    if !added || rounds >= MAX_QUARANTINE_ROUNDS {
                        // Nothing attributable to a Service (a base object failed): there is
                        // no one to quarantine, so the whole sync fails and is retried.
                        return Err(NftError::Rejected { errors });
                    }
                }
                Err(other) => {
                    self.applied.clear();
                    self.trusted_generation = None;
                    return Err(other);
                }
            }
        }
    }

    fn apply(
        &mut self,
        desired: ruleset::Ruleset,
        verify: bool,
        outcome: &mut SyncOutcome,
    ) -> Result<(), NftError> {
        let rep = &mut outcome.report;
        for table in desired.tables {
            let family = table.family;
            let name = table.name.clone();
            self.digests.retain(|(f, _, _)| *f != family);
            let t = Instant::now();
            let mut want = nft::lower_owned(table)?;
            rep.lower += t.elapsed();
            // Drift is a difference from what this process itself applied and still trusts; a
            // difference found on start-up or after a failure is not someone else's doing.
            let trusted = matches!(self.applied.get(&family), Some(Some(_)));
            let known = if verify {
                None
            } else {
                self.applied.remove(&family)
            };
            let (have, adopted) = match known {
                Some(have) => (have, false),
                None => {
                    outcome.full = true;
                    let t = Instant::now();
                    let read = self.read_back(family, &name, &want, rep)?;
                    rep.read += t.elapsed();
                    read
                }
            };
            // The sizes follow what the kernel holds (hysteresis): see `nft::size_sets`.
            nft::size_sets(&mut want, have.as_ref());
            let t = Instant::now();
            // Someone else's change is a difference between the kernel and what we last
            // applied, not one from what we want now: a verification that falls due while
            // changes keep coming carries those changes too. (An adopted table's elements are
            // the sealed ones, ours; only a first sync adopts, which trusts nothing yet.)
            let drifted = !adopted
                && verify
                && trusted
                && self
                    .applied
                    .get(&family)
                    .and_then(Option::as_ref)
                    .is_some_and(|applied| !nft::diff(have.as_ref(), applied).is_empty());
            rep.diff += t.elapsed();
            let sent = match have {
                Some(defs) if adopted => self.apply_adopted(family, &name, defs, &mut want, rep)?,
                have => {
                    let salt = self.hashes_while_sending.then(|| self.seal_salt());
                    let kernel = &mut self.kernel;
                    let want = &want;
                    let (sent, digest) = std::thread::scope(|s| {
                        let hashing = salt.and_then(|salt| {
                            std::thread::Builder::new()
                                .spawn_scoped(s, move || (salt, seal::digest(want, salt)))
                                .ok()
                        });
                        let sent = nft::apply_diff(kernel, have.as_ref(), want, rep);
                        (sent, hashing.and_then(|h| h.join().ok()))
                    });
                    let sent = sent?;
                    // Without a thread, or if it failed, the seal hashes the table itself.
                    if let Some((salt, digest)) = digest {
                        self.digests.push((family, salt, digest));
                    }
                    sent
                }
            };
            if let Some(st) = sent {
                if drifted {
                    outcome.drift_repaired = true;
                    outcome.drift_families.push(family);
                }
                self.continue_generation_chain(st.generation);
            }
            self.applied.insert(family, Some(want));
        }
        Ok(())
    }

    /// The salt a table hashed while it is sent is hashed with: the seal's being adopted, so that
    /// a table adopted on it and one sent are sealed together, else the one a table sent before
    /// in this sync was hashed with, else a fresh one.
    fn seal_salt(&self) -> u64 {
        self.adoption
            .as_ref()
            .map(|a| a.salt)
            .or_else(|| self.digests.first().map(|(_, salt, _)| *salt))
            .unwrap_or_else(seal::fresh_salt)
    }

    /// Reads our table of `family` back: without its elements when the sync adopts on a seal
    /// that still holds and `want`'s elements are the sealed ones (`true`: the kernel's
    /// elements are then `want`'s, and [`Syncer::apply_adopted`] applies it), everything
    /// otherwise.
    fn read_back(
        &mut self,
        family: IpFamily,
        name: &str,
        want: &WireTable,
        rep: &mut nft::SyncReport,
    ) -> Result<(Option<WireTable>, bool), NftError> {
        let sealed = self
            .adoption
            .as_ref()
            .and_then(|s| Some((s.salt, s.digest(family)?)));
        if let (Some((salt, sealed)), Some(trusted)) = (sealed, self.trusted_generation)
            // Only our own transactions since the seal was checked (the other family's, in
            // this sync), each of them carried by the chain.
            && self.kernel.generation()? == trusted
            && seal::digest(want, salt) == sealed
            && let Some(have) = self.kernel.read_table_definitions(family, name)?
            && seal::same_sets(&have, want)
        {
            // `want` becomes what is applied, elements unchanged, unless the apply fails (which
            // forgets everything applied, and a seal needs all of it).
            self.digests.push((family, salt, sealed));
            rep.tables_adopted += 1;
            return Ok((Some(have), true));
        }
        Ok((self.kernel.read_table(family, name)?, false))
    }

    /// Applies `want` to an adopted table, `defs` (its definitions as read back; its elements
    /// are `want`'s, by the seal). Compared without the elements on either side, the plan is
    /// the one with them unless it creates a set (new or recreated: it would come back
    /// empty), so only then are `want`'s elements copied into `defs` for the diff. That copy
    /// (and its freeing) was ~15 ms of a re-apply at 10k Services.
    fn apply_adopted(
        &mut self,
        family: IpFamily,
        name: &str,
        mut defs: WireTable,
        want: &mut WireTable,
        rep: &mut nft::SyncReport,
    ) -> Result<Option<nft::ApplyStats>, NftError> {
        let elements = seal::take_elements(want);
        let t = Instant::now();
        let plan = nft::diff(Some(&defs), want);
        let creates = plan.phase1.iter().chain(&plan.phase2).any(|op| {
            matches!(
                op,
                nft::Op::AddSet { .. } | nft::Op::AddElems { .. } | nft::Op::DelElems { .. }
            )
        });
        drop(plan);
        rep.diff += t.elapsed();
        let sent = if creates {
            Ok(None)
        } else {
            nft::apply_diff(&mut self.kernel, Some(&defs), want, rep).map(Some)
        };
        seal::put_elements(want, elements);
        if let Some(sent) = sent.transpose() {
            return sent;
        }
        let have = if seal::fill(&mut defs, want) {
            Some(defs)
        } else {
            self.kernel.read_table(family, name)?
        };
        nft::apply_diff(&mut self.kernel, have.as_ref(), want, rep)
    }

    /// Reads the previous process's seal, for this syncer's first sync: kept for that sync
    /// when it was written in this boot at the generation this process's kernel handle found
    /// when it opened, and everything committed since is this process's own (which, before the
    /// first sync, never touches our tables' elements). See [`seal`].
    fn prepare_adoption(&mut self) -> Result<(), NftError> {
        self.adoption = None;
        if std::mem::replace(&mut self.synced_before, true) || self.trusted_generation.is_none() {
            return Ok(());
        }
        let Some(text) = self.kernel.read_seal()? else {
            return Ok(());
        };
        let Some(found) = Seal::parse(&text) else {
            tracing::info!(
                "the comment of table ip {} is not a seal this version writes; reading our \
                 tables back",
                nft::SEAL_TABLE
            );
            return Ok(());
        };
        let boot = seal::boot_id();
        let opened = self.kernel.generation_at_open()?;
        if boot.as_deref() != Some(found.boot.as_str()) || opened != Some(found.generation) {
            tracing::info!(
                sealed_generation = found.generation,
                generation_at_start = opened,
                same_boot = boot.as_deref() == Some(found.boot.as_str()),
                "the seal the previous process left no longer holds (a commit since, or \
                 another boot); reading our tables back"
            );
            return Ok(());
        }
        self.adoption = Some(found);
        Ok(())
    }

    /// Leaves a seal for the next process (see [`seal`]) when the kernel certainly holds what
    /// this syncer applied; `false` when it may not (nothing is written then) or when someone
    /// else committed while the seal was written (the seal then never matches).
    pub fn seal(&mut self) -> Result<bool, NftError> {
        if !self.kernel_unchanged()? {
            return Ok(false);
        }
        let (Some(boot), Some(now)) = (seal::boot_id(), self.trusted_generation) else {
            return Ok(false);
        };
        let (salt, digests) = match self.known_digests() {
            Some(adopted) => adopted,
            None => {
                let salt = seal::fresh_salt();
                let digests = self
                    .applied
                    .iter()
                    .filter_map(|(f, t)| Some((*f, seal::digest(t.as_ref()?, salt))))
                    .collect();
                (salt, digests)
            }
        };
        // The seal's own transaction moves the generation by one (`nf_tables_commit`); the
        // generation after it is what the next process must find.
        let next = now.wrapping_add(1);
        let Some(text) = (Seal {
            boot,
            generation: next,
            salt,
            digests,
        })
        .render() else {
            return Ok(false);
        };
        self.kernel.write_seal(&text)?;
        let after = self.kernel.generation()?;
        self.trusted_generation = (after == next).then_some(after);
        Ok(after == next)
    }

    /// The salt and the digests of every applied table, when the last sync hashed them all with
    /// one salt (see [`Syncer::digests`]).
    fn known_digests(&self) -> Option<(u64, Vec<(IpFamily, u64)>)> {
        let salt = self.digests.first()?.1;
        let digests = self
            .applied
            .iter()
            .filter(|(_, t)| t.is_some())
            .map(|(family, _)| {
                self.digests
                    .iter()
                    .find(|(f, s, _)| f == family && *s == salt)
                    .map(|(f, _, d)| (*f, *d))
            })
            .collect::<Option<Vec<_>>>()?;
        Some((salt, digests))
    }

    /// Whether the kernel certainly still holds what this syncer last applied: nobody (not
    /// even us) committed an nftables transaction in this network namespace since our last
    /// one. One netlink round trip; periodic verification uses it to skip the read-back of a
    /// table nobody touched (at 10k Services the read-back costs about a second, because the
    /// kernel restarts its set walk for every dump message). `false` whenever in doubt.
    pub fn kernel_unchanged(&mut self) -> Result<bool, NftError> {
        let known = IpFamily::ALL
            .iter()
            .all(|f| matches!(self.applied.get(f), Some(Some(_))));
        let Some(trusted) = self.trusted_generation.filter(|_| known) else {
            return Ok(false);
        };
        Ok(self.kernel.generation()? == trusted)
    }

    /// A sync that reads every table back starts a new chain at the generation before its
    /// reads: whatever anyone committed before is in what it reads. One that trusts `applied`
    /// keeps the chain of our previous transactions.
    fn start_generation_chain(&mut self, verify: bool) -> Result<(), NftError> {
        let reads_all = verify || IpFamily::ALL.iter().all(|f| !self.applied.contains_key(f));
        let reads_some = IpFamily::ALL.iter().any(|f| !self.applied.contains_key(f));
        if reads_all {
            self.trusted_generation = Some(self.kernel.generation()?);
        } else if reads_some {
            self.trusted_generation = None;
        }
        Ok(())
    }

    /// After one of our transactions: the chain holds if the kernel saw nothing but it since
    /// the last link (`generation` is `(before, after)` as `Kernel::apply` reports it).
    fn continue_generation_chain(&mut self, generation: Option<(u32, u32)>) {
        self.trusted_generation = match (self.trusted_generation, generation) {
            (Some(t), Some((before, after))) if t == before => Some(after),
            _ => None,
        };
    }

    /// Releases quarantined Services that changed since: they get another chance.
    fn release_changed(&mut self, state: &ClusterState) {
        let changed: Vec<ServiceName> = self
            .quarantine
            .iter()
            .filter(|(name, q)| !q.unchanged(name, state))
            .map(|(name, _)| name.clone())
            .collect();
        for name in changed {
            self.release(&name, state.services.contains_key(&name));
        }
    }
}

impl Quarantined {
    /// Whether Service `name` (and its slices) in `state` is still what was quarantined.
    fn unchanged(&self, name: &ServiceName, state: &ClusterState) -> bool {
        let service = state.services.get(name);
        let slices: Vec<&EndpointSlice> = state
            .slices
            .values()
            .filter(|s| &s.service == name)
            .collect();
        service == self.service.as_ref()
            && slices.len() == self.slices.len()
            && slices.iter().zip(&self.slices).all(|(a, b)| *a == b)
    }
}

/// The state without the `excluded` Services (and their slices). Only built while some Service
/// is quarantined, which is rare.
fn without(state: &ClusterState, excluded: impl Fn(&ServiceName) -> bool) -> ClusterState {
    ClusterState {
        services: state
            .services
            .iter()
            .filter(|(name, _)| !excluded(name))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        slices: state
            .slices
            .iter()
            .filter(|(_, s)| !excluded(&s.service))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        nodes: state.nodes.clone(),
        service_cidrs: state.service_cidrs.clone(),
    }
}

#[cfg(test)]
pub(crate) mod tests;
