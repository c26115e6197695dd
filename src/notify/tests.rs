use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::*;

#[test]
fn an_idle_writer_and_a_short_job_count_as_progress_a_long_job_does_not() {
    let progress = Progress::default();
    let limit = Duration::from_secs(10);
    let now = Instant::now();
    assert!(progress.making_progress(now, limit), "idle");
    assert_eq!(progress.busy_for(now), None);

    progress.busy();
    let started = Instant::now();
    assert!(progress.making_progress(started, limit));
    assert!(progress.making_progress(started + Duration::from_secs(9), limit));
    // The start is stored with millisecond resolution, rounded down: allow for that.
    assert!(!progress.making_progress(started + limit + Duration::from_millis(2), limit));
    let busy = progress
        .busy_for(started + Duration::from_secs(60))
        .unwrap();
    assert!(busy >= Duration::from_secs(60), "{busy:?}");

    progress.idle();
    assert!(progress.making_progress(started + Duration::from_secs(60), limit));
}

#[test]
fn clones_share_the_writer_state() {
    let writer = Progress::default();
    let watchdog = writer.clone();
    writer.busy();
    assert!(watchdog.busy_for(Instant::now()).is_some());
    writer.idle();
    assert!(watchdog.busy_for(Instant::now()).is_none());
}

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |name| map.get(name).cloned()
}

#[test]
fn the_watchdog_interval_is_read_as_libsystemd_reads_it() {
    let ours = std::process::id().to_string();
    assert_eq!(watchdog_interval(&env(&[])), None);
    assert_eq!(
        watchdog_interval(&env(&[("WATCHDOG_USEC", "5000000")])),
        Some(Duration::from_secs(5)),
        "no WATCHDOG_PID means the watchdog is ours"
    );
    assert_eq!(
        watchdog_interval(&env(&[
            ("WATCHDOG_USEC", "5000000"),
            ("WATCHDOG_PID", &ours)
        ])),
        Some(Duration::from_secs(5))
    );
    assert_eq!(
        watchdog_interval(&env(&[("WATCHDOG_USEC", "5000000"), ("WATCHDOG_PID", "1")])),
        None,
        "another process's watchdog"
    );
    assert_eq!(watchdog_interval(&env(&[("WATCHDOG_USEC", "0")])), None);
    assert_eq!(watchdog_interval(&env(&[("WATCHDOG_USEC", "soon")])), None);
}

#[test]
fn status_text_stays_on_one_line() {
    assert_eq!(one_line("ns/a\nSTATUS=forged"), "ns/a\\nSTATUS=forged");
    assert_eq!(one_line("plain text: 3 ms"), "plain text: 3 ms");
}
