//! An error and its causes on one line, `outer: cause: root`, the way operators read them in
//! the log and on stderr: each of our errors describes its own layer and leaves its cause to
//! `source()`, so whatever prints an error prints it through [`chain`].

use std::error::Error;
use std::fmt;

/// `err` and every cause below it, joined by `: `. Use it wherever an error is shown (logged,
/// printed, put in a report): an error's own `Display` says only what its layer was doing.
pub fn chain<'a>(err: &'a (dyn Error + 'static)) -> Chain<'a> {
    Chain(err)
}

/// The [`Display`](fmt::Display) of [`chain`].
#[derive(Debug, Clone, Copy)]
pub struct Chain<'a>(&'a (dyn Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut above = self.0.to_string();
        f.write_str(&above)?;
        let mut next = self.0.source();
        while let Some(cause) = next {
            let text = cause.to_string();
            // Ours never quote their cause, but kube's do, after a colon, and also return it as
            // `source()` (kube::Error's `HyperError: {0}`, KubeconfigError's `failed to read
            // kubeconfig from '…': {0}`, InClusterError's): a cause the layer above already
            // quoted is not printed again. Only a quotation counts, not any substring: a cause
            // `socket` under `opening the netlink socket` is printed.
            let quoted = above == text || above.contains(&format!(": {text}"));
            if !text.is_empty() && !quoted {
                write!(f, ": {text}")?;
            }
            above = text;
            next = cause.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
