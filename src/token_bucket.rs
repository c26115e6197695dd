//! The token bucket both of nodeproxy's rate limits count with: the Events' (`daemon::events`,
//! which refuses what is over the limit) and the API client's (`source::watch`, which delays
//! it). Only the arithmetic lives here; what to do when the bucket is empty is each caller's
//! policy, and the caller passes the time, so the bucket is tested with made-up instants.

use std::time::{Duration, Instant};

/// How a bucket fills: `burst` tokens at most, one more every `interval`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub burst: u32,
    pub interval: Duration,
}

/// A token bucket kept as the instant it is full again (GCRA): nothing to refill on each call,
/// no floats, and a bucket full at or before `now` is the same as a new one, so a caller may
/// forget it. It may run into debt: a token taken from an empty bucket is one that has not
/// refilled yet, and [`TokenBucket::take`] says how long until it has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenBucket {
    /// When the bucket has refilled completely; `None` while no token was ever taken.
    full_at: Option<Instant>,
}

impl TokenBucket {
    pub const FULL: TokenBucket = TokenBucket { full_at: None };

    /// Takes a token at `now`: the bucket after, and how long from `now` until the token taken
    /// has refilled, zero when the bucket had one. `None` when that lies beyond what an
    /// [`Instant`] can say (an interval of centuries).
    pub fn take(self, now: Instant, rate: Rate) -> Option<(TokenBucket, Duration)> {
        // A bucket that was full before `now` has refilled no further: it starts from `now`.
        let start = self.full_at.map_or(now, |t| t.max(now));
        let full_at = start.checked_add(rate.interval)?;
        // `burst` tokens' worth of the debt is what the bucket holds; only the rest is waited.
        let wait = full_at
            .saturating_duration_since(now)
            .saturating_sub(rate.interval.saturating_mul(rate.burst));
        Some((
            TokenBucket {
                full_at: Some(full_at),
            },
            wait,
        ))
    }

    /// Whether every token is back at `now`.
    pub fn is_full(self, now: Instant) -> bool {
        self.full_at.is_none_or(|t| t <= now)
    }
}

#[cfg(test)]
mod tests;
