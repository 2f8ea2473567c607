//! Durations as people write them in flags, config files and headers.

use std::time::Duration;

/// Parses a duration: `250ms`, `10s`, `2m`, or a bare number of
/// milliseconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (digits, unit_ms) = if let Some(d) = s.strip_suffix("ms") {
        (d, 1)
    } else if let Some(d) = s.strip_suffix('s') {
        (d, 1_000)
    } else if let Some(d) = s.strip_suffix('m') {
        (d, 60_000)
    } else {
        (s, 1)
    };
    let n: u64 = digits
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (e.g. 250ms, 10s, 2m)"))?;
    n.checked_mul(unit_ms)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("{s:?} is too long"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_bare_milliseconds() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration(" 10s "), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("50"), Ok(Duration::from_millis(50)));
        for bad in ["", "fast", "2h", "-5", "1.5s", "99999999999999999999m"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }
}
