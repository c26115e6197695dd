//! kube-proxy's privileged node set-up: the conntrack sysctls (`nf_conntrack_max` and the hash
//! size, the TCP and UDP timeouts, `tcp_be_liberal`) and the process's `oom_score_adj`.
//!
//! Semantics follow kube-proxy's `pkg/proxy/conntrack/sysctls.go` (formerly
//! `cmd/kube-proxy/app/conntrack.go` and `server_linux.go`), with one difference: a setting the
//! kernel refuses is a warning in the [`Report`] and the others are still applied, where
//! kube-proxy returns the first error. A DaemonSet without privilege (read-only `/proc/sys` or
//! `/sys`, or a pod outside the host's network namespace) then still starts, and says which
//! sysctl it could not set and what to do about it.
//!
//! The roots (`/proc/sys`, `/sys`, `/proc/self`) are parameters so that tests can point the
//! writer at a temporary directory and never change the machine's settings.
//!
//! Measured on Linux 6.18 (see `tests/node_setup.rs`): the TCP and UDP timeouts and
//! `nf_conntrack_tcp_be_liberal` are per network namespace and writable in a new one;
//! `nf_conntrack_max` is mode 0444 outside the initial namespace (a write fails with EACCES even
//! for root), and the `hashsize` module parameter refuses writes from outside it with
//! EOPNOTSUPP.

use std::fmt;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::errno::Errno;

use crate::report;

/// kube-proxy caps the scaled maximum so that a machine with hundreds of cores does not get a
/// table of many millions of entries (kubernetes PR #137002, in 1.36).
pub const CONNTRACK_MAX_CAP: u32 = 1_048_576;

/// What to tell the operator when the kernel refuses a conntrack setting.
const SYSCTL_REMEDY: &str = "the kernel lets only a privileged process in the host's network \
    namespace, with /proc/sys and /sys writable, change it: run nodeproxy privileged with \
    hostNetwork (e.g. `nodeproxy --init-only` as a privileged init container), or set it on the \
    host";
const OOM_REMEDY: &str = "lowering it needs CAP_SYS_RESOURCE (the packaged unit sets \
    OOMScoreAdjust=-999 itself; in a pod, kubelet sets it by QoS class)";

/// kube-proxy's `KubeProxyConntrackConfiguration`. A zero leaves the kernel's value, as
/// upstream does for each field (`max_per_core` 0 leaves both `nf_conntrack_max` and the hash
/// size; `min` 0 is no floor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conntrack {
    pub max_per_core: u32,
    pub min: u32,
    pub tcp_established_timeout: Duration,
    pub tcp_close_wait_timeout: Duration,
    pub tcp_be_liberal: bool,
    pub udp_timeout: Duration,
    pub udp_stream_timeout: Duration,
}

impl Default for Conntrack {
    /// kube-proxy's defaults (`pkg/proxy/apis/config/v1alpha1/defaults.go`).
    fn default() -> Conntrack {
        Conntrack {
            max_per_core: 32 * 1024,
            min: 128 * 1024,
            tcp_established_timeout: Duration::from_secs(24 * 3600),
            tcp_close_wait_timeout: Duration::from_secs(3600),
            tcp_be_liberal: false,
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
        }
    }
}

impl Conntrack {
    /// The `nf_conntrack_max` kube-proxy wants on a node with `cpus` CPUs, `None` to leave the
    /// kernel's. As upstream's `getConntrackMax`: the cap applies to the scaled value before
    /// the floor is considered, so a `min` above the cap wins only when the scaled value is
    /// below the cap.
    pub fn wanted_max(&self, cpus: usize) -> Option<u32> {
        if self.max_per_core == 0 {
            return None;
        }
        let cpus = u32::try_from(cpus).unwrap_or(u32::MAX);
        let scaled = self.max_per_core.saturating_mul(cpus);
        let max = if scaled > CONNTRACK_MAX_CAP {
            CONNTRACK_MAX_CAP
        } else {
            scaled.max(self.min)
        };
        // Upstream sets nothing when the result is 0 (`if max > 0`).
        (max > 0).then_some(max)
    }
}

