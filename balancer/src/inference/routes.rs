//! The inference port's routes, parsed once per request ([`PathRoute`]):
//! the inference routes it proxies — every route llama.cpp's llama-server,
//! vLLM and SGLang serve for inference (read from their route tables, not
//! guessed), and whether a request on it takes a slot on the engine — and
//! those it answers itself.

/// What a request's path names on the inference port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathRoute {
    /// An inference route (proxied when POSTed); `responses`: the
    /// Responses API, whose answers' ids later turns may continue.
    Inference { kind: RouteKind, responses: bool },
    /// `/health`, `/health/ready`: readiness.
    Ready,
    /// `/health/live`: liveness.
    Live,
    /// `/v1/models`.
    Models,
    /// The Batch API: `/v1/files…`, `/v1/batches…`.
    BatchApi,
    /// The async API: `/v1/async/…`.
    AsyncApi,
    /// Anything else: 404.
    Unknown,
}

impl PathRoute {
    pub fn of(path: &str) -> PathRoute {
        if let Some(kind) = kind(path) {
            return PathRoute::Inference {
                kind,
                responses: path == "/v1/responses",
            };
        }
        match path {
            "/health" | "/health/ready" => PathRoute::Ready,
            "/health/live" => PathRoute::Live,
            "/v1/models" => PathRoute::Models,
            "/v1/files" | "/v1/batches" => PathRoute::BatchApi,
            _ if path.starts_with("/v1/files/") || path.starts_with("/v1/batches/") => {
                PathRoute::BatchApi
            }
            _ if path.starts_with("/v1/async/") => PathRoute::AsyncApi,
            _ => PathRoute::Unknown,
        }
    }

    /// A health check: answered without an API key.
    pub fn is_health(self) -> bool {
        matches!(self, PathRoute::Ready | PathRoute::Live)
    }

    /// The inference route's kind, if it is one.
    pub fn inference(self) -> Option<RouteKind> {
        match self {
            PathRoute::Inference { kind, .. } => Some(kind),
            _ => None,
        }
    }
}

/// How a route is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteKind {
    /// The engine runs the model for it: it waits for a slot in flow
    /// control and holds it until its answer ends.
    Slot,
    /// The engine answers it without a slot (tokenizing, templating,
    /// counting): it goes at once to a live server of its model.
    Slotless,
}

/// Routes whose requests take a slot.
pub const SLOT_ROUTES: [&str; 19] = [
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/completions",
    "/completions",
    "/completion",
    "/v1/responses",
    "/v1/messages",
    "/infill",
    "/v1/embeddings",
    "/embeddings",
    "/embedding",
    "/v1/rerank",
    "/rerank",
    "/v1/reranking",
    "/reranking",
    "/v1/score",
    "/pooling",
    // vLLM (Whisper and other speech models): `multipart/form-data` bodies,
    // read by admission as forms.
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
];

/// Routes whose requests take none.
pub const SLOTLESS_ROUTES: [&str; 4] = [
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/v1/messages/count_tokens",
];

/// How `path` is served, if it is an inference route (POST only).
pub fn kind(path: &str) -> Option<RouteKind> {
    if SLOT_ROUTES.contains(&path) {
        Some(RouteKind::Slot)
    } else if SLOTLESS_ROUTES.contains(&path) {
        Some(RouteKind::Slotless)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_has_one_kind() {
        for r in SLOT_ROUTES {
            assert_eq!(kind(r), Some(RouteKind::Slot), "{r}");
            assert!(!SLOTLESS_ROUTES.contains(&r), "{r}");
        }
        for r in SLOTLESS_ROUTES {
            assert_eq!(kind(r), Some(RouteKind::Slotless), "{r}");
        }
        assert_eq!(kind("/v1/models"), None);
        assert_eq!(kind("/v1/chat/completions/"), None, "exact paths only");
    }

    #[test]
    fn every_path_is_parsed_once_into_its_route() {
        let slot = |responses| PathRoute::Inference {
            kind: RouteKind::Slot,
            responses,
        };
        for (path, route) in [
            ("/v1/chat/completions", slot(false)),
            ("/v1/responses", slot(true)),
            (
                "/tokenize",
                PathRoute::Inference {
                    kind: RouteKind::Slotless,
                    responses: false,
                },
            ),
            ("/health", PathRoute::Ready),
            ("/health/ready", PathRoute::Ready),
            ("/health/live", PathRoute::Live),
            ("/v1/models", PathRoute::Models),
            ("/v1/files", PathRoute::BatchApi),
            ("/v1/files/file-1/content", PathRoute::BatchApi),
            ("/v1/batches/batch_1/cancel", PathRoute::BatchApi),
            ("/v1/async/jobs", PathRoute::AsyncApi),
            ("/v1/filesystem", PathRoute::Unknown),
            ("/health/", PathRoute::Unknown),
            ("/", PathRoute::Unknown),
        ] {
            assert_eq!(PathRoute::of(path), route, "{path}");
        }
        assert!(PathRoute::Live.is_health() && !PathRoute::Models.is_health());
        assert_eq!(slot(true).inference(), Some(RouteKind::Slot));
        assert_eq!(PathRoute::Unknown.inference(), None);
    }
}
