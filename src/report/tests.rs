//! Tests of the one-line error chain.

use std::io;

use super::chain;

#[derive(Debug, thiserror::Error)]
#[error("opening the netlink socket")]
struct Ours(#[source] Layer);

#[derive(Debug, thiserror::Error)]
#[error("socket")]
struct Layer(#[source] io::Error);

/// A foreign error in kube's style: its message quotes the cause it also returns as `source()`.
#[derive(Debug, thiserror::Error)]
#[error("HyperError: {0}")]
struct Quoting(#[source] io::Error);

#[derive(Debug, thiserror::Error)]
#[error("cannot build an API client")]
struct Client(#[source] Quoting);

fn denied() -> io::Error {
    io::Error::from_raw_os_error(13)
}

#[test]
fn every_layer_is_printed_once_in_order() {
    let err = Ours(Layer(denied()));
    assert_eq!(
        chain(&err).to_string(),
        format!("opening the netlink socket: socket: {}", denied())
    );
}

#[test]
fn a_cause_the_layer_above_quotes_is_not_printed_again() {
    let err = Client(Quoting(denied()));
    assert_eq!(
        chain(&err).to_string(),
        format!("cannot build an API client: HyperError: {}", denied())
    );
}

#[test]
fn an_error_without_a_cause_is_its_message() {
    assert_eq!(chain(&denied()).to_string(), denied().to_string());
}
