//! Shared pieces of the kvpage examples.
