//! Request traces in the Azure LLM inference trace format.
//!
//! A trace is a CSV file with the header `TIMESTAMP,ContextTokens,GeneratedTokens` and one
//! request per line: its arrival time, its prompt length and its output length in tokens.
//! `TIMESTAMP` is either a date and time, `YYYY-MM-DD HH:MM:SS[.fraction]` (as in the
//! Azure files), or a plain number of seconds (handy for hand-made traces). Arrival times
//! are returned relative to the earliest request, sorted (stable) by arrival.
//!
//! Errors name the line: a line that is not three fields, a timestamp or a count that does
//! not parse is a [`TraceError`]. A well-formed request that cannot be replayed (no prompt
//! or no output token) is not an error: it is listed in [`Trace::skipped`] and left out.
//!
//! The module needs only `std` and nothing else of this crate: the `trace_parser` fuzz
//! target (examples/fuzz) compiles this file on its own.

use std::fmt;
use std::path::Path;

/// One request of a trace.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Request {
    /// Position in [`Trace::requests`] (after sorting by arrival).
    pub id: u32,
    /// 1-based line of the file it came from, for messages.
    pub line: usize,
    /// Arrival time in seconds after the earliest request of the trace.
    pub arrival_s: f64,
    /// Prompt tokens (`ContextTokens`), at least 1.
    pub prompt_tokens: u32,
    /// Output tokens to generate (`GeneratedTokens`), at least 1.
    pub output_tokens: u32,
}

impl Request {
    /// Prompt plus output tokens: what a request needs room for (`max_seq_len` check).
    pub fn total_tokens(&self) -> u64 {
        u64::from(self.prompt_tokens) + u64::from(self.output_tokens)
    }
}

/// A request that was read but left out, with the reason.
#[derive(Clone, Debug, PartialEq)]
pub struct Skipped {
    /// 1-based line in the file.
    pub line: usize,
    /// Why it was left out.
    pub reason: String,
}

/// A parsed trace.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    /// Requests sorted by arrival, ids renumbered `0..len`.
    pub requests: Vec<Request>,
    /// Well-formed lines that cannot be replayed.
    pub skipped: Vec<Skipped>,
}

/// Why a trace could not be read.
#[derive(Debug)]
pub enum TraceError {
    /// The file could not be read.
    Io {
        /// The path as given.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A line is malformed.
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        what: String,
    },
    /// No request at all.
    Empty,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceError::Io { path, source } => write!(f, "cannot read trace {path}: {source}"),
            TraceError::Line { line, what } => write!(f, "trace line {line}: {what}"),
            TraceError::Empty => write!(f, "the trace holds no request"),
        }
    }
}

impl std::error::Error for TraceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TraceError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Reads and parses the trace at `path`. O(lines · log lines).
///
/// # Errors
/// [`TraceError::Io`] if the file cannot be read, otherwise as [`parse_trace`].
pub fn load_trace(path: &Path) -> Result<Trace, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse_trace(&text)
}

