//! The one-shot modes `main` dispatches to besides the daemon: `--dry-run`, `--once`,
//! `--cleanup`, `explain` and `diff`, and the input they share (files or one read of the API
//! server, checked and reported the same way for all of them).

use std::io::{self, Write as _};
use std::time::Instant;

use crate::config::{self, ConfigError, Loaded, TableOwnership};
use crate::daemon::{self, DaemonError};
use crate::explain;
use crate::lock::{self, LockError};
use crate::model::{ClusterState, IpFamily};
use crate::nft::owner::{self, Holder, Ownership, describe_owner};
use crate::nft::{self, Kernel as _, NetlinkKernel, NftError};
use crate::ruleset::eval::EvalError;
use crate::ruleset::{self, Settings};
use crate::source::SourceError;
use crate::sync;

/// Why a one-shot mode failed. [`ModeError::is_usage`] tells the operator's mistakes (exit 2)
/// from runtime failures (exit 1).
#[derive(Debug, thiserror::Error)]
pub enum ModeError {
    #[error("reading the API server")]
    Api(#[source] DaemonError),
    #[error(transparent)]
    Input(SourceError),
    #[error(
        "found no usable Service in {from}{rejected}: refusing to program a ruleset without any, \
         which would remove every Service rule; pass --allow-empty if that is what you want"
    )]
    Empty {
        from: &'static str,
        rejected: String,
    },
    #[error(transparent)]
    Config(ConfigError),
    #[error(transparent)]
    Lock(LockError),
    #[error("{context}")]
    Kernel {
        context: &'static str,
        #[source]
        source: NftError,
    },
    #[error("the kernel rejected {} Service(s), left out of the ruleset: {}", .0.len(), .0.join(", "))]
    Quarantined(Vec<String>),
    #[error(
        "not removing nodeproxy's tables, nothing was deleted: {0}. Stop that process first (a \
         nodeproxy leaves its tables in place, unowned), then run --cleanup again"
    )]
    CleanupRefused(String),
    #[error(transparent)]
    Explain(EvalError),
    #[error("writing the output")]
    Output(#[source] io::Error),
    #[error("the node set-up is incomplete: {}", .0.join("; "))]
    NodeSetup(Vec<String>),
}

impl ModeError {
    /// Whether the operator has to fix the input, the configuration or the way to reach the API
    /// server (exit 2), as opposed to a runtime failure (exit 1).
    pub fn is_usage(&self) -> bool {
        match self {
            ModeError::Api(e) => e.is_usage(),
            ModeError::Input(_) | ModeError::Empty { .. } | ModeError::Config(_) => true,
            _ => false,
        }
    }
}

fn kernel_err(context: &'static str) -> impl FnOnce(NftError) -> ModeError {
    move |source| ModeError::Kernel { context, source }
}

