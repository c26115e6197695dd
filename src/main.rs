//! Entry point: parse the configuration, set up logging, run the chosen mode, map errors to exit
//! codes (0 ok, 1 runtime failure, 2 usage or configuration error).

use std::io::{IsTerminal as _, Write as _};
use std::process::ExitCode;

use anyhow::Context as _;
use nodeproxy::config::{self, ConfigError, LogFormat, Mode};
use nodeproxy::model::ClusterState;
use nodeproxy::nft::{self, Kernel as _};
use nodeproxy::ruleset::{self, Settings};
use nodeproxy::source;

/// jemalloc instead of glibc's malloc: it hands freed pages back to the OS (after the decay
/// set in `.cargo/config.toml`), so the daemon's resident memory follows its live heap. With
/// glibc the start-up sync's peak stayed resident: VmRSS 193 MiB under churn at 10k Services ×
/// 10 endpoints, against 77 MiB with jemalloc (docs/performance.md).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Errors that are the operator's to fix in the input or configuration (exit 2), as opposed to
/// runtime failures (exit 1).
#[derive(Debug)]
struct UsageError(anyhow::Error);

fn main() -> ExitCode {
    let env = |name: &str| std::env::var(name).ok();
    let loaded = match config::load(std::env::args_os(), &env) {
        Ok(loaded) => loaded,
        Err(ConfigError::HelpOrVersion(text)) => {
            print!("{text}");
            return ExitCode::SUCCESS;
        }
        Err(err) => {
            eprintln!("nodeproxy: {err}");
            return ExitCode::from(err.exit_code());
        }
    };
    init_logging(loaded.config.log_format, loaded.verbosity);
    let env_names = std::env::vars_os().filter_map(|(name, _)| name.into_string().ok());
    for warning in config::unknown_env_vars(env_names) {
        tracing::warn!("{warning}");
    }
    match run(&loaded) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let (code, err) = match err.downcast::<UsageError>() {
                Ok(UsageError(inner)) => (2, inner),
                Err(other) => (1, other),
            };
            tracing::error!("{}", report(&err));
            ExitCode::from(code)
        }
    }
}

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&report(&self.0))
    }
}

/// Whether a daemon error is the operator's to fix (exit 2): the configuration, or no usable
/// way to reach the API server (no kubeconfig and not in a pod, a kubeconfig that does not
/// load, a `--master` that is not a URL).
fn is_usage(err: &nodeproxy::daemon::DaemonError) -> bool {
    use nodeproxy::daemon::DaemonError;
    use source::watch::WatchError;
    matches!(
        err,
        DaemonError::Config(_)
            | DaemonError::Client(
                WatchError::InCluster { .. }
                    | WatchError::Kubeconfig { .. }
                    | WatchError::Master { .. }
            )
    )
}

