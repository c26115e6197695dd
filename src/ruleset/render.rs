//! Rendering of the ruleset as nft text.
