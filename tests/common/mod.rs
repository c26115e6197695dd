//! Helpers shared by integration tests.
#![allow(dead_code)]

pub mod daemon;
pub mod netns;
pub mod sample;
pub mod scratch;
