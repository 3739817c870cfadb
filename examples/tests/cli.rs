//! The binaries end to end: bad input is an error message and exit code 2, never a panic.

use std::process::Command;

fn replay(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_replay"))
        .args(args)
        .output()
        .expect("run replay");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_flags_and_traces_exit_2_with_a_message() {
    let (code, _, err) = replay(&["--model", "nope"]);
    assert_eq!(code, 2);
    assert!(
        err.starts_with("error: --model \"nope\" is not a known preset"),
        "{err}"
    );
    let dir = std::env::temp_dir().join(format!("kvpage-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("t.csv");
    std::fs::write(&p, "TIMESTAMP,ContextTokens,GeneratedTokens\n0,1,1\n1,2\n").unwrap();
    let (code, _, err) = replay(&["--trace", p.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(
        err.contains("trace line 3: expected 3 comma-separated fields"),
        "{err}"
    );
    assert!(!err.contains("panicked"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_small_replay_prints_the_table() {
    let (code, out, err) = replay(&["--limit", "200", "--quiet"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("contiguous") && out.contains("paged-swap"));
    assert!(out.contains("replay wall time"));
    assert!(err.is_empty(), "--quiet prints nothing on stderr: {err}");
}

#[test]
fn incident_runs() {
    let out = Command::new(env!("CARGO_BIN_EXE_incident"))
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("admitted in step 1"));
}

#[test]
fn long_chat_shifts_saves_restores_and_continues_identically() {
    let out = Command::new(env!("CARGO_BIN_EXE_long_chat"))
        .output()
        .expect("run long_chat");
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}\n{err}");
    assert!(err.is_empty(), "{err}");
    // Past the per-sequence capacity, by context shift, without recomputing a token.
    assert!(
        text.contains("tokens recomputed: 0 (recompute on overflow: "),
        "{text}"
    );
    let processed: u32 = text
        .split_once("turns, ")
        .and_then(|(_, rest)| rest.split_once(" tokens processed through a 256-token"))
        .and_then(|(n, _)| n.parse().ok())
        .expect("the conversation line");
    assert!(processed > 3 * 256, "{processed} tokens processed");
    assert!(text.contains("tolerance 1e-4) ok"), "{text}");
    assert!(text.contains("refused (blob was saved for another model fingerprint)"));
    assert!(text
        .contains("continued the restore from the buffer: identical tokens, bit-identical logits"));
    assert!(text
        .contains("continued the restore from the file: identical tokens, bit-identical logits"));
    assert!(text.contains("long_chat: all checks passed"));
}

#[test]
fn a_fleet_replay_prints_both_routers() {
    let (code, out, err) = replay(&[
        "--limit",
        "300",
        "--quiet",
        "--replicas",
        "3",
        "--shared-prefix-tokens",
        "1024",
        "--prefix-groups",
        "16",
        "--kv-budget-gb",
        "8",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("fleet:   3 replicas of paged-prefix"), "{out}");
    for row in [
        "round-robin",
        "prefix-aware",
        "prefix hit tokens",
        "TTFT p99 (s)",
    ] {
        assert!(out.contains(row), "{row}: {out}");
    }
    assert!(out.contains("96/96/96"), "round-robin splits evenly: {out}");
    let (code, _, err) = replay(&["--replicas", "2", "--router", "random"]);
    assert_eq!(code, 2);
    assert!(err.contains("--router: unknown router \"random\""), "{err}");
    let (code, _, err) = replay(&["--replicas", "0"]);
    assert_eq!(code, 2);
    assert!(err.contains("--replicas"), "{err}");
}
