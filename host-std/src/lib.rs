//! kvpage std facade.