/// One value written: the setting's name, its file, what it held and what it holds now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub name: &'static str,
    pub path: PathBuf,
    pub old: i64,
    pub new: i64,
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} changed from {} to {}", self.name, self.old, self.new)
    }
}

/// A setting left as the kernel has it because reading or writing it failed.
#[derive(Debug)]
pub struct Warning {
    pub name: &'static str,
    pub error: NodeSetupError,
}

impl fmt::Display for Warning {
    /// The setting, the error and its causes, then what to do about it when there is a remedy.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} left as it is: {}",
            self.name,
            report::chain(&self.error)
        )?;
        if let Some(remedy) = self.error.remedy() {
            write!(f, "; {remedy}")?;
        }
        Ok(())
    }
}

/// What [`apply`] did: the values it changed and the settings it could not make.
#[derive(Debug, Default)]
pub struct Report {
    pub changes: Vec<Change>,
    pub warnings: Vec<Warning>,
}

#[derive(Debug, thiserror::Error)]
pub enum NodeSetupError {
    #[error("cannot read {}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("{}: expected an integer, found {found:?}", path.display())]
    Parse { path: PathBuf, found: String },
    /// [`NodeSetupError::remedy`] says what to do about it.
    #[error("{}: not allowed to write {wanted}", path.display())]
    NotPermitted {
        path: PathBuf,
        wanted: i64,
        source: io::Error,
        remedy: &'static str,
    },
    #[error("{}: cannot write {wanted}", path.display())]
    Write {
        path: PathBuf,
        wanted: i64,
        source: io::Error,
    },
    #[error("{}: {value} is out of range, expected -1000..=1000", path.display())]
    OomScoreAdjRange { path: PathBuf, value: i32 },
}

impl NodeSetupError {
    /// What the operator can do about a refusal by the kernel.
    pub fn remedy(&self) -> Option<&'static str> {
        match self {
            NodeSetupError::NotPermitted { remedy, .. } => Some(remedy),
            _ => None,
        }
    }
}

/// Applies `settings` under `proc_sys` (the real caller passes `/proc/sys`) and `sys` (`/sys`)
/// for a node with `cpus` CPUs ([`online_cpus`]). Never stops early: every setting is tried,
/// and what failed is in [`Report::warnings`] (also logged), each naming its sysctl.
pub fn apply(proc_sys: &Path, sys: &Path, cpus: usize, settings: &Conntrack) -> Report {
    let mut report = Report::default();
    let netfilter = proc_sys.join("net/netfilter");
    // Same order as upstream's setSysctls.
    if let Some(max) = settings.wanted_max(cpus).map(i64::from) {
        // Raised only, never lowered: an operator's larger value stays, and a pod that may not
        // write it does not fail when it already suffices (kubernetes PR #142035).
        report.ensure(
            "net.netfilter.nf_conntrack_max",
            netfilter.join("nf_conntrack_max"),
            max,
            Rule::Raise,
        );
        // Upstream raises the hash size to max/4 whenever it is smaller, whether or not the
        // max was written (sysctls.go, GetHashsize/SetHashsize).
        report.ensure(
            "nf_conntrack.hashsize",
            sys.join("module/nf_conntrack/parameters/hashsize"),
            max / 4,
            Rule::Raise,
        );
    }
    for (name, file, timeout) in [
        (
            "net.netfilter.nf_conntrack_tcp_timeout_established",
            "nf_conntrack_tcp_timeout_established",
            settings.tcp_established_timeout,
        ),
        (
            "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
            "nf_conntrack_tcp_timeout_close_wait",
            settings.tcp_close_wait_timeout,
        ),
    ] {
        report.ensure_timeout(name, netfilter.join(file), timeout);
    }
    // Upstream only ever sets 1: false leaves whatever the node has.
    if settings.tcp_be_liberal {
        report.ensure(
            "net.netfilter.nf_conntrack_tcp_be_liberal",
            netfilter.join("nf_conntrack_tcp_be_liberal"),
            1,
            Rule::Differs,
        );
    }
    for (name, file, timeout) in [
        (
            "net.netfilter.nf_conntrack_udp_timeout",
            "nf_conntrack_udp_timeout",
            settings.udp_timeout,
        ),
        (
            "net.netfilter.nf_conntrack_udp_timeout_stream",
            "nf_conntrack_udp_timeout_stream",
            settings.udp_stream_timeout,
        ),
    ] {
        report.ensure_timeout(name, netfilter.join(file), timeout);
    }
    report
}

