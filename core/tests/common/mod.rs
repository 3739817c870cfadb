//! Shared by the core's property tests.

use proptest::test_runner::Config as ProptestConfig;

/// `cases` random cases natively; under Miri one (it runs each case thousands of
/// times slower), and no failure persistence, which would read and write regression
/// files that Miri's isolation forbids.
pub fn proptest_config(cases: u32) -> ProptestConfig {
    if cfg!(miri) {
        ProptestConfig {
            cases: 1,
            failure_persistence: None,
            ..ProptestConfig::default()
        }
    } else {
        // `PROPTEST_CASES` overrides the count for longer local searches.
        let cases = std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(cases);
        ProptestConfig {
            cases,
            ..ProptestConfig::default()
        }
    }
}

/// The longest operation sequence a property test draws: `native` natively, at most 15
/// under Miri.
pub fn max_ops(native: usize) -> usize {
    if cfg!(miri) {
        native.min(15)
    } else {
        native
    }
}
