//! Arbitrary bytes into the trace parser: no panic, and a parsed trace keeps the
//! documented invariants — requests sorted by arrival (relative to the earliest, so the
//! first is at 0, all finite and non-negative) and renumbered `0..len`, every request
//! with at least one prompt and one output token, every line number (requests and
//! skipped ones) a real line of the input, each line used at most once; `Empty` only for
//! an input without a request line; a line error names a real line. Timestamps alone
//! go through `parse_timestamp`: `None` or a finite, non-negative-for-numbers value.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The parser's own source file, compiled into this target: it needs only `std`, and
// depending on `kvpage-examples` built its whole graph (kvpage, clap, serde) for it.
#[allow(dead_code)]
#[path = "../../src/trace.rs"]
mod trace;

use trace::{parse_timestamp, parse_trace, TraceError};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let lines = text.lines().count();
    for field in text.split([',', '\n']) {
        if let Some(t) = parse_timestamp(field.trim()) {
            assert!(t.is_finite(), "{field:?} -> {t}");
        }
    }
    match parse_trace(text) {
        Ok(trace) => {
            assert!(!trace.requests.is_empty() || !trace.skipped.is_empty());
            let mut used = std::collections::HashSet::new();
            for (i, r) in trace.requests.iter().enumerate() {
                assert_eq!(r.id as usize, i, "ids renumbered in order");
                assert!(r.prompt_tokens >= 1 && r.output_tokens >= 1);
                assert!(r.arrival_s.is_finite() && r.arrival_s >= 0.0, "{r:?}");
                assert!(r.line >= 1 && r.line <= lines, "{r:?} of {lines} lines");
                assert!(used.insert(r.line), "line {} used twice", r.line);
                assert_eq!(
                    r.total_tokens(),
                    u64::from(r.prompt_tokens) + u64::from(r.output_tokens)
                );
            }
            if let Some(first) = trace.requests.first() {
                assert_eq!(first.arrival_s, 0.0, "arrivals relative to the earliest");
            }
            for w in trace.requests.windows(2) {
                assert!(w[0].arrival_s <= w[1].arrival_s, "sorted by arrival: {w:?}");
            }
            for s in &trace.skipped {
                assert!(s.line >= 1 && s.line <= lines);
                assert!(used.insert(s.line), "line {} used twice", s.line);
                assert!(!s.reason.is_empty());
            }
            // The Display of each error and the parse are deterministic.
            let again = parse_trace(text).expect("parses again");
            assert_eq!(again.requests, trace.requests);
            assert_eq!(again.skipped, trace.skipped);
        }
        Err(TraceError::Line { line, what }) => {
            assert!(
                line >= 1 && line <= lines,
                "error at line {line} of {lines}"
            );
            assert!(!what.is_empty());
        }
        Err(TraceError::Empty) => {
            assert!(text.lines().filter(|l| !l.trim().is_empty()).count() <= 1);
        }
        Err(e @ TraceError::Io { .. }) => panic!("no I/O in a parse: {e}"),
    }
});
