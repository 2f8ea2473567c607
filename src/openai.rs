//! OpenAI-compatible error bodies: `{"error":{"message","type","code"}}`.

use serde::Serialize;

#[derive(Debug, Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Debug, Serialize)]
struct ErrorDetail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    code: &'a str,
}

/// Serialises an error body. `kind` is the OpenAI error type (for example
/// `invalid_request_error`), `code` a stable machine-readable code.
pub fn error_body(message: &str, kind: &str, code: &str) -> Vec<u8> {
    serde_json::to_vec(&ErrorBody {
        error: ErrorDetail {
            message,
            kind,
            code,
        },
    })
    .expect("error body serialises")
}

#[cfg(test)]
mod tests {
    #[test]
    fn body_has_the_openai_shape() {
        let v: serde_json::Value = serde_json::from_slice(&super::error_body(
            "too \"big\"",
            "invalid_request_error",
            "x",
        ))
        .unwrap();
        assert_eq!(v["error"]["message"], "too \"big\"");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "x");
    }
}
