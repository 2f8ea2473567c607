//! Envoy's side of the external-processing stream: the messages Envoy's
//! `ext_proc` filter sends for one HTTP request, built as Envoy builds them.
//! Shared by the EPP tests (`tests/epp.rs`) and the EPP load generator
//! (`loadgen epp`), with readers of what the EPP answers (each panics on an
//! answer of the wrong shape: they serve tests).

use std::collections::HashMap;
use std::net::SocketAddr;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, processing_response, CommonResponse, HeaderMutation, HttpBody, HttpHeaders,
    ImmediateResponse, ProcessingRequest, ProcessingResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value as PbValue};
use serde_json::Value;

/// The header (and `envoy.lb` metadata key) that names the destination.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";

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

/// `m` with an Envoy subset hint naming these endpoints (`envoy.lb.subset_hint`).
pub fn with_subset(mut m: ProcessingRequest, subset: &[&str]) -> ProcessingRequest {
    let list = PbValue {
        kind: Some(Kind::ListValue(ListValue {
            values: subset
                .iter()
                .map(|s| PbValue {
                    kind: Some(Kind::StringValue(s.to_string())),
                })
                .collect(),
        })),
    };
    m.metadata_context = Some(Metadata {
        filter_metadata: HashMap::from([(
            "envoy.lb.subset_hint".to_string(),
            Struct {
                fields: HashMap::from([(
                    "x-gateway-destination-endpoint-subset".to_string(),
                    list,
                )]),
            },
        )]),
        ..Metadata::default()
    });
    m
}

/// The common part of an answer that carries the destination.
pub fn common_of(r: &ProcessingResponse) -> &CommonResponse {
    match r.response.as_ref() {
        Some(processing_response::Response::RequestBody(b)) => b.response.as_ref(),
        Some(processing_response::Response::RequestHeaders(h)) => h.response.as_ref(),
        other => panic!("expected a destination, got {other:?}"),
    }
    .expect("a common response")
}

/// The destination of an answer: the header and the metadata must agree.
pub fn destination(r: &ProcessingResponse) -> SocketAddr {
    let common = common_of(r);
    let set = &common
        .header_mutation
        .as_ref()
        .expect("a header mutation")
        .set_headers;
    let values: Vec<&[u8]> = set
        .iter()
        .filter_map(|h| h.header.as_ref())
        .filter(|h| h.key == DESTINATION)
        .map(|h| h.raw_value.as_slice())
        .collect();
    assert_eq!(values.len(), 1, "one destination header: {set:?}");
    let header = std::str::from_utf8(values[0]).unwrap();
    let lb = match &r
        .dynamic_metadata
        .as_ref()
        .expect("dynamic metadata")
        .fields["envoy.lb"]
        .kind
    {
        Some(Kind::StructValue(s)) => s,
        other => panic!("envoy.lb is not a struct: {other:?}"),
    };
    let Some(Kind::StringValue(meta)) = &lb.fields[DESTINATION].kind else {
        panic!("envoy.lb/{DESTINATION} is not a string");
    };
    assert_eq!(header, meta, "header and metadata name the same endpoint");
    assert!(
        common.clear_route_cache,
        "Envoy must re-route on the header"
    );
    header.parse().expect("ip:port")
}

/// An immediate response: status, headers, JSON body.
pub fn immediate(r: processing_response::Response) -> (u16, HashMap<String, String>, Value) {
    let processing_response::Response::ImmediateResponse(ImmediateResponse {
        status,
        headers,
        body,
        ..
    }) = r
    else {
        panic!("expected an immediate response, got {r:?}");
    };
    let headers = headers
        .unwrap_or_default()
        .set_headers
        .into_iter()
        .filter_map(|h| h.header)
        .map(|h| (h.key, String::from_utf8(h.raw_value).unwrap()))
        .collect();
    let body: Value = serde_json::from_slice(&body).expect("a JSON error body");
    assert!(body["error"]["message"].is_string(), "{body}");
    (status.unwrap().code as u16, headers, body)
}

/// The set headers of a header mutation, by name.
pub fn set_headers(m: Option<&HeaderMutation>) -> HashMap<String, String> {
    m.map(|m| m.set_headers.clone())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|h| h.header)
        .map(|h| (h.key, String::from_utf8(h.raw_value).unwrap()))
        .collect()
}