/// When a value is written.
#[derive(Clone, Copy)]
enum Rule {
    /// When the file holds anything else (upstream's setIntSysCtl).
    Differs,
    /// When the file holds less.
    Raise,
}

impl Report {
    fn ensure_timeout(&mut self, name: &'static str, path: PathBuf, timeout: Duration) {
        // The sysctls are in whole seconds. Upstream truncates too, but writes the 0 a
        // sub-second timeout truncates to, which would expire every such flow at once; here it
        // leaves the kernel's value like an explicit zero.
        let seconds = i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX);
        if seconds > 0 {
            self.ensure(name, path, seconds, Rule::Differs);
        }
    }

    fn ensure(&mut self, name: &'static str, path: PathBuf, wanted: i64, rule: Rule) {
        // Upstream writes when it cannot read the value; here a file that cannot be read is not
        // written either, since the write would fail the same way (missing module, no such
        // namespace file) and the read error says more.
        let old = match read_value(&path) {
            Ok(old) => old,
            Err(error) => return self.warn(name, error),
        };
        let needed = match rule {
            Rule::Differs => old != wanted,
            Rule::Raise => old < wanted,
        };
        if !needed {
            return;
        }
        match write_value(&path, wanted, SYSCTL_REMEDY) {
            Ok(()) => {
                let change = Change {
                    name,
                    path,
                    old,
                    new: wanted,
                };
                tracing::info!(
                    sysctl = name,
                    old,
                    new = wanted,
                    path = %change.path.display(),
                    "{change}"
                );
                self.changes.push(change);
            }
            Err(error) => self.warn(name, error),
        }
    }

    fn warn(&mut self, name: &'static str, error: NodeSetupError) {
        let warning = Warning { name, error };
        tracing::warn!("{warning}");
        self.warnings.push(warning);
    }
}

/// Sets `<proc_self>/oom_score_adj` (the real caller passes `/proc/self`) to `value` when it
/// holds anything else, as kube-proxy's `--oom-score-adj` does; the old and new value when it
/// wrote. Out-of-range values are refused before anything is read.
pub fn set_oom_score_adj(
    proc_self: &Path,
    value: i32,
) -> Result<Option<(i32, i32)>, NodeSetupError> {
    let path = proc_self.join("oom_score_adj");
    if !(-1000..=1000).contains(&value) {
        return Err(NodeSetupError::OomScoreAdjRange { path, value });
    }
    let old = read_value(&path)?;
    let wanted = i64::from(value);
    if old == wanted {
        return Ok(None);
    }
    // The kernel keeps the file within -1000..=1000, so anything else is not oom_score_adj.
    let old = i32::try_from(old).map_err(|_| NodeSetupError::Parse {
        path: path.clone(),
        found: old.to_string(),
    })?;
    write_value(&path, wanted, OOM_REMEDY)?;
    tracing::info!(
        old,
        new = value,
        path = %path.display(),
        "oom_score_adj changed from {old} to {value}"
    );
    Ok(Some((old, value)))
}

