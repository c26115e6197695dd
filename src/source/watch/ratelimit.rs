//! `--kube-api-qps` / `--kube-api-burst`: a token bucket in front of every request the API client
//! sends, as client-go's rate limiter is in front of kube-proxy's, a paginated list counting once.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::token_bucket::{Rate, TokenBucket};

/// The request rate: `qps` on average, `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestRate {
    pub qps: f64,
    pub burst: u32,
}

/// Never wait longer than this for a token: a deficit of a day would mean a broken clock or a
/// misconfiguration.
const MAX_WAIT: Duration = Duration::from_secs(60);
/// The longest refill interval: a qps below one request a year is taken as one a year, so the
/// bucket's instants stay far from what an `Instant` can hold.
const MAX_INTERVAL: Duration = Duration::from_secs(365 * 24 * 3600);

/// Tokens refill at `qps` up to `burst`; a request takes one, and when none is left it waits
/// for the time the deficit takes to refill (delayed, never refused). Waiting requests reserve
/// their token at once, so the order of the waits is the order of the requests.
#[derive(Debug)]
pub(crate) struct Bucket {
    /// `None` when the rate limits nothing (a qps that is not a positive number).
    rate: Option<Rate>,
    bucket: TokenBucket,
}

impl Bucket {
    pub(crate) fn new(rate: RequestRate) -> Bucket {
        let interval = (rate.qps > 0.0).then(|| {
            Duration::try_from_secs_f64(rate.qps.recip())
                .map_or(MAX_INTERVAL, |i| i.min(MAX_INTERVAL))
        });
        Bucket {
            rate: interval.map(|interval| Rate {
                burst: rate.burst,
                interval,
            }),
            bucket: TokenBucket::FULL,
        }
    }

    /// Takes a token at `now`; returns how long the request must wait for it.
    pub(crate) fn reserve(&mut self, now: Instant) -> Duration {
        let Some(rate) = self.rate else {
            return Duration::ZERO;
        };
        match self.bucket.take(now, rate) {
            Some((after, wait)) => {
                self.bucket = after;
                wait.min(MAX_WAIT)
            }
            None => MAX_WAIT,
        }
    }
}

/// The tower layer kube's `ClientBuilder` takes.
#[derive(Clone)]
pub struct RateLimitLayer {
    bucket: Arc<Mutex<Bucket>>,
}

impl RateLimitLayer {
    pub fn new(rate: RequestRate) -> RateLimitLayer {
        RateLimitLayer {
            bucket: Arc::new(Mutex::new(Bucket::new(rate))),
        }
    }
}

impl<S> tower::Layer<S> for RateLimitLayer {
    type Service = RateLimited<S>;
    fn layer(&self, inner: S) -> RateLimited<S> {
        RateLimited {
            inner,
            bucket: self.bucket.clone(),
        }
    }
}

pub struct RateLimited<S> {
    inner: S,
    bucket: Arc<Mutex<Bucket>>,
}

/// Whether a request asks for a later page of a list (a non-empty `continue` parameter).
///
/// Those go out without a token: the list took one with its first page. kube-proxy's informers
/// list each kind in one request (client-go's reflector lists at resourceVersion "0", which the
/// API server answers whole from its watch cache), so its rate limit counts a list once; the
/// watcher here asks for pages of 500 at the latest resourceVersion to bound its memory, and
/// charging each page would hold a start-up at 10k Services and their slices back by 40 pages
/// at 5 a second (measured: 7.8 s instead of 1.0 s from start to first sync).
fn is_next_page<B>(request: &http::Request<B>) -> bool {
    request.uri().query().is_some_and(|query| {
        query.split('&').any(|pair| {
            pair.strip_prefix("continue=")
                .is_some_and(|v| !v.is_empty())
        })
    })
}

/// How long `request` waits: nothing for a list's later page, else until its token is there.
fn wait_for<B>(bucket: &Mutex<Bucket>, request: &http::Request<B>) -> Duration {
    if is_next_page(request) {
        return Duration::ZERO;
    }
    bucket
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .reserve(Instant::now())
}