/// An error and its causes on one line, each cause once: a layer whose message already quotes
/// its cause (ours and some of kube's do) does not get it appended a second time.
fn report(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let cause = cause.to_string();
        if text.contains(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

impl std::error::Error for UsageError {}

fn init_logging(format: LogFormat, verbosity: u8) {
    let level = match verbosity {
        0 => "info",
        1..=3 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("NODEPROXY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: in the journal or a log file they are escape bytes
        // around every level and timestamp.
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn run(loaded: &config::Loaded) -> anyhow::Result<()> {
    let config = &loaded.config;
    match loaded.mode {
        Mode::PrintConfig => {
            print!("{}", config::render_effective(config, &loaded.provenance));
            Ok(())
        }
        Mode::Cleanup => cleanup(config),
        Mode::Explain(query) => {
            // Exactly the ruleset `--dry-run` prints, so the explanation is of what would be
            // programmed.
            let (state, settings) = desired_inputs(loaded)?;
            let desired = ruleset::build(&state, &settings);
            let node_addrs = nodeproxy::explain::node_addresses(&state, &settings.node_name);
            if node_addrs.is_empty() {
                tracing::warn!(
                    "node {:?} has no addresses in the input: no destination counts as local",
                    settings.node_name
                );
            }
            let text = nodeproxy::explain::report(
                &desired,
                &query,
                &settings.node_name,
                &node_addrs,
                &settings.cluster_cidrs,
            )?;
            std::io::stdout().lock().write_all(text.as_bytes())?;
            Ok(())
        }
        Mode::DryRun => {
            let (state, settings) = desired_inputs(loaded)?;
            let started = std::time::Instant::now();
            // Affinity slots as a fresh kernel would get them: the output depends on the
            // input only.
            let desired = ruleset::build(&state, &settings);
            tracing::debug!(
                "built the ruleset in {:.1} ms",
                started.elapsed().as_secs_f64() * 1e3
            );
            let mut out = std::io::stdout().lock();
            writeln!(
                out,
                "# nodeproxy ruleset for node {:?}: load with `nft -f`, inspect with `nft list table ip nodeproxy`",
                settings.node_name
            )?;
            out.write_all(ruleset::render::render(&desired).as_bytes())?;
            Ok(())
        }
        Mode::Once => {
            // Before reading anything: a second writer is refused with the daemon's message
            // whatever the kernel's support for table ownership.
            let lock = nodeproxy::lock::acquire(&config.lock_file)?;
            tracing::debug!(lock = %lock.path().display(), "took the node lock");
            let (state, mut settings) = desired_inputs(loaded)?;
            let mut kernel = nft::NetlinkKernel::new().context("opening the netlink socket")?;
            // Owned while we run, and left persistent: the daemon can take the tables over
            // later, which it could not do with tables created without persist.
            let ownership = match config.table_ownership {
                config::TableOwnership::Auto => nft::probe::probe_ownership(&mut kernel)
                    .context("probing the kernel for nftables table ownership")?,
                config::TableOwnership::Off => nft::owner::Ownership::Off,
            };
            tracing::info!("{ownership}");
            if config.table_ownership == config::TableOwnership::Off {
                let name = ruleset::names::TABLE;
                let persisted = nft::owner::persisted(&mut kernel, name);
                if let Some(warning) = nft::owner::persisted_warning(&persisted, name) {
                    tracing::warn!("{warning}");
                }
            }
            settings.own_tables = ownership.enabled();
            // After a rejection the input is read again for the retry without the rejected
            // Services: the first attempt drops it to make room for lowering the ruleset.
            let reload = || desired_inputs(loaded).map(|(state, _)| state);
            let outcome = nodeproxy::sync::once(kernel, state, &settings, reload)?;
            tracing::info!("{outcome}; peak RSS {} KiB", peak_rss_kib());
            drop(lock);
            if !outcome.quarantined.is_empty() {
                // The rest is programmed, as the daemon would have it; the exit status says
                // that not everything asked for is in the kernel.
                let names: Vec<String> = outcome
                    .quarantined
                    .iter()
                    .map(|(name, _)| name.to_string())
                    .collect();
                anyhow::bail!(
                    "the kernel rejected {} Service(s), left out of the ruleset: {}",
                    names.len(),
                    names.join(", ")
                );
            }
            Ok(())
        }
        Mode::Run => {
            if !config.from_file.is_empty() {
                return Err(UsageError(anyhow::anyhow!(
                    "--from-file is for --dry-run, --once and explain; the daemon watches the \
                     API server (--kubeconfig, --master or in-cluster)"
                ))
                .into());
            }
            nodeproxy::daemon::run(config).map_err(|e| {
                if is_usage(&e) {
                    UsageError(e.into()).into()
                } else {
                    anyhow::Error::from(e)
                }
            })
        }
    }
}

/// `--cleanup`: deletes our tables, both families in one transaction. Takes the node lock
/// first, like every mode that writes to the kernel, and refuses, deleting nothing, while
/// another process holds it or owns the tables (nftables table ownership, kernel 6.9+).
fn cleanup(config: &config::Config) -> anyhow::Result<()> {
    use nodeproxy::lock::LockError;
    use nodeproxy::nft::owner::{Holder, describe_owner};
    let name = nodeproxy::ruleset::names::TABLE;
    let lock = match nodeproxy::lock::acquire(&config.lock_file) {
        Ok(guard) => Ok(guard),
        Err(held @ LockError::Held { .. }) => Err(held),
        Err(other) => return Err(other.into()),
    };
    let mut kernel = nft::NetlinkKernel::new().context("opening the netlink socket")?;
    let mut owned = Vec::new();
    for family in nodeproxy::model::IpFamily::ALL {
        let info = kernel
            .table_info(family, name)
            .context("reading nodeproxy's tables")?;
        if let Some(Holder::Other(port)) = info.map(|i| i.holder(kernel.port_id())) {
            owned.push((family, port));
        }
    }
    let mut reasons: Vec<String> = owned
        .iter()
        .map(|(f, port)| {
            format!(
                "table {} {name} is owned by {}",
                nft::wire::family_keyword(*f),
                describe_owner(*port)
            )
        })
        .collect();
    if let Err(held) = &lock {
        reasons.push(held.to_string());
    }
    if !reasons.is_empty() {
        anyhow::bail!(
            "not removing nodeproxy's tables, nothing was deleted: {}. Stop that process \
             first (a nodeproxy leaves its tables in place, unowned), then run --cleanup again",
            reasons.join("; ")
        );
    }
    let removed = kernel
        .delete_tables(name)
        .context("removing nodeproxy's tables")?;
    tracing::info!("removed {removed} nodeproxy table(s); nothing else was touched");
    drop(lock);
    Ok(())
}

/// Loads the cluster objects and resolves the settings the ruleset is built with, reporting
/// every rejected or ignored object and every likely configuration mistake.
fn desired_inputs(options: &config::Loaded) -> anyhow::Result<(ClusterState, Settings)> {
    let config = &options.config;
    let started = std::time::Instant::now();
    let (loaded, from) = if config.from_file.is_empty() {
        // No files: the API server, read once through the same watches the daemon uses.
        let loaded = nodeproxy::daemon::fetch(config).map_err(|e| {
            let usage = is_usage(&e);
            let err = anyhow::Error::from(e).context("reading the API server");
            if usage { UsageError(err).into() } else { err }
        })?;
        (loaded, "the API server")
    } else {
        let loaded = source::file::load_files_limited(&config.from_file, options.max_input_bytes)
            .map_err(|e| UsageError(e.into()))?;
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
        return Err(UsageError(anyhow::anyhow!(
            "found no usable Service in {from}{}: refusing to program a ruleset without \
             any, which would remove every Service rule; pass --allow-empty if that is what \
             you want",
            if loaded.rejected.is_empty() {
                String::new()
            } else {
                format!(" ({} object(s) rejected)", loaded.rejected.len())
            }
        ))
        .into());
    }
    let node_name = config.node_name().map_err(|e| UsageError(e.into()))?;
    let settings = Settings::new(config, node_name);
    let cluster_ips: Vec<_> = loaded
        .state
        .services
        .values()
        .flat_map(|s| s.cluster_ips.iter().map(|ip| (s.name.to_string(), *ip)))
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
