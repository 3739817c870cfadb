//! Holds no code: the check is `tests/c_header.rs`, which regenerates kvpage's C header
//! (`host-std/include/kvpage.h`) with cbindgen and compares it with the committed one.
//! Regenerate with `KVPAGE_BLESS=1 cargo test -p kvpage-c-header`.