/// Parses a whole trace. A first line whose first field is not a timestamp is taken as
/// the header; blank lines are ignored; `\r\n` line ends are accepted. O(n log n).
///
/// # Errors
/// [`TraceError::Line`] for the first malformed line, [`TraceError::Empty`] if there is
/// no request line at all (skipped requests do not count as errors).
pub fn parse_trace(text: &str) -> Result<Trace, TraceError> {
    let mut raw: Vec<(f64, Request)> = Vec::new();
    let mut skipped = Vec::new();
    let mut seen_first = false;
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let first = !seen_first;
        seen_first = true;
        if first && parse_timestamp(fields[0]).is_none() {
            continue; // header
        }
        let err = |what: String| TraceError::Line {
            line: line_no,
            what,
        };
        if fields.len() != 3 {
            return Err(err(format!(
                "expected 3 comma-separated fields (TIMESTAMP,ContextTokens,GeneratedTokens), found {}",
                fields.len()
            )));
        }
        let t = parse_timestamp(fields[0]).ok_or_else(|| {
            err(format!(
                "TIMESTAMP {:?} is neither `YYYY-MM-DD HH:MM:SS[.fraction]` nor a number of seconds",
                fields[0]
            ))
        })?;
        let count = |col: &str, s: &str| {
            s.parse::<u32>().map_err(|_| {
                err(format!(
                    "{col} {s:?} is not a whole number of tokens (0..=4294967295)"
                ))
            })
        };
        let prompt = count("ContextTokens", fields[1])?;
        let output = count("GeneratedTokens", fields[2])?;
        if prompt == 0 || output == 0 {
            skipped.push(Skipped {
                line: line_no,
                reason: format!(
                    "{} is 0 (a request needs at least one prompt and one output token)",
                    if prompt == 0 {
                        "ContextTokens"
                    } else {
                        "GeneratedTokens"
                    }
                ),
            });
            continue;
        }
        raw.push((
            t,
            Request {
                id: 0,
                line: line_no,
                arrival_s: 0.0,
                prompt_tokens: prompt,
                output_tokens: output,
            },
        ));
    }
    if raw.is_empty() && skipped.is_empty() {
        return Err(TraceError::Empty);
    }
    raw.sort_by(|a, b| a.0.total_cmp(&b.0));
    let t0 = raw.first().map_or(0.0, |r| r.0);
    let requests = raw
        .into_iter()
        .enumerate()
        .map(|(i, (t, r))| Request {
            id: i as u32,
            arrival_s: t - t0,
            ..r
        })
        .collect();
    Ok(Trace { requests, skipped })
}

/// Seconds since 1970-01-01 (proleptic Gregorian, no time zone) of
/// `YYYY-MM-DD HH:MM:SS[.fraction]` (a `T` may separate date and time), or a plain
/// non-negative number of seconds. `None` if it is neither.
pub fn parse_timestamp(s: &str) -> Option<f64> {
    if let Ok(x) = s.parse::<f64>() {
        return (x.is_finite() && x >= 0.0).then_some(x);
    }
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut d = date.split('-');
    let y: i64 = d.next()?.parse().ok()?;
    let mo: u32 = d.next()?.parse().ok()?;
    let day: u32 = d.next()?.parse().ok()?;
    // A four-digit year, as the format says: larger ones overflowed the day count.
    if d.next().is_some()
        || !(0..=9999).contains(&y)
        || !(1..=12).contains(&mo)
        || !(1..=31).contains(&day)
    {
        return None;
    }
    let mut t = time.split(':');
    let h: u32 = t.next()?.parse().ok()?;
    let mi: u32 = t.next()?.parse().ok()?;
    let sec_str = t.next()?;
    if t.next().is_some() || h > 23 || mi > 59 {
        return None;
    }
    if !sec_str.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return None;
    }
    let sec: f64 = sec_str.parse().ok()?;
    if !(0.0..61.0).contains(&sec) {
        return None;
    }
    let days = days_from_civil(y, mo, day);
    Some(days as f64 * 86_400.0 + f64::from(h * 3600 + mi * 60) + sec)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The excerpt of the Azure conversation trace shipped in `examples/traces/`.
