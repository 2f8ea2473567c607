//! Durations as people write them in flags, config files and headers: one
//! parser for all of them.

use std::time::Duration;

/// Units, longest suffix first (`ms` before `m` and `s`).
const UNITS: [(&str, u64); 5] = [
    ("ms", 1),
    ("s", 1_000),
    ("m", 60_000),
    ("h", 3_600_000),
    ("d", 86_400_000),
];

/// Parses a duration: a whole number with a unit, `250ms`, `10s`, `2m`,
/// `1h`, `7d`, or a bare number of milliseconds. Negative, fractional and
/// overflowing values are errors.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (digits, unit_ms) = UNITS
        .iter()
        .find_map(|(suffix, ms)| s.strip_suffix(suffix).map(|d| (d, *ms)))
        .unwrap_or((s, 1));
    let digits = digits.trim();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "{s:?} is not a duration (e.g. 250ms, 10s, 2m, 1h, 7d)"
        ));
    }
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(unit_ms))
        .map(Duration::from_millis)
        .ok_or_else(|| format!("{s:?} is too long"))
}

/// [`parse_duration`], refusing anything longer than `max`.
pub fn parse_duration_at_most(s: &str, max: Duration) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d > max {
        return Err(format!(
            "{:?} is longer than the maximum of {}",
            s.trim(),
            show(max)
        ));
    }
    Ok(d)
}

/// A duration in the largest unit that shows it whole (`90s`, `1h`, `30d`).
pub fn show(d: Duration) -> String {
    let ms = d.as_millis();
    UNITS
        .iter()
        .rev()
        .find(|(_, unit)| ms % u128::from(*unit) == 0 && ms > 0)
        .map_or_else(
            || "0ms".to_string(),
            |(suffix, unit)| format!("{}{suffix}", ms / u128::from(*unit)),
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn units_and_bare_milliseconds() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration(" 10s "), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_duration("50"), Ok(Duration::from_millis(50)));
        for bad in [
            "",
            "fast",
            "2w",
            "-5",
            "-5s",
            "+5s",
            "1.5s",
            "s",
            "ms",
            "99999999999999999999m",
            "18446744073709551615d",
            "1h30m",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_maximum_is_stated_and_kept() {
        let max = Duration::from_secs(3600);
        assert_eq!(parse_duration_at_most("1h", max), Ok(max));
        let err = parse_duration_at_most("61m", max).unwrap_err();
        assert!(err.contains("maximum of 1h"), "{err}");
        assert_eq!(show(Duration::from_secs(90)), "90s");
        assert_eq!(show(Duration::from_secs(30 * 86_400)), "30d");
        assert_eq!(show(Duration::from_millis(1500)), "1500ms");
    }

    proptest! {
        #[test]
        fn any_text_parses_or_is_refused(s in ".{0,30}") {
            let _ = parse_duration(&s);
        }

        #[test]
        fn shown_durations_parse_back(ms in 0u64..10_000_000_000) {
            let d = Duration::from_millis(ms);
            prop_assert_eq!(parse_duration(&show(d)), Ok(d));
        }
    }
}
