//! A minimal HTTP/1.1 client for tests: one GET per connection, bounded in time.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// No test request may hang the suite.
const TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub(crate) struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// `GET path` on a fresh connection.
pub(crate) async fn get(addr: SocketAddr, path: &str) -> io::Result<Reply> {
    let stream = tokio::time::timeout(TIMEOUT, TcpStream::connect(addr)).await??;
    get_on(stream, path).await
}

/// `GET path` on an already open connection, which is then closed.
pub(crate) async fn get_on(mut stream: TcpStream, path: &str) -> io::Result<Reply> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    let raw = tokio::time::timeout(TIMEOUT, async {
        stream.write_all(request.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        Ok::<_, io::Error>(raw)
    })
    .await??;
    parse(&String::from_utf8_lossy(&raw))
}

fn parse(raw: &str) -> io::Result<Reply> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, format!("bad response: {raw:?}"));
    let (head, body) = raw.split_once("\r\n\r\n").ok_or_else(bad)?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(bad)?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
        .collect();
    Ok(Reply {
        status,
        headers,
        body: body.to_string(),
    })
}

/// Whether a TCP connection to `addr` is refused, polling until `within` (a closed listener goes
/// away asynchronously, when its task next runs).
pub(crate) async fn refused_within(addr: SocketAddr, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match TcpStream::connect(addr).await {
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => return true,
            _ if tokio::time::Instant::now() >= deadline => return false,
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// A port that was free a moment ago on 127.0.0.1 (for servers that need a fixed port number).
pub(crate) fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}
