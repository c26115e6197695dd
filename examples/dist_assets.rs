//! Writes the files the packages ship besides the binary, all generated from the code so they
//! cannot drift from it: the man page and shell completions (from the clap definition) and the
//! commented default `config.toml` (from the settings' declarations). Run by `scripts/dist.sh`:
//! `cargo run --example dist_assets -- OUT_DIR`.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap_complete::Shell;
use nodeproxy::config::command;

fn main() -> anyhow::Result<()> {
    let out = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .context("usage: dist_assets OUT_DIR")?;
    fs::create_dir_all(out.join("completions"))
        .with_context(|| format!("creating {}", out.display()))?;

    let mut man = Vec::new();
    clap_mangen::Man::new(command()).render(&mut man)?;
    write(&out.join("nodeproxy.1"), &man)?;

    for (shell, name) in [
        (Shell::Bash, "nodeproxy.bash"),
        (Shell::Zsh, "_nodeproxy"),
        (Shell::Fish, "nodeproxy.fish"),
    ] {
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut command(), "nodeproxy", &mut script);
        write(&out.join("completions").join(name), &script)?;
    }

    write(
        &out.join("config.toml"),
        nodeproxy::config::render_default_file().as_bytes(),
    )?;
    Ok(())
}

fn write(path: &Path, contents: &[u8]) -> anyhow::Result<()> {
    fs::write(path, contents).with_context(|| format!("writing {}", path.display()))
}
