//! Unit tests of the token bucket, on made-up instants: only their differences matter.
use super::*;

const MS_100: Duration = Duration::from_millis(100);
const RATE: Rate = Rate {
    burst: 3,
    interval: MS_100,
};

/// Takes `n` tokens at `now` from `bucket`, in debt if need be; returns each one's wait.
fn take_n(bucket: &mut TokenBucket, now: Instant, rate: Rate, n: usize) -> Vec<Duration> {
    (0..n)
        .map(|_| {
            let (after, wait) = bucket.take(now, rate).unwrap();
            *bucket = after;
            wait
        })
        .collect()
}

#[test]
fn a_full_bucket_gives_its_burst_at_once() {
    let t0 = Instant::now();
    let mut b = TokenBucket::FULL;
    assert_eq!(take_n(&mut b, t0, RATE, 3), [Duration::ZERO; 3]);
    assert!(!b.is_full(t0));
}

#[test]
fn past_the_burst_each_token_is_one_interval_further_away() {
    let t0 = Instant::now();
    let mut b = TokenBucket::FULL;
    let waits = take_n(&mut b, t0, RATE, 6);
    assert_eq!(
        waits[3..],
        [MS_100, 2 * MS_100, 3 * MS_100],
        "the time until the next token grows by one interval per token owed"
    );
}

#[test]
fn the_time_until_the_next_token_counts_from_now() {
    let t0 = Instant::now();
    let mut b = TokenBucket::FULL;
    take_n(&mut b, t0, RATE, 3);
    // 30 ms into the refill of the first token: 70 ms to go.
    let (_, wait) = b.take(t0 + Duration::from_millis(30), RATE).unwrap();
    assert_eq!(wait, Duration::from_millis(70));
}

#[test]
fn tokens_refill_one_per_interval() {
    let t0 = Instant::now();
    let mut b = TokenBucket::FULL;
    take_n(&mut b, t0, RATE, 3);
    // Two intervals later two tokens are back, not three.
    let waits = take_n(&mut b, t0 + 2 * MS_100, RATE, 3);
    assert_eq!(waits, [Duration::ZERO, Duration::ZERO, MS_100]);
}

#[test]
fn an_empty_bucket_refuses_then_allows_after_one_interval() {
    // The deny policy: a token with a wait is not taken, and the bucket stays as it was.
    let admit = |b: &mut TokenBucket, now: Instant| match b.take(now, RATE) {
        Some((after, wait)) if wait.is_zero() => {
            *b = after;
            true
        }
        _ => false,
    };
    let t0 = Instant::now();
    let mut b = TokenBucket::FULL;
    assert_eq!((0..10).filter(|_| admit(&mut b, t0)).count(), 3);
    assert!(!admit(&mut b, t0 + MS_100 - Duration::from_millis(1)));
    assert!(admit(&mut b, t0 + MS_100));
    assert!(!admit(&mut b, t0 + MS_100));
}

#[test]
fn a_long_idle_time_refills_no_more_than_the_burst() {
    let t0 = Instant::now();
    let mut b = TokenBucket::FULL;
    take_n(&mut b, t0, RATE, 3);
    let later = t0 + Duration::from_secs(3600);
    assert!(b.is_full(later));
    assert_eq!(
        take_n(&mut b, later, RATE, 4),
        [Duration::ZERO, Duration::ZERO, Duration::ZERO, MS_100]
    );
}

#[test]
fn the_bucket_is_full_again_once_every_token_taken_has_refilled() {
    let t0 = Instant::now();
    let mut b = TokenBucket::FULL;
    assert!(b.is_full(t0));
    take_n(&mut b, t0, RATE, 2);
    assert!(!b.is_full(t0 + MS_100));
    assert!(b.is_full(t0 + 2 * MS_100));
}

#[test]
fn without_a_burst_every_token_waits_an_interval() {
    let rate = Rate {
        burst: 0,
        interval: MS_100,
    };
    let t0 = Instant::now();
    let mut b = TokenBucket::FULL;
    assert_eq!(take_n(&mut b, t0, rate, 2), [MS_100, 2 * MS_100]);
}

#[test]
fn an_interval_past_what_an_instant_holds_is_no_answer_not_a_panic() {
    let rate = Rate {
        burst: 1,
        interval: Duration::MAX,
    };
    assert_eq!(TokenBucket::FULL.take(Instant::now(), rate), None);
}
