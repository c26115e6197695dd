//! Durations as kube-proxy's flags write them (Go's `time.ParseDuration`), read and written
//! back.

use std::time::Duration;

pub(super) const DURATION_SYNTAX: &str = "a duration is a number with a unit, as kube-proxy writes it: \
                               500ms, 2s, 1m, 1h30m, 1.5s (units ns, us, µs, ms, s, m, h), or 0";

/// Parses a duration as Go's `time.ParseDuration` does (kube-proxy's flag syntax), except that
/// negative durations are rejected: `500ms`, `1h30m`, `1.5s`, a bare `0`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.starts_with('-') {
        return Err(format!("must not be negative; {DURATION_SYNTAX}"));
    }
    let text = text.strip_prefix('+').unwrap_or(text);
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    if text.is_empty() {
        return Err(format!("must not be empty; {DURATION_SYNTAX}"));
    }
    let too_long = || format!("is too long (at most 2562047h47m16s); {DURATION_SYNTAX}");
    let mut total: u128 = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = |s: &str| s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (whole, after) = rest.split_at(digits(rest));
        let (fraction, after) = match after.strip_prefix('.') {
            Some(after) => after.split_at(digits(after)),
            None => ("", after),
        };
        if whole.is_empty() && fraction.is_empty() {
            return Err(format!(
                "`{rest}` does not start with a number; {DURATION_SYNTAX}"
            ));
        }
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let nanos_per_unit: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "" => return Err(format!("`{text}` lacks a unit; {DURATION_SYNTAX}")),
            other => return Err(format!("unknown unit `{other}`; {DURATION_SYNTAX}")),
        };
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| too_long())?
        };
        // Digits beyond nanosecond precision cannot matter; Go drops them too.
        let fraction = fraction.get(..18).unwrap_or(fraction);
        let fraction_nanos = if fraction.is_empty() {
            0
        } else {
            let value: u128 = fraction.parse().map_err(|_| too_long())?;
            let scale = 10u128.pow(u32::try_from(fraction.len()).unwrap_or(18));
            value * nanos_per_unit / scale
        };
        total = whole
            .checked_mul(nanos_per_unit)
            .and_then(|nanos| nanos.checked_add(fraction_nanos))
            .and_then(|nanos| nanos.checked_add(total))
            .ok_or_else(too_long)?;
        rest = after;
    }
    // Go's limit (an int64 of nanoseconds), so a value kube-proxy accepts is accepted here.
    let total = u64::try_from(total)
        .ok()
        .filter(|&nanos| i64::try_from(nanos).is_ok())
        .ok_or_else(too_long)?;
    Ok(Duration::from_nanos(total))
}

/// Writes a duration in Go's syntax, compactly: `0s`, `500ms`, `1.5s`, `1h30m`, `1m5s`.
/// `parse_duration` reads it back to the same value.
pub fn format_duration(duration: Duration) -> String {
    const SECOND: u128 = 1_000_000_000;
    fn decimal(nanos: u128, unit: u128, unit_digits: usize, suffix: &str) -> String {
        let whole = nanos / unit;
        let fraction = nanos % unit;
        if fraction == 0 {
            format!("{whole}{suffix}")
        } else {
            let fraction = format!("{fraction:0unit_digits$}");
            format!("{whole}.{}{suffix}", fraction.trim_end_matches('0'))
        }
    }
    let nanos = duration.as_nanos();
    match nanos {
        0 => "0s".to_string(),
        1..1_000 => format!("{nanos}ns"),
        1_000..1_000_000 => decimal(nanos, 1_000, 3, "µs"),
        1_000_000..SECOND => decimal(nanos, 1_000_000, 6, "ms"),
        _ => {
            let hours = nanos / (3600 * SECOND);
            let minutes = nanos / (60 * SECOND) % 60;
            let seconds = nanos % (60 * SECOND);
            let mut out = String::new();
            if hours > 0 {
                out.push_str(&format!("{hours}h"));
            }
            if minutes > 0 {
                out.push_str(&format!("{minutes}m"));
            }
            if seconds > 0 {
                out.push_str(&decimal(seconds, SECOND, 9, "s"));
            }
            out
        }
    }
}
