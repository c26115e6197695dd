//! systemd's notification protocol (`Type=notify`): `READY=1` after the first successful sync,
//! `STATUS=` with the last sync's summary, `STOPPING=1` on shutdown, and `WATCHDOG=1` only while
//! the writer thread makes progress. Without `NOTIFY_SOCKET` every call is a no-op.
//!
//! The watchdog is the point: kube-proxy's IPVS mode once deadlocked two threads in the kernel
//! API and kept serving stale rules while the process looked alive. Pings sent from the async
//! side alone would prove only that the runtime runs, so they are tied to the writer: the writer
//! marks when its current job started ([`Progress`]), and a ping is withheld once one job has
//! taken longer than the watchdog interval. systemd then kills and restarts the service; the
//! rules stay in the kernel meanwhile and the next process adopts them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sd_notify::NotifyState;

/// The test-only fault switch: when this environment variable names a path and a file exists
/// there at the start of a sync, the writer thread blocks forever, as a writer stuck in the
/// kernel would. The packaging tests use it to see the watchdog restart the service under a real
/// systemd (`scripts/test-dist.sh`); nothing else should set it.
pub const HANG_WRITER_ENV: &str = "NODEPROXY_TEST_HANG_WRITER";

/// Sends one notification; failures are logged at debug level only: the service manager may have
/// gone away (e.g. during shutdown), and the proxy's job does not depend on it.
fn send(state: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(false, state) {
        tracing::debug!("systemd notification failed: {e}");
    }
}

/// `READY=1` with a status line: the first sync has programmed the kernel.
pub fn ready(status: &str) {
    let status = one_line(status);
    send(&[NotifyState::Ready, NotifyState::Status(&status)]);
}

/// `STATUS=` with the last sync's summary.
pub fn status(status: &str) {
    let status = one_line(status);
    send(&[NotifyState::Status(&status)]);
}

/// `STOPPING=1`: shutting down, the sync in flight finishes first.
pub fn stopping() {
    send(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
}

/// `WATCHDOG=1`.
fn watchdog_ping() {
    send(&[NotifyState::Watchdog]);
}

/// The watchdog interval systemd asked for (`WATCHDOG_USEC`), if it is meant for this process
/// (`WATCHDOG_PID` unset or ours, as libsystemd's `sd_watchdog_enabled` reads them).
pub fn watchdog_interval(env: &dyn Fn(&str) -> Option<String>) -> Option<Duration> {
    let usec: u64 = env("WATCHDOG_USEC")?.trim().parse().ok()?;
    if let Some(pid) = env("WATCHDOG_PID")
        && pid.trim().parse::<u32>().ok()? != std::process::id()
    {
        return None;
    }
    (usec > 0).then(|| Duration::from_micros(usec))
}

/// Status text as one line: systemd shows it in `systemctl status`, and text that came from
/// cluster objects must not forge lines there.
fn one_line(text: &str) -> String {
    text.chars()
        .flat_map(char::escape_debug)
        .collect::<String>()
}

/// When the writer's current job started, shared between the writer thread (which marks it) and
/// the watchdog task (which reads it). Lock-free, so a stuck writer cannot block the reader.
#[derive(Debug, Clone)]
pub struct Progress {
    /// Milliseconds since `base` plus one when the job started; 0 while the writer is idle.
    busy_since: Arc<AtomicU64>,
    base: Instant,
}

impl Default for Progress {
    fn default() -> Progress {
        Progress {
            busy_since: Arc::new(AtomicU64::new(0)),
            base: Instant::now(),
        }
    }
}

impl Progress {
    /// The writer starts a job.
    pub fn busy(&self) {
        let since = u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        self.busy_since.store(since + 1, Ordering::Release);
    }

    /// The writer finished its job and waits for the next.
    pub fn idle(&self) {
        self.busy_since.store(0, Ordering::Release);
    }

    /// How long the current job has been running at `now`; `None` while idle.
    pub fn busy_for(&self, now: Instant) -> Option<Duration> {
        match self.busy_since.load(Ordering::Acquire) {
            0 => None,
            since => {
                let started = self.base + Duration::from_millis(since - 1);
                Some(now.saturating_duration_since(started))
            }
        }
    }

    /// Whether the writer counts as making progress: idle, or busy for less than `limit`.
    pub fn making_progress(&self, now: Instant, limit: Duration) -> bool {
        self.busy_for(now).is_none_or(|busy| busy < limit)
    }
}

/// Pings the watchdog every half `interval` while `progress` shows the writer making progress
/// (systemd's advice: ping at half the interval). Runs until the task is dropped.
pub async fn watchdog(progress: Progress, interval: Duration) {
    let mut ticks = tokio::time::interval(interval / 2);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut withheld = false;
    loop {
        ticks.tick().await;
        let now = Instant::now();
        if progress.making_progress(now, interval) {
            if withheld {
                tracing::info!("the sync thread is making progress again; watchdog pings resume");
                withheld = false;
            }
            watchdog_ping();
        } else if !withheld {
            let busy = progress.busy_for(now).unwrap_or_default();
            tracing::error!(
                "the sync thread has been busy with one sync for {:.1} s, longer than the \
                 watchdog interval ({:.1} s): withholding the watchdog ping so that systemd \
                 restarts nodeproxy",
                busy.as_secs_f64(),
                interval.as_secs_f64()
            );
            withheld = true;
        }
    }
}

/// Blocks the calling thread forever if the [`HANG_WRITER_ENV`] switch is thrown (see there).
pub fn hang_if_switched(path: Option<&std::path::Path>) {
    let Some(path) = path else { return };
    if !path.exists() {
        return;
    }
    tracing::warn!(
        "test fault switch {HANG_WRITER_ENV}: {} exists, the sync thread hangs",
        path.display()
    );
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

#[cfg(test)]
mod tests;
