//! Everything written from the declarations: the clap command with one flag per setting,
//! `--help`'s closing text, `--print-config`, the packaged default config file and the README's
//! settings table.

use std::fmt::Write as _;

use clap::{Arg, ArgAction, CommandFactory as _, value_parser};

use super::Config;
use super::load::{Provenance, Source};
use super::settings::{ArgKind, Field, render_value};
use super::values::single_line;
use crate::cli::Cli;

/// The whole command line: `Cli`'s mode flags and subcommands, and one global flag per setting.
pub fn command() -> clap::Command {
    Cli::command()
        .args(Field::ALL.iter().map(|&field| setting_arg(field)))
        .args(super::kube_proxy::inert_args())
        .after_help(after_help())
}

fn setting_arg(field: Field) -> Arg {
    let spec = field.spec();
    let env_note = spec
        .env_note
        .map(|note| format!(", {note}"))
        .unwrap_or_default();
    let default = field
        .default_text()
        .map(|text| format!(" [default: {text}]"))
        .unwrap_or_default();
    let arg = Arg::new(field.key())
        .long(field.flag().trim_start_matches('-').to_string())
        .value_name(spec.value_name)
        .aliases(spec.kube_flags.iter().copied())
        .help(format!(
            "{} [env: {}{env_note}]{default}",
            field.help(),
            field.env_var()
        ))
        .global(true);
    match spec.arg {
        ArgKind::Text => arg.value_parser(value_parser!(String)),
        ArgKind::Bool => arg
            .value_parser(value_parser!(String))
            .num_args(0..=1)
            .require_equals(true)
            .default_missing_value("true"),
        ArgKind::Signed => arg
            .value_parser(value_parser!(String))
            .allow_hyphen_values(true),
        ArgKind::Path => arg.value_parser(value_parser!(std::ffi::OsString)),
        ArgKind::Paths => arg
            .value_parser(value_parser!(std::path::PathBuf))
            .action(ArgAction::Append),
    }
}

fn after_help() -> String {
    let keys: Vec<&str> = Field::ALL.iter().map(|field| field.key()).collect();
    let keys = wrap_words(&keys.join(", "), 96).join("\n");
    format!(
        "Precedence, for every setting: flag > NODEPROXY_* environment variable > config file > \
         default.\nA config file never overrides a flag or an environment variable; \
         --print-config shows where\neach effective value came from. An environment variable set \
         to the empty string counts as\nunset.\n\n\
         Config file: TOML, keys are the flag names in snake_case:\n{keys}.\n\
         No file is read unless --config (or NODEPROXY_CONFIG) names one; the conventional path \
         is\n/etc/nodeproxy/config.toml. Unknown keys are errors.\n\n\
         Durations are written as kube-proxy writes them: 500ms, 2s, 1m, 1h30m, 1.5s (units ns, \
         us, ms,\ns, m, h), or 0.\n\n\
         Exit status: 0 ok, 1 runtime failure, 2 usage or configuration error."
    )
}

/// `--print-config`: one `field = value  # source` line per field, in TOML syntax, so the
/// output is itself a valid config file that reproduces the same `Config`.
///
/// Paths that are not UTF-8 are printed lossily and will not round-trip.
pub fn render_effective(config: &Config, provenance: &Provenance) -> String {
    let mut out = String::from(
        "# nodeproxy effective configuration; precedence: flag > env > file > default\n",
    );
    match &provenance.config_file {
        Some((path, origin)) => {
            // Writing to a String cannot fail; the Result is only the fmt::Write signature.
            let _ = writeln!(
                out,
                "# config file: {} (from {})",
                single_line(&path.to_string_lossy()),
                origin.describe("--config")
            );
        }
        None => out.push_str("# config file: none (no --config or NODEPROXY_CONFIG)\n"),
    }
    for &field in Field::ALL {
        let source = provenance.of(field);
        let value = render_value(config, field);
        // What an empty value means, or how a default that depends on other settings was
        // chosen.
        let spec = field.spec();
        let note = if value == "\"\"" {
            spec.unset_note
        } else if *source == Source::Default {
            spec.default_text
        } else {
            None
        };
        let note = note.map(|note| format!(" ({note})")).unwrap_or_default();
        let source = source.describe(&field.flag());
        let _ = writeln!(out, "{} = {value}  # {source}{note}", field.key());
    }
    out
}

/// The packaged `/etc/nodeproxy/config.toml`: every setting commented out at its default, under
/// its `--help` text. Built from the same field list, defaults and value rendering as
/// `--print-config`, and the help from the clap definition, so the file cannot drift from the
/// binary it ships with. Uncommented as a whole, it loads back to the defaults (tested).
pub fn render_default_file() -> String {
    let defaults = Config::default();
    let mut out = String::from(
        "# nodeproxy configuration (TOML). Every setting is shown commented out at its default.\n\
         # Precedence: command-line flag > NODEPROXY_* environment variable > this file > default;\n\
         # `nodeproxy --print-config` shows each effective value and where it came from.\n\
         # Unknown keys are errors.\n",
    );
    for &field in Field::ALL {
        out.push('\n');
        for line in wrap_words(
            &setting_arg(field)
                .get_help()
                .map(ToString::to_string)
                .unwrap_or_default(),
            96,
        ) {
            let _ = writeln!(out, "# {line}");
        }
        let _ = writeln!(out, "#{} = {}", field.key(), render_value(&defaults, field));
    }
    out
}

/// `text`'s words in lines of at most `width` characters (a longer word stands alone).
fn wrap_words(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines
}

/// The README's settings table: one row per setting, from the declarations (tests/docs.rs
/// checks the README holds exactly this).
pub fn readme_table() -> String {
    let mut out =
        String::from("| flag | env | config key | default | meaning |\n|---|---|---|---|---|\n");
    for &field in Field::ALL {
        let spec = field.spec();
        let flag = match spec.arg {
            ArgKind::Bool => format!("`{}`", field.flag()),
            _ => format!("`{} {}`", field.flag(), spec.value_name),
        };
        let env_note = spec
            .env_note
            .map(|note| format!(" ({note})"))
            .unwrap_or_default();
        let default = field
            .default_text()
            .map_or("none".to_string(), |text| format!("`{text}`"));
        let _ = writeln!(
            out,
            "| {} | `{}`{env_note} | `{}` | {} | {} |",
            flag.replace('|', "\\|"),
            field.env_var(),
            field.key(),
            default.replace('|', "\\|"),
            field.help().replace('|', "\\|"),
        );
    }
    out
}
