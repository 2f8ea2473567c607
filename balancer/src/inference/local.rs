//! The routes the inference port answers itself: `/health`, `/v1/models`,
//! the async API, the Batch API, and `404` / `405` for the rest.

use http::{Method, StatusCode};
use pingora_proxy::Session;

use super::async_api::{self, AsyncDoor};
use super::context::Ending;
use super::halt::Flow;
use super::routes::PathRoute;
use super::{batch_api, Inference, RequestCtx, Step};
use crate::reply::{Answer, Refusal};
use flowgate::openai::error_body;

/// The answer to a request that is not a POST to an inference route: the
/// balancer answers it itself. `route` is what its path names.
pub(super) async fn route(
    port: &Inference,
    session: &mut Session,
    ctx: &mut RequestCtx,
    route: PathRoute,
) -> Flow<Step> {
    let req = session.req_header();
    let method = req.method.clone();
    let path = req.uri.path().to_string();
    ctx.ending = Ending::Local;
    let is_batch_api = route == PathRoute::BatchApi;
    if is_batch_api || route == PathRoute::AsyncApi {
        let Some(queue) = &port.async_queue else {
            let message = if is_batch_api {
                "the Batch API needs the async path: start the balancer with --async-dir"
            } else {
                "the async path is off: start the balancer with --async-dir"
            };
            return Err(Refusal::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "async_disabled",
                message.into(),
            )
            .into());
        };
        let async_door = AsyncDoor {
            queue,
            admission: &ctx.rules.admission,
            body: port.body_limits,
            metrics: &port.door.gate.metrics,
            grant: ctx.grant.as_ref(),
            request_id: ctx.request_id.as_str(),
        };
        let answer = if is_batch_api {
            batch_api::route(&async_door, session, &method, &path).await?
        } else {
            async_api::route(&async_door, session, &method, &path).await?
        };
        return Ok(answer);
    }
    let not_allowed = |allow: &'static str| {
        Answer::json(
            StatusCode::METHOD_NOT_ALLOWED,
            error_body(
                &format!("{method} is not allowed on {path}"),
                "invalid_request_error",
                "method_not_allowed",
            ),
        )
        .with_header("allow", allow.to_string())
    };
    let get = method == Method::GET;
    let answer = match route {
        // Readiness: 503 from SIGTERM on (the drain delay included).
        PathRoute::Ready if get => {
            if port.door.gate.is_ready() {
                Answer::json(StatusCode::OK, br#"{"status":"ok"}"#.to_vec())
            } else {
                Answer::json(
                    StatusCode::SERVICE_UNAVAILABLE,
                    br#"{"status":"shutting_down"}"#.to_vec(),
                )
            }
        }
        // Liveness: the process serves; 200 until it exits.
        PathRoute::Live if get => Answer::json(StatusCode::OK, br#"{"status":"ok"}"#.to_vec()),
        PathRoute::Ready | PathRoute::Live | PathRoute::Models if !get => not_allowed("GET"),
        PathRoute::Models => Answer::json(StatusCode::OK, models_body(port, ctx)),
        PathRoute::Inference { .. } => not_allowed("POST"),
        // Unknown (the async and Batch APIs were answered above).
        _ => Answer::json(
            StatusCode::NOT_FOUND,
            error_body(
                &format!("no route for {method} {path}"),
                "invalid_request_error",
                "not_found",
            ),
        ),
    };
    Ok(Step::Answer(answer))
}

/// `/v1/models`: every model (and alias) a live endpoint serves, and the
/// names of the operator's model rules.
fn models_body(port: &Inference, ctx: &RequestCtx) -> Vec<u8> {
    let data: Vec<serde_json::Value> = (port.door.gate)
        .model_names(&ctx.rules.admission.models)
        .into_iter()
        .map(|id| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "flowgate"}))
        .collect();
    serde_json::to_vec(&serde_json::json!({"object": "list", "data": data}))
        .expect("json serialises")
}