impl<S, B> tower::Service<http::Request<B>> for RateLimited<S>
where
    S: tower::Service<http::Request<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let wait = wait_for(&self.bucket, &request);
        // The request goes out when the returned future is first polled after the wait: the
        // client's futures are lazy, so building it here sends nothing yet.
        let response = self.inner.call(request);
        Box::pin(async move {
            if !wait.is_zero() {
                tracing::debug!(?wait, "API request held back by --kube-api-qps");
                tokio::time::sleep(wait).await;
            }
            response.await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_goes_out_at_once_and_the_rest_at_the_rate() {
        let start = Instant::now();
        let mut bucket = Bucket::new(RequestRate { qps: 5.0, burst: 3 });
        let waits: Vec<Duration> = (0..5).map(|_| bucket.reserve(start)).collect();
        assert_eq!(&waits[..3], [Duration::ZERO; 3]);
        assert_eq!(waits[3], Duration::from_millis(200));
        assert_eq!(waits[4], Duration::from_millis(400));
        // After a quiet second the deficit (2) is repaid and three more are free again.
        let later = start + Duration::from_millis(1400);
        let waits: Vec<Duration> = (0..3).map(|_| bucket.reserve(later)).collect();
        assert_eq!(waits, [Duration::ZERO; 3]);
        assert!(bucket.reserve(later) > Duration::ZERO);
    }

    #[test]
    fn a_long_idle_time_refills_no_more_than_the_burst() {
        let start = Instant::now();
        let mut bucket = Bucket::new(RequestRate { qps: 1.0, burst: 2 });
        let later = start + Duration::from_secs(3600);
        assert_eq!(bucket.reserve(later), Duration::ZERO);
        assert_eq!(bucket.reserve(later), Duration::ZERO);
        assert_eq!(bucket.reserve(later), Duration::from_secs(1));
    }

    #[test]
    fn a_fractional_rate_spaces_requests_by_its_inverse() {
        let start = Instant::now();
        let mut bucket = Bucket::new(RequestRate { qps: 0.5, burst: 1 });
        assert_eq!(bucket.reserve(start), Duration::ZERO);
        assert_eq!(bucket.reserve(start), Duration::from_secs(2));
        assert_eq!(bucket.reserve(start), Duration::from_secs(4));
    }

    #[test]
    fn a_request_never_waits_longer_than_a_minute() {
        let start = Instant::now();
        let mut bucket = Bucket::new(RequestRate {
            qps: 1e-300,
            burst: 1,
        });
        assert_eq!(bucket.reserve(start), Duration::ZERO);
        assert_eq!(bucket.reserve(start), MAX_WAIT);
        assert_eq!(bucket.reserve(start), MAX_WAIT);
    }

    #[test]
    fn only_a_list_s_later_pages_are_next_pages() {
        let request = |uri: &str| http::Request::get(uri).body(()).unwrap();
        assert!(is_next_page(&request(
            "/api/v1/services?labelSelector=a&limit=500&continue=eyJ2IjoxfQ%3D%3D"
        )));
        assert!(is_next_page(&request("/api/v1/services?continue=x")));
        // A list's later pages go out at once even when the bucket is empty; the next list
        // waits.
        let bucket = Mutex::new(Bucket::new(RequestRate {
            qps: 0.001,
            burst: 1,
        }));
        let page = |c: &str| request(&format!("/api/v1/services?limit=500&continue={c}"));
        assert_eq!(
            wait_for(&bucket, &request("/api/v1/services?limit=500")),
            Duration::ZERO
        );
        for c in ["a", "b", "c"] {
            assert_eq!(wait_for(&bucket, &page(c)), Duration::ZERO);
        }
        assert!(wait_for(&bucket, &request("/api/v1/nodes?limit=500")) > Duration::from_secs(50));
        for first in [
            "/api/v1/services?limit=500",
            "/api/v1/services?limit=500&continue=",
            "/api/v1/services?labelSelector=continue%3Dx",
            "/api/v1/services?watch=true&resourceVersion=7",
            "/api/v1/namespaces/continue=x/events",
        ] {
            assert!(!is_next_page(&request(first)), "{first}");
        }
    }

    #[test]
    fn a_rate_that_is_not_positive_limits_nothing() {
        let start = Instant::now();
        let mut bucket = Bucket::new(RequestRate { qps: 0.0, burst: 1 });
        assert!((0..100).all(|_| bucket.reserve(start).is_zero()));
    }
}