pub fn shipped_excerpt_path() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("traces")
        .join("azure-conv-excerpt.csv")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_azure_rows_relative_to_first_and_across_midnight() {
        let t = parse_trace(
            "TIMESTAMP,ContextTokens,GeneratedTokens\r\n\
             2023-11-16 23:59:59.5000000,374,44\r\n\
             2023-11-17 00:00:01.2500000,396,109\n",
        )
        .unwrap();
        assert_eq!(t.requests.len(), 2);
        assert_eq!(t.requests[0].arrival_s, 0.0);
        assert!((t.requests[1].arrival_s - 1.75).abs() < 1e-6);
        assert_eq!(t.requests[1].prompt_tokens, 396);
        assert_eq!(t.requests[1].output_tokens, 109);
        assert_eq!(t.requests[1].line, 3);
        assert_eq!(t.requests[1].total_tokens(), 505);
    }

    #[test]
    fn numeric_timestamps_are_sorted_and_renumbered() {
        let t = parse_trace("5,10,1\n2,20,2\n\n3,30,3").unwrap();
        let got: Vec<(u32, f64, u32, usize)> = t
            .requests
            .iter()
            .map(|r| (r.id, r.arrival_s, r.prompt_tokens, r.line))
            .collect();
        assert_eq!(got, vec![(0, 0.0, 20, 2), (1, 1.0, 30, 4), (2, 3.0, 10, 1)]);
    }

    #[test]
    fn malformed_lines_name_the_line() {
        let e = parse_trace("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n2,3\n").unwrap_err();
        assert!(matches!(e, TraceError::Line { line: 3, .. }), "{e}");
        assert!(e.to_string().starts_with("trace line 3: expected 3"));
        let e = parse_trace("h\n1,2,3\n2,x,3\n").unwrap_err();
        assert!(e.to_string().contains("line 3") && e.to_string().contains("ContextTokens"));
        let e = parse_trace("h\n1,2,-3\n").unwrap_err();
        assert!(e.to_string().contains("GeneratedTokens"));
        let e = parse_trace("h\n1,2,3\n2023-13-01 00:00:00,1,1\n").unwrap_err();
        assert!(e.to_string().contains("line 3") && e.to_string().contains("TIMESTAMP"));
        assert!(matches!(
            parse_trace("TIMESTAMP,a,b\n"),
            Err(TraceError::Empty)
        ));
        assert!(matches!(parse_trace(""), Err(TraceError::Empty)));
    }

    #[test]
    fn zero_token_requests_are_skipped_and_reported() {
        let t = parse_trace("0,0,5\n1,5,0\n2,5,5\n").unwrap();
        assert_eq!(t.requests.len(), 1);
        assert_eq!(t.skipped.len(), 2);
        assert_eq!(t.skipped[0].line, 1);
        assert!(t.skipped[1].reason.contains("GeneratedTokens"));
    }

    #[test]
    fn timestamp_forms() {
        assert_eq!(parse_timestamp("1970-01-01 00:00:00"), Some(0.0));
        assert_eq!(parse_timestamp("1970-01-02T00:00:01.5"), Some(86_401.5));
        assert_eq!(parse_timestamp("2000-03-01 00:00:00"), Some(951_868_800.0));
        assert_eq!(parse_timestamp("12.5"), Some(12.5));
        assert_eq!(parse_timestamp("-1"), None);
        assert_eq!(parse_timestamp("2023-11-16 25:00:00"), None);
        assert_eq!(parse_timestamp("TIMESTAMP"), None);
    }

    /// Found by the `trace_parser` fuzz target: a year of more than four digits
    /// overflowed the day count (a panic in debug builds, a wrong time in release).
    #[test]
    fn years_past_four_digits_are_refused() {
        assert_eq!(
            parse_timestamp("9999-12-31 23:59:59"),
            Some(253_402_300_799.0)
        );
        assert_eq!(parse_timestamp("10000-01-01 00:00:00"), None);
        assert_eq!(parse_timestamp("9223372036854775807-01-01 00:00:00"), None);
        assert_eq!(parse_timestamp("+99999999999999-03-01 00:00:00"), None);
        let e = parse_trace("h\n1,2,3\n99999999999999-01-01 00:00:00,1,1\n").unwrap_err();
        assert!(matches!(e, TraceError::Line { line: 3, .. }), "{e}");
    }

    #[test]
    fn shipped_excerpt_parses_completely() {
        let t = load_trace(&shipped_excerpt_path()).unwrap();
        assert_eq!(t.requests.len() + t.skipped.len(), 2500);
        let last = t.requests.last().unwrap();
        assert!(
            (last.arrival_s - 527.339_592).abs() < 1e-3,
            "{}",
            last.arrival_s
        );
    }
}
