//! The API client, built as kube-proxy builds it: `--kubeconfig`, else the in-cluster service
//! account, `--master` overriding the server; and why that can fail.

use super::*;

/// Why no API client could be built.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("kubeconfig {}", path.display())]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: KubeconfigError,
    },
    #[error(
        "no --kubeconfig, and no in-cluster configuration to fall back on (pass --kubeconfig, or \
         run in a pod with a service account)"
    )]
    InCluster {
        #[source]
        source: kube::config::InClusterError,
    },
    #[error("--master {url:?} is not a URL")]
    Master {
        url: String,
        #[source]
        source: http::uri::InvalidUri,
    },
    #[error("cannot build an API client for {url}")]
    Client {
        url: String,
        #[source]
        source: kube::Error,
    },
}

/// How long nodeproxy waits on a silent API connection before it replaces it.
///
/// The bound on staleness behind a dead connection (half-open TCP after an API server restart or
/// a NAT timeout), with the defaults:
/// - an established watch that receives nothing for `watch + 5 s` (295 s) is abandoned by
///   kube-runtime and re-established from its last resourceVersion (the API server itself ends a
///   healthy watch after `watch`, so a live but quiet watch never hits this);
/// - a list, or the start of a watch, whose response stalls fails after `read` (300 s) without a
///   byte from the server, then is retried after the backoff (at most 30 s);
///
/// so rules are never stale for more than about 5½ minutes after the last byte the API server
/// sent. `read` must exceed `watch + 5 s`, or every quiet healthy watch would end in a read error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// `timeoutSeconds` of each watch request.
    pub watch: Duration,
    /// The HTTP client's read timeout (kube `Config::read_timeout`), counted from the last byte
    /// read or the request written.
    pub read: Duration,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts {
            watch: Duration::from_secs(290),
            read: Duration::from_secs(300),
        }
    }
}

/// Builds the client configuration like kube-proxy does: the `--kubeconfig` file if given,
/// otherwise the in-cluster service account; `--master` overrides the server of either (and
/// alone means "this URL, no credentials", as in kube-proxy). The read timeout is set from
/// `timeouts.read` so a half-open connection cannot hang a list forever.
pub async fn config(
    kubeconfig: Option<&Path>,
    master: Option<&str>,
    timeouts: &Timeouts,
) -> Result<kube::Config, WatchError> {
    let master_uri = master
        .map(|url| {
            http::Uri::from_str(url).map_err(|source| WatchError::Master {
                url: url.to_owned(),
                source,
            })
        })
        .transpose()?;
    let mut config = match (kubeconfig, master_uri) {
        (Some(path), master_uri) => {
            let wrap = |source| WatchError::Kubeconfig {
                path: path.to_owned(),
                source,
            };
            let file = Kubeconfig::read_from(path).map_err(wrap)?;
            let mut config =
                kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                    .await
                    .map_err(wrap)?;
            if let Some(uri) = master_uri {
                config.cluster_url = uri;
            }
            config
        }
        (None, Some(uri)) => kube::Config::new(uri),
        (None, None) => {
            kube::Config::incluster().map_err(|source| WatchError::InCluster { source })?
        }
    };
    config.read_timeout = Some(timeouts.read);
    // Count the read timeout from the request, not from when a pooled connection went idle:
    // otherwise a connection idle for a minute would time out a minute early.
    config.reset_reader_on_write = true;
    Ok(config)
}

/// An API client from `--kubeconfig` / in-cluster config / `--master` (see [`config`]), with the
/// default [`Timeouts`], its requests limited to `rate`.
pub async fn client(
    kubeconfig: Option<&Path>,
    master: Option<&str>,
    rate: RequestRate,
) -> Result<Client, WatchError> {
    let config = config(kubeconfig, master, &Timeouts::default()).await?;
    let url = config.cluster_url.to_string();
    let builder = kube::client::ClientBuilder::try_from(config)
        .map_err(|source| WatchError::Client { url, source })?;
    Ok(builder
        .with_layer(&super::ratelimit::RateLimitLayer::new(rate))
        .build())
}

/// An API client from a configuration built by [`config`], without a rate limit (tests).
pub fn client_from(config: kube::Config) -> Result<Client, WatchError> {
    let url = config.cluster_url.to_string();
    Client::try_from(config).map_err(|source| WatchError::Client { url, source })
}
