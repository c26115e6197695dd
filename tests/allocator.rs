//! The allocator's options as the binary runs with them: the ones compiled in from
//! `.cargo/config.toml` (which every memory figure in `docs/performance.md` was measured with),
//! and the override through `_RJEM_MALLOC_CONF` that the README and the unit's environment file
//! offer operators who trade start-up CPU for a lower peak. jemalloc prints the options in
//! effect with `stats_print`, at exit.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

/// The option lines (`opt.<name>: <value> ...`) jemalloc prints at the exit of `nodeproxy
/// --version` run with `_RJEM_MALLOC_CONF=<conf>`.
fn options(conf: &str) -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_nodeproxy"))
        .arg("--version")
        .env("_RJEM_MALLOC_CONF", conf)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("___ Begin jemalloc statistics ___"),
        "jemalloc printed no statistics, is it the allocator? {stderr}"
    );
    stderr
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("opt."))
        .map(str::to_owned)
        .collect()
}

fn value<'a>(options: &'a [String], name: &str) -> &'a str {
    let prefix = format!("opt.{name}: ");
    let line = options
        .iter()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no opt.{name} among {options:?}"));
    line[prefix.len()..].split(' ').next().unwrap()
}

#[test]
fn the_compiled_in_options_are_in_effect() {
    let opts = options("stats_print:true");
    // jemalloc's own defaults are 10 s, 4 arenas per CPU and no background thread: a build that
    // lost `.cargo/config.toml` would keep ten times the freed memory resident.
    assert_eq!(value(&opts, "dirty_decay_ms"), "1000");
    assert_eq!(value(&opts, "muzzy_decay_ms"), "0");
    assert_eq!(value(&opts, "narenas"), "1");
    assert_eq!(value(&opts, "background_thread"), "true");
    // jemalloc's default is 8 MiB: with it, the cold `--once` peak at 10k Services keeps ~5 MiB
    // more of freed vectors resident (docs/performance.md).
    assert_eq!(value(&opts, "oversize_threshold"), "2097152");
    // jemalloc's default is 32 KiB: idle threads' caches kept ~0.65 MB more of the daemon's
    // resident memory at 10k Services (docs/performance.md).
    assert_eq!(value(&opts, "tcache_max"), "1024");
}

#[test]
fn the_environment_overrides_the_decay_and_keeps_the_rest() {
    let opts = options("dirty_decay_ms:0,stats_print:true");
    assert_eq!(value(&opts, "dirty_decay_ms"), "0");
    assert_eq!(value(&opts, "narenas"), "1");
    assert_eq!(value(&opts, "background_thread"), "true");
    assert_eq!(value(&opts, "oversize_threshold"), "2097152");
    assert_eq!(value(&opts, "tcache_max"), "1024");
}
