//! Envoy's side of the external-processing stream: the messages Envoy's
//! `ext_proc` filter sends for one HTTP request, built as Envoy builds them.
//! Shared by the EPP tests (`tests/epp.rs`) and the EPP load generator
//! (`loadgen epp`).

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, HttpBody, HttpHeaders, ProcessingRequest,
};

/// Headers as Envoy sends them: the value in `raw_value`, `value` empty.
pub fn header_map(pairs: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: k.to_string(),
                value: String::new(),
                raw_value: v.as_bytes().to_vec(),
            })
            .collect(),
    }
}

pub fn message(r: processing_request::Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(r),
        ..ProcessingRequest::default()
    }
}

/// The request headers of a `POST /v1/chat/completions` with JSON body,
/// plus `extra`.
pub fn request_headers(extra: &[(&str, &str)], end_of_stream: bool) -> ProcessingRequest {
    let mut pairs = vec![
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (":authority", "llm.example"),
        ("content-type", "application/json"),
    ];
    pairs.extend_from_slice(extra);
    message(processing_request::Request::RequestHeaders(HttpHeaders {
        headers: Some(header_map(&pairs)),
        end_of_stream,
        ..HttpHeaders::default()
    }))
}

/// A request (`RequestBody`) or response (`ResponseBody`) body message.
fn body_of(
    kind: fn(HttpBody) -> processing_request::Request,
    body: Vec<u8>,
    end_of_stream: bool,
) -> ProcessingRequest {
    message(kind(HttpBody {
        body,
        end_of_stream,
        ..HttpBody::default()
    }))
}

pub fn body_message(body: Vec<u8>, end_of_stream: bool) -> ProcessingRequest {
    body_of(
        processing_request::Request::RequestBody,
        body,
        end_of_stream,
    )
}

pub fn response_headers(status: u16, end_of_stream: bool) -> ProcessingRequest {
    let status = status.to_string();
    message(processing_request::Request::ResponseHeaders(HttpHeaders {
        headers: Some(header_map(&[(":status", &status)])),
        end_of_stream,
        ..HttpHeaders::default()
    }))
}

pub fn response_body(body: Vec<u8>, end_of_stream: bool) -> ProcessingRequest {
    body_of(
        processing_request::Request::ResponseBody,
        body,
        end_of_stream,
    )
}