/// `--dry-run`: prints the ruleset the input asks for, as a fresh kernel would get it.
pub fn dry_run(loaded: &Loaded) -> Result<(), ModeError> {
    let (state, settings) = desired_inputs(loaded)?;
    let started = Instant::now();
    let desired = ruleset::build(&state, &settings);
    tracing::debug!(
        "built the ruleset in {:.1} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    let mut out = io::stdout().lock();
    writeln!(
        out,
        "# nodeproxy ruleset for node {:?}: load with `nft -f`, inspect with `nft list table ip nodeproxy`",
        settings.node_name
    )
    .and_then(|()| out.write_all(ruleset::render::render(&desired).as_bytes()))
    .map_err(ModeError::Output)
}

/// `explain`: the path of one packet through exactly the ruleset `--dry-run` prints.
pub fn explain(loaded: &Loaded, query: &explain::Query) -> Result<(), ModeError> {
    let (state, settings) = desired_inputs(loaded)?;
    let desired = ruleset::build(&state, &settings);
    let node_addrs = explain::node_addresses(&state, &settings.node_name);
    if node_addrs.is_empty() {
        tracing::warn!(
            "node {:?} has no addresses in the input: no destination counts as local",
            settings.node_name
        );
    }
    let text = explain::report(
        &desired,
        query,
        &settings.node_name,
        &node_addrs,
        &settings.cluster_cidrs,
    )
    .map_err(ModeError::Explain)?;
    io::stdout()
        .lock()
        .write_all(text.as_bytes())
        .map_err(ModeError::Output)
}

/// `--once`: takes the node lock, then programs the kernel once through the daemon's apply path
/// (`sync::once`). Services the kernel rejects are left out and make it fail after the rest is
/// programmed.
pub fn once(loaded: &Loaded) -> Result<(), ModeError> {
    let config = &loaded.config;
    // Before reading anything: a second writer is refused with the daemon's message whatever
    // the kernel's support for table ownership.
    let lock = lock::acquire(&config.lock_file).map_err(ModeError::Lock)?;
    tracing::debug!(lock = %lock.path().display(), "took the node lock");
    let (state, mut settings) = desired_inputs(loaded)?;
    let mut kernel = NetlinkKernel::new().map_err(kernel_err("opening the netlink socket"))?;
    // Owned while we run, and left persistent: the daemon can take the tables over later, which
    // it could not do with tables created without persist.
    let ownership = match config.table_ownership {
        TableOwnership::Auto => nft::probe::probe_ownership(&mut kernel).map_err(kernel_err(
            "probing the kernel for nftables table ownership",
        ))?,
        TableOwnership::Off => Ownership::Off,
    };
    tracing::info!("{ownership}");
    if config.table_ownership == TableOwnership::Off {
        let name = ruleset::names::TABLE;
        let persisted = owner::persisted(&mut kernel, name);
        if let Some(warning) = owner::persisted_warning(&persisted, name) {
            tracing::warn!("{warning}");
        }
    }
    settings.own_tables = ownership.enabled();
    // After a rejection the input is read again for the retry without the rejected Services:
    // the first attempt drops it to make room for lowering the ruleset.
    let reload = || desired_inputs(loaded).map(|(state, _)| state);
    let outcome = sync::once(kernel, state, &settings, reload)?;
    tracing::info!("{outcome}; peak RSS {} KiB", peak_rss_kib());
    drop(lock);
    if outcome.quarantined.is_empty() {
        Ok(())
    } else {
        // The rest is programmed, as the daemon would have it; the exit status says that not
        // everything asked for is in the kernel.
        let names = outcome
            .quarantined
            .iter()
            .map(|(name, _)| name.to_string())
            .collect();
        Err(ModeError::Quarantined(names))
    }
}

/// What `diff` found; `main` turns it into diff(1)'s exit status (0 same, 1 different).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiffOutcome {
    /// The kernel's tables are what a sync would program.
    Unchanged,
    /// A sync would change something (printed).
    Changed,
}

/// `diff`: prints what a sync of the input would change in our tables, per Service, and
/// changes nothing. It runs `--once`'s sync (read back, build, lower, diff) against a kernel
/// that only reads: only dumps reach the real one.
///
/// It takes no node lock: it writes nothing, and it is meant to run beside the daemon that
/// holds the lock (checking an upgrade or a configuration change before it happens). What the
/// kernel would refuse cannot be known without sending it, so a Service that `--once` would
/// quarantine is shown as a change like any other.
pub fn diff(loaded: &Loaded) -> Result<DiffOutcome, ModeError> {
    // `own_tables` stays off: ownership belongs to the process that runs, not to the content,
    // and a table another process owns (or left as an orphan) then needs no flag update.
    let (state, settings) = desired_inputs(loaded)?;
    let kernel = NetlinkKernel::new().map_err(kernel_err("opening the netlink socket"))?;
    let mut preview = nft::preview::Preview::new(kernel);
    // Nothing is sent, so nothing is rejected and the input is never read a second time.
    let reload = || {
        desired_inputs(loaded)
            .map(|(state, _)| state)
            .map_err(Previewing)
    };
    sync::once(&mut preview, state, &settings, reload).map_err(|Previewing(e)| e)?;
    let report = preview.into_report();
    io::stdout()
        .lock()
        .write_all(report.render().as_bytes())
        .map_err(ModeError::Output)?;
    Ok(if report.is_empty() {
        DiffOutcome::Unchanged
    } else {
        DiffOutcome::Changed
    })
}

/// A failure of `diff`'s sync: a kernel error there comes from reading our tables (or lowering
/// the ruleset), never from programming, and says so.
struct Previewing(ModeError);

impl From<NftError> for Previewing {
    fn from(source: NftError) -> Previewing {
        Previewing(ModeError::Kernel {
            context: "comparing the ruleset with the kernel's tables",
            source,
        })
    }
}

impl From<NftError> for ModeError {
    fn from(source: NftError) -> ModeError {
        ModeError::Kernel {
            context: "programming the kernel",
            source,
        }
    }
}

/// `--init-only`: the privileged node set-up, as kube-proxy's: the conntrack settings (and the
/// OOM score), then exit. Any sysctl the kernel refused fails the run, since doing them is this
/// mode's whole job (a privileged init container that cannot is misconfigured).
pub fn init_only(config: &config::Config) -> Result<(), ModeError> {
    let report = crate::node_setup::set_up_host(&config.conntrack(), config.oom_score_adj);
    if report.warnings.is_empty() {
        tracing::info!(changed = report.changes.len(), "node set-up done");
        Ok(())
    } else {
        Err(ModeError::NodeSetup(
            report.warnings.iter().map(ToString::to_string).collect(),
        ))
    }
}

