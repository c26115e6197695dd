//! Unit tests of the event application (no network).
