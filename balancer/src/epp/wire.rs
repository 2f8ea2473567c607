//! Envoy's messages as the EPP builds and reads them: answers, header
//! mutations, the `envoy.lb` metadata, streamed body chunks, the subset
//! hint.

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse,
    ProcessingResponse, StreamedBodyResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

/// Request header (and `envoy.lb` metadata key) naming the chosen endpoint.
use super::{DESTINATION, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE};

pub(super) fn reply(response: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

pub(super) fn continue_body() -> ProcessingResponse {
    reply(processing_response::Response::RequestBody(
        BodyResponse::default(),
    ))
}

/// A body chunk streamed back (full-duplex mode).
pub(super) fn streamed_body(
    wrap: fn(BodyResponse) -> processing_response::Response,
    body: Vec<u8>,
    end_of_stream: bool,
) -> ProcessingResponse {
    reply(wrap(BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                        ..StreamedBodyResponse::default()
                    },
                )),
            }),
            ..CommonResponse::default()
        }),
    }))
}

/// A header to set, replacing any value it had.
pub(super) fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

/// `envoy.lb: { x-gateway-destination-endpoint: <destination> }`.
pub(super) fn destination_metadata(destination: &str) -> Struct {
    let inner = Struct {
        fields: [(
            DESTINATION.to_string(),
            Value {
                kind: Some(Kind::StringValue(destination.to_string())),
            },
        )]
        .into(),
    };
    Struct {
        fields: [(
            LB_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

/// Header names and values; Envoy sends values in `raw_value`, some
/// clients in `value`.
pub(super) fn header_pairs(map: Option<&HeaderMap>) -> impl Iterator<Item = (&str, &[u8])> {
    map.into_iter().flat_map(|m| m.headers.iter()).map(|h| {
        let value = if h.raw_value.is_empty() {
            h.value.as_bytes()
        } else {
            &h.raw_value
        };
        (h.key.as_str(), value)
    })
}

/// The subset hint's entries, if the metadata carries one (a list of
/// strings, or one comma-separated string).
pub(super) fn subset_hint(metadata: &Metadata) -> Option<Vec<String>> {
    let value = metadata
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(SUBSET_KEY)?;
    match value.kind.as_ref()? {
        Kind::ListValue(list) => Some(
            list.values
                .iter()
                .filter_map(|v| match v.kind.as_ref()? {
                    Kind::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
        ),
        Kind::StringValue(s) => Some(
            s.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect(),
        ),
        _ => Some(Vec::new()),
    }
}

/// Serves EPP mode and gRPC health on `addr` until `shutdown` resolves.
#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::ListValue;

    fn string(s: &str) -> Value {
        Value {
            kind: Some(Kind::StringValue(s.into())),
        }
    }

    fn metadata(hint: Value) -> Metadata {
        Metadata {
            filter_metadata: [(
                SUBSET_NAMESPACE.to_string(),
                Struct {
                    fields: [(SUBSET_KEY.to_string(), hint)].into(),
                },
            )]
            .into(),
            ..Metadata::default()
        }
    }

    #[test]
    fn the_subset_hint_is_read_as_a_list_or_a_comma_separated_string() {
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string("10.0.0.1:8000"), string("10.0.0.2:8000")],
            })),
        };
        assert_eq!(
            subset_hint(&metadata(list)).unwrap(),
            ["10.0.0.1:8000", "10.0.0.2:8000"]
        );
        assert_eq!(
            subset_hint(&metadata(string("10.0.0.1:8000, 10.0.0.3:8000"))).unwrap(),
            ["10.0.0.1:8000", "10.0.0.3:8000"]
        );
        // A hint of the wrong shape is an empty hint (503), not no hint.
        let odd = Value {
            kind: Some(Kind::NumberValue(1.0)),
        };
        assert_eq!(subset_hint(&metadata(odd)).unwrap(), Vec::<String>::new());
        assert!(subset_hint(&Metadata::default()).is_none());
    }

    #[test]
    fn the_destination_is_the_same_in_the_header_and_the_metadata() {
        let h = header(DESTINATION, "127.0.0.1:9");
        let value = h.header.unwrap().raw_value;
        let m = destination_metadata("127.0.0.1:9");
        let Some(Kind::StructValue(lb)) = &m.fields[LB_NAMESPACE].kind else {
            panic!("envoy.lb is a struct");
        };
        let Some(Kind::StringValue(v)) = &lb.fields[DESTINATION].kind else {
            panic!("the destination is a string");
        };
        assert_eq!(v.as_bytes(), value.as_slice());
        assert_eq!(
            h.append_action,
            HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            "a client's own destination header is replaced, not appended to"
        );
    }
}
