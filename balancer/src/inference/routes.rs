//! The inference routes the port proxies: every route llama.cpp's
//! llama-server, vLLM and SGLang serve for inference (read from their
//! route tables, not guessed), and whether a request on it takes a slot on
//! the engine.

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
}
