//! Command-line definition (clap).
