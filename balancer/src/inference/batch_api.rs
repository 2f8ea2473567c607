//! The OpenAI Batch API on the inference port: `/v1/files` and
//! `/v1/batches`, kept in the async queue ([`crate::asyncq::batch`]).

use bytes::Bytes;
use http::{Method, StatusCode};
use pingora_proxy::Session;
use serde_json::Value;

use super::async_api::{api_error, parse_limit, query_param, AsyncDoor};
use super::halt::Flow;
use super::Step;
use crate::asyncq::{self, batch::ApiError};
use crate::reply::Answer;

/// OpenAI's bounds on a file's `expires_after[seconds]`: 1 hour to 30 days.
const FILE_EXPIRY_SECONDS: std::ops::RangeInclusive<u64> = 3600..=2_592_000;

/// Files and batches: upload, list, read, delete; create, list, read,
/// cancel.
pub(super) async fn route(
    door: &AsyncDoor<'_>,
    session: &mut Session,
    method: &Method,
    path: &str,
) -> Flow<Step> {
    let queue = std::sync::Arc::clone(door.queue);
    let segs: Vec<String> = path
        .trim_start_matches("/v1/")
        .split('/')
        .map(str::to_string)
        .collect();
    let body = if *method == Method::POST {
        door.read_body(session).await?
    } else {
        Bytes::new()
    };
    let headers = &session.req_header().headers;
    let content_type = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let query = session.req_header().uri.query().unwrap_or("").to_string();
    // A batch's tenant and priority come from its creation request (its
    // lines may name several models: model priorities do not apply).
    let (caller, priority) = door.caller(session, "")?;
    let limit = parse_limit(&query, 20, 100)?;
    let call = BatchCall {
        method: method.clone(),
        segs,
        body,
        content_type,
        query,
        limit,
        caller,
        priority,
    };
    // The store syncs to disk: off the proxy's threads.
    let answer = tokio::task::spawn_blocking(move || call.answer(&queue)).await;
    match answer {
        Ok(Ok((v, None))) => Ok(Step::Answer(Answer::json(
            StatusCode::OK,
            v.to_string().into_bytes(),
        ))),
        Ok(Ok((_, Some(content)))) => Ok(Step::Answer(Answer {
            status: StatusCode::OK,
            content_type: "application/octet-stream",
            body: content,
            headers: Vec::new(),
        })),
        Ok(Err(ApiError(status, code, message))) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            Err(api_error(status, code, message).into())
        }
        Err(e) => Err(api_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "queue_error",
            e.to_string(),
        )
        .into()),
    }
}

/// One Batch API request, read off the connection.
struct BatchCall {
    method: Method,
    /// The path after `/v1/`, split at `/`.
    segs: Vec<String>,
    body: Bytes,
    content_type: String,
    query: String,
    limit: usize,
    caller: asyncq::Caller,
    priority: i32,
}

impl BatchCall {
    /// The answer: JSON, or a file's bytes.
    fn answer(
        self,
        queue: &std::sync::Arc<asyncq::AsyncQueue>,
    ) -> Result<(Value, Option<Vec<u8>>), ApiError> {
        let BatchCall {
            method,
            segs,
            body,
            content_type,
            query,
            limit,
            caller,
            priority,
        } = self;
        let segs: Vec<&str> = segs.iter().map(String::as_str).collect();
        let bad = |m: String| ApiError(400, "invalid_request", m);
        match (&method, segs.as_slice()) {
            (&Method::POST, ["files"]) => {
                let parts =
                    flowgate::multipart::parse_multipart(&content_type, &body).map_err(bad)?;
                let field = |name: &str| parts.iter().find(|p| p.name == name);
                let text = |name: &str| {
                    field(name).map(|p| String::from_utf8_lossy(p.data).trim().to_string())
                };
                let file = field("file").ok_or_else(|| bad("the form has no file field".into()))?;
                let purpose =
                    text("purpose").ok_or_else(|| bad("the form has no purpose field".into()))?;
                let expires_after = parse_file_expiry(
                    text("expires_after[anchor]").as_deref(),
                    text("expires_after[seconds]").as_deref(),
                )?;
                let name = file
                    .filename
                    .clone()
                    .unwrap_or_else(|| "upload.jsonl".into());
                let meta = queue.create_file(&name, &purpose, file.data, expires_after, &caller)?;
                Ok((meta.view(), None))
            }
            (&Method::GET, ["files"]) => Ok((queue.list_files(limit, &caller)?, None)),
            (&Method::GET, ["files", id]) => Ok((queue.file_meta(id, &caller)?.view(), None)),
            (&Method::DELETE, ["files", id]) => Ok((queue.delete_file(id, &caller)?, None)),
            (&Method::GET, ["files", id, "content"]) => {
                Ok((Value::Null, Some(queue.file_content(id, &caller)?)))
            }
            (&Method::POST, ["batches"]) => {
                let v: Value = serde_json::from_slice(&body)
                    .map_err(|e| bad(format!("the body is not JSON: {e}")))?;
                let field = |k: &str| {
                    v[k].as_str()
                        .map(str::to_string)
                        .ok_or_else(|| bad(format!("{k} is required")))
                };
                let batch = queue.create_batch(
                    &field("input_file_id")?,
                    &field("endpoint")?,
                    &field("completion_window")?,
                    v.get("metadata").cloned().filter(|m| !m.is_null()),
                    &caller,
                    priority,
                )?;
                Ok((batch, None))
            }
            (&Method::GET, ["batches"]) => {
                let after = query_param(&query, "after");
                Ok((queue.list_batches(limit, after.as_deref(), &caller)?, None))
            }
            (&Method::GET, ["batches", id]) => Ok((queue.batch(id, &caller)?, None)),
            (&Method::POST, ["batches", id, "cancel"]) => {
                Ok((queue.cancel_batch(id, &caller)?, None))
            }
            _ => Err(ApiError(
                404,
                "not_found",
                format!("no route for {method} /v1/{}", segs.join("/")),
            )),
        }
    }
}

/// A file's `expires_after` form fields (`anchor` must be `created_at`).
fn parse_file_expiry(anchor: Option<&str>, seconds: Option<&str>) -> Result<Option<u64>, ApiError> {
    let bad = |m: String| ApiError(400, "invalid_expires_after", m);
    match (anchor, seconds) {
        (None, None) => Ok(None),
        (Some("created_at"), Some(s)) => s
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|n| FILE_EXPIRY_SECONDS.contains(n))
            .map(Some)
            .ok_or_else(|| {
                bad(format!(
                    "expires_after[seconds] must be {} to {}",
                    FILE_EXPIRY_SECONDS.start(),
                    FILE_EXPIRY_SECONDS.end()
                ))
            }),
        _ => Err(bad(
            "expires_after needs anchor \"created_at\" and seconds".into()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn file_expiry_is_bounded() {
        assert_eq!(parse_file_expiry(None, None), Ok(None));
        assert_eq!(
            parse_file_expiry(Some("created_at"), Some("3600")),
            Ok(Some(3600))
        );
        for bad in ["0", "-1", "2592001", "1e9", "18446744073709551616"] {
            assert!(parse_file_expiry(Some("created_at"), Some(bad)).is_err());
        }
        assert!(parse_file_expiry(Some("last_active_at"), Some("3600")).is_err());
        assert!(parse_file_expiry(None, Some("3600")).is_err());
    }

    proptest! {
        #[test]
        fn any_file_expiry_parses_or_is_refused(v in ".{0,40}") {
            let _ = parse_file_expiry(Some("created_at"), Some(&v));
        }
    }
}
