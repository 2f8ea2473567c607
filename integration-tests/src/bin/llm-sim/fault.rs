//! The faults llm-sim applies to inference requests (`--fault`, or a
//! request's `x-sim-fault` header).

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Fault {
    Status(u16),
    Reject(u16),
    Hang,
    DropMidStream,
    SlowStream,
}

pub(crate) fn parse_fault(s: &str) -> Option<Fault> {
    match s.trim() {
        "hang" => Some(Fault::Hang),
        "drop-mid-stream" => Some(Fault::DropMidStream),
        "slow-stream" => Some(Fault::SlowStream),
        other => {
            if let Some(code) = other.strip_prefix("reject=") {
                return code.parse().ok().map(Fault::Reject);
            }
            other
                .strip_prefix("status=")
                .and_then(|c| c.parse().ok())
                .map(Fault::Status)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse() {
        assert_eq!(parse_fault("status=503"), Some(Fault::Status(503)));
        assert_eq!(parse_fault("hang"), Some(Fault::Hang));
        assert_eq!(parse_fault("drop-mid-stream"), Some(Fault::DropMidStream));
        assert_eq!(parse_fault("nonsense"), None);
    }
}