/// The number of CPUs to size `nf_conntrack_max` by: the node's online CPUs
/// (`/sys/devices/system/cpu/online`), else the CPUs this process may run on
/// (`sched_getaffinity`), else 1.
///
/// The limit is node-wide, so it follows the node's CPU count, as kube-proxy's `DetectNumCPU`
/// does since kubernetes issue #99225 (online CPUs from sysfs, falling back to Go's
/// `runtime.NumCPU`, which is the affinity count). The affinity count alone undercounts when
/// the pod is pinned to a few CPUs (static CPU manager policy); `available_parallelism` is
/// worse still, as it also divides by the cgroup's CPU quota.
/// The whole set-up on this host: the conntrack settings under `/proc/sys` and `/sys` for the
/// online CPUs, and this process's `oom_score_adj`. A refused sysctl is a warning in the report
/// (and logged), never an abort of the rest.
pub fn set_up_host(conntrack: &Conntrack, oom_score_adj: i32) -> Report {
    let report = apply(
        Path::new("/proc/sys"),
        Path::new("/sys"),
        online_cpus(),
        conntrack,
    );
    // Not a warning, as in kube-proxy (which logs it at -v=2): a pod without CAP_SYS_RESOURCE
    // cannot lower its score, and kubelet has already set one by QoS class.
    if let Err(error) = set_oom_score_adj(Path::new("/proc/self"), oom_score_adj) {
        let warning = Warning {
            name: "oom_score_adj",
            error,
        };
        tracing::info!("{warning}");
    }
    report
}

pub fn online_cpus() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|text| count_cpu_list(&text))
        .or_else(affinity_cpus)
        .unwrap_or(1)
}

/// The number of CPUs in a kernel CPU list (`0-3,8,10-11`), `None` when it is not one or is
/// empty.
fn count_cpu_list(text: &str) -> Option<usize> {
    let mut count = 0usize;
    for part in text.trim().split(',') {
        let (first, last) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?),
            None => {
                let cpu = part.parse::<usize>().ok()?;
                (cpu, cpu)
            }
        };
        count = count.checked_add(last.checked_sub(first)?.checked_add(1)?)?;
    }
    (count > 0).then_some(count)
}

fn affinity_cpus() -> Option<usize> {
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).ok()?;
    let count = (0..nix::sched::CpuSet::count())
        .filter(|&cpu| set.is_set(cpu).unwrap_or(false))
        .count();
    (count > 0).then_some(count)
}

fn read_value(path: &Path) -> Result<i64, NodeSetupError> {
    let text = std::fs::read_to_string(path).map_err(|source| NodeSetupError::Read {
        path: path.to_owned(),
        source,
    })?;
    text.trim().parse().map_err(|_| NodeSetupError::Parse {
        path: path.to_owned(),
        found: text.trim().chars().take(40).collect(),
    })
}

fn write_value(path: &Path, wanted: i64, remedy: &'static str) -> Result<(), NodeSetupError> {
    // No create: a missing file is a missing sysctl, not one to make. One write of the whole
    // value at offset 0, which is what procfs and sysfs parse.
    let result = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .and_then(|mut file| file.write_all(wanted.to_string().as_bytes()));
    result.map_err(|source| write_error(path, wanted, source, remedy))
}

/// Refusals by the kernel (read-only mounts, file modes, capabilities, writes outside the
/// initial network namespace) get the remedy; anything else is reported as it is.
fn write_error(
    path: &Path,
    wanted: i64,
    source: io::Error,
    remedy: &'static str,
) -> NodeSetupError {
    let refused = source.raw_os_error().map(Errno::from_raw).is_some_and(|e| {
        matches!(
            e,
            Errno::EROFS | Errno::EACCES | Errno::EPERM | Errno::EOPNOTSUPP
        )
    });
    if refused {
        NodeSetupError::NotPermitted {
            path: path.to_owned(),
            wanted,
            source,
            remedy,
        }
    } else {
        NodeSetupError::Write {
            path: path.to_owned(),
            wanted,
            source,
        }
    }
}

#[cfg(test)]
mod tests;
