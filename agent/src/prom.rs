//! A small parser for the Prometheus text exposition format (version 0.0.4),
//! enough to read engine metrics: `name{label="value",...} number [ts]`.

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    /// The value of its label `name`, if it has one.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Parses every sample line; comment lines and malformed lines are skipped
/// (a scrape must not fail because of one odd line).
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter_map(parse_line).collect()
}

/// The first sample named `name`, if any.
pub fn first(samples: &[Sample], name: &str) -> Option<f64> {
    samples.iter().find(|s| s.name == name).map(|s| s.value)
}

/// The sum of every sample named `name` (e.g. over vLLM's data-parallel
/// `engine` labels); `None` when there is none.
pub fn sum(samples: &[Sample], name: &str) -> Option<f64> {
    samples
        .iter()
        .filter(|s| s.name == name)
        .map(|s| s.value)
        .reduce(|a, b| a + b)
}

/// The largest sample named `name`; `None` when there is none.
pub fn max(samples: &[Sample], name: &str) -> Option<f64> {
    samples
        .iter()
        .filter(|s| s.name == name)
        .map(|s| s.value)
        .reduce(f64::max)
}

/// A gauge read as a count: negatives and NaN are 0, huge values saturate.
pub fn to_count(v: f64) -> u32 {
    if v.is_nan() || v <= 0.0 {
        0
    } else {
        v.min(f64::from(u32::MAX)) as u32
    }
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, remaining) = parse_labels(after)?;
        labels = parsed;
        rest = remaining;
    }
    let value_str = rest.split_whitespace().next()?;
    let value = match value_str {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// Parses `k="v",k2="v2"}` and returns the labels and the text after `}`.
fn parse_labels(mut s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start_matches([' ', ',']);
        if let Some(after) = s.strip_prefix('}') {
            return Some((labels, after));
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim().to_string();
        s = s[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break i,
                c => value.push(c),
            }
        };
        labels.push((key, value));
        s = &s[end + 1..];
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn fixture(path: &str) -> String {
        let full = format!("{}/fixtures/{path}", env!("CARGO_MANIFEST_DIR"));
        let raw = std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"));
        // Fixtures are raw HTTP responses: keep the body.
        match raw
            .split_once("\r\n\r\n")
            .or_else(|| raw.split_once("\n\n"))
        {
            Some((_, body)) if raw.starts_with("HTTP/") => body.to_string(),
            _ => raw,
        }
    }

    #[test]
    fn parses_names_labels_and_values() {
        let s = parse(
            "# HELP x y\n# TYPE x gauge\nx 3\nvllm:num_requests_running{engine=\"0\",model_name=\"a \\\"q\\\"\"} 2.5 1700000000\nbad line here\n+Inf\nh_bucket{le=\"+Inf\"} +Inf\n",
        );
        assert_eq!(first(&s, "x"), Some(3.0));
        let v = s
            .iter()
            .find(|s| s.name == "vllm:num_requests_running")
            .unwrap();
        assert_eq!(v.value, 2.5);
        assert_eq!(v.labels[1], ("model_name".into(), "a \"q\"".into()));
        assert_eq!(first(&s, "h_bucket"), Some(f64::INFINITY));
        assert_eq!(s.len(), 3);
    }

    #[test]
    fn reads_the_llamacpp_fixtures() {
        let busy = parse(&fixture("llamacpp/metrics_busy.txt"));
        assert_eq!(first(&busy, "llamacpp:requests_processing"), Some(4.0));
        assert!(first(&busy, "llamacpp:requests_deferred").is_some());
        let idle = parse(&fixture("llamacpp/metrics_idle.txt"));
        assert_eq!(first(&idle, "llamacpp:requests_processing"), Some(0.0));
    }

    #[test]
    fn reads_the_vllm_and_sglang_fixtures() {
        let v = parse(&fixture("vllm/metrics.txt"));
        assert!(first(&v, "vllm:num_requests_running").is_some());
        let s = parse(&fixture("sglang/metrics.txt"));
        assert!(first(&s, "sglang:num_running_reqs").is_some());
    }
}
