//! `strftime_now(format)` for chat templates that print today's date
//! (Llama 3's): the directives those templates use, in UTC (an engine's
//! container clock); any other directive fails the render, which leaves
//! the request to the engine.

use std::time::{SystemTime, UNIX_EPOCH};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

pub fn now(format: &str) -> Result<String, String> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_err(|e| e.to_string())?
        .as_secs();
    format_at(format, secs)
}

/// `format` at `secs` after the Unix epoch, UTC.
pub fn format_at(format: &str, secs: u64) -> Result<String, String> {
    let days = (secs / 86_400) as i64;
    let of_day = secs % 86_400;
    let (year, month, day) = civil(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{:02}", of_day / 3600)),
            Some('M') => out.push_str(&format!("{:02}", of_day / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", of_day % 60)),
            Some('%') => out.push('%'),
            other => {
                return Err(format!(
                    "strftime_now: %{} is not supported",
                    other.unwrap_or(' ')
                ))
            }
        }
    }
    Ok(out)
}

/// (year, month 1..=12, day 1..=31) of a day counted from 1970-01-01
/// (Howard Hinnant's days-to-civil).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_read_as_python_writes_them() {
        // 2024-07-26 14:05:09 UTC, a Friday.
        let at = 1_722_002_709;
        assert_eq!(format_at("%d %b %Y", at).unwrap(), "26 Jul 2024");
        assert_eq!(
            format_at("%A %B %e, %y %H:%M:%S %%", at).unwrap(),
            "Friday July 26, 24 14:05:09 %"
        );
        assert_eq!(format_at("%Y-%m-%d", 0).unwrap(), "1970-01-01");
        // A leap day, and the day after.
        assert_eq!(
            format_at("%Y-%m-%d %a", 951_782_400).unwrap(),
            "2000-02-29 Tue"
        );
        assert_eq!(format_at("%Y-%m-%d", 951_868_800).unwrap(), "2000-03-01");
        assert!(format_at("%Z", at).unwrap_err().contains("%Z"));
    }
}