/// `--cleanup`: deletes our tables, both families in one transaction. Takes the node lock first,
/// like every mode that writes to the kernel, and refuses, deleting nothing, while another
/// process holds it or owns the tables (nftables table ownership, kernel 6.9+).
pub fn cleanup(config: &config::Config) -> Result<(), ModeError> {
    let name = ruleset::names::TABLE;
    let lock = match lock::acquire(&config.lock_file) {
        Ok(guard) => Ok(guard),
        Err(held @ LockError::Held { .. }) => Err(held),
        Err(other) => return Err(ModeError::Lock(other)),
    };
    let mut kernel = NetlinkKernel::new().map_err(kernel_err("opening the netlink socket"))?;
    let mut reasons = Vec::new();
    for family in IpFamily::ALL {
        let info = kernel
            .table_info(family, name)
            .map_err(kernel_err("reading nodeproxy's tables"))?;
        if let Some(Holder::Other(port)) = info.map(|i| i.holder(kernel.port_id())) {
            reasons.push(format!(
                "table {} {name} is owned by {}",
                nft::wire::family_keyword(family),
                describe_owner(port)
            ));
        }
    }
    if let Err(held) = &lock {
        reasons.push(held.to_string());
    }
    if !reasons.is_empty() {
        return Err(ModeError::CleanupRefused(reasons.join("; ")));
    }
    let removed = kernel
        .delete_tables(name)
        .map_err(kernel_err("removing nodeproxy's tables"))?;
    // The seal describes the tables just removed: it goes with them (a later start would not
    // trust it, since the generation moved, but it would be left behind).
    kernel
        .delete_tables(nft::SEAL_TABLE)
        .map_err(kernel_err("removing nodeproxy's seal"))?;
    tracing::info!("removed {removed} nodeproxy table(s); nothing else was touched");
    drop(lock);
    Ok(())
}

/// Loads the cluster objects and resolves the settings the ruleset is built with, reporting
/// every rejected or ignored object and every likely configuration mistake.
pub fn desired_inputs(options: &Loaded) -> Result<(ClusterState, Settings), ModeError> {
    let config = &options.config;
    let started = Instant::now();
    let (loaded, from) = if config.from_file.is_empty() {
        // No files: the API server, read once through the same watches the daemon uses.
        (
            daemon::fetch(config).map_err(ModeError::Api)?,
            "the API server",
        )
    } else {
        let loaded =
            crate::source::file::load_files_limited(&config.from_file, options.max_input_bytes)
                .map_err(ModeError::Input)?;
        (loaded, "the input files")
    };
    tracing::info!(
        "read {} service(s), {} endpoint slice(s), {} node(s) from {from} in {:.1} ms ({} rejected, {} ignored)",
        loaded.state.services.len(),
        loaded.state.slices.len(),
        loaded.state.nodes.len(),
        started.elapsed().as_secs_f64() * 1e3,
        loaded.rejected.len(),
        loaded.ignored.len()
    );
    for rejected in &loaded.rejected {
        tracing::warn!("skipped invalid object: {rejected}");
    }
    for ignored in &loaded.ignored {
        tracing::debug!("ignored: {ignored}");
    }
    for dropped in &loaded.dropped {
        tracing::warn!("{dropped}");
    }
    for replaced in &loaded.replaced {
        tracing::warn!("{replaced}");
    }
    if loaded.state.services.is_empty() && !options.allow_empty {
        // An empty file is what a failed `kubectl get > file` leaves behind; programming it
        // would delete every Service rule on the node.
        let rejected = if loaded.rejected.is_empty() {
            String::new()
        } else {
            format!(" ({} object(s) rejected)", loaded.rejected.len())
        };
        return Err(ModeError::Empty { from, rejected });
    }
    let node_name = config.node_name().map_err(ModeError::Config)?;
    let settings = Settings::new(config, node_name);
    let cluster_ips: Vec<_> = loaded
        .state
        .services
        .values()
        .flat_map(|s| s.cluster_ips.iter().map(|ip| (&s.name, *ip)))
        .collect();
    for warning in config::overlapping_cluster_cidr(config, &cluster_ips) {
        tracing::warn!("{warning}");
    }
    for warning in ruleset::diagnostics(&loaded.state, &settings) {
        tracing::warn!("{warning}");
    }
    Ok((loaded.state, settings))
}

/// Peak resident set size of this process, for the figures `--once` reports.
fn peak_rss_kib() -> i64 {
    nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
        .map(|usage| usage.max_rss())
        .unwrap_or(0)
}
