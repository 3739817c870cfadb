//! kvpage's committed C header (`host-std/include/kvpage.h`) is what cbindgen generates
//! from `host-std/src/ffi` now, and its version macros are kvpage's version. Regenerate
//! with `KVPAGE_BLESS=1 cargo test -p kvpage-c-header`.

use std::path::Path;

/// kvpage's package folder (`host-std`), this crate's parent.
fn kvpage_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("host-std/c-header has a parent")
}

fn generated() -> String {
    let dir = kvpage_dir();
    let config =
        cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml parses");
    let bindings = cbindgen::generate_with_config(dir, config).expect("cbindgen generates");
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).expect("UTF-8 header")
}

#[test]
fn the_committed_header_is_current() {
    let path = kvpage_dir().join("include/kvpage.h");
    let fresh = generated();
    if std::env::var_os("KVPAGE_BLESS").is_some() {
        std::fs::write(&path, &fresh).expect("write the header");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != fresh {
        let line = committed
            .lines()
            .zip(fresh.lines())
            .position(|(a, b)| a != b)
            .map_or(committed.lines().count().min(fresh.lines().count()), |i| i);
        panic!(
            "include/kvpage.h is stale from line {}: regenerate it with \
             `KVPAGE_BLESS=1 cargo test -p kvpage-c-header`",
            line + 1
        );
    }
}

#[test]
fn the_header_version_macros_are_the_crate_version() {
    let header = std::fs::read_to_string(kvpage_dir().join("include/kvpage.h"))
        .expect("the header is committed");
    // This crate's version is kvpage's: both take the workspace's.
    let manifest =
        std::fs::read_to_string(kvpage_dir().join("Cargo.toml")).expect("kvpage's manifest");
    assert!(
        manifest.contains("\nversion.workspace = true\n"),
        "kvpage's version is no longer the workspace's: compare with it here"
    );
    for (name, want) in [
        ("KVPAGE_VERSION_MAJOR", env!("CARGO_PKG_VERSION_MAJOR")),
        ("KVPAGE_VERSION_MINOR", env!("CARGO_PKG_VERSION_MINOR")),
        ("KVPAGE_VERSION_PATCH", env!("CARGO_PKG_VERSION_PATCH")),
    ] {
        let line = format!("#define {name} {want}\n");
        assert!(header.contains(&line), "header lacks `{}`", line.trim());
    }
}
