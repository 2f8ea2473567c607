//! Property tests over what clients and agents can send: arbitrary bytes and
//! arbitrary JSON shaped like the real thing. Whatever comes in, parsing
//! answers (a value or a 4xx) and never panics. Bounded: proptest's default
//! 256 cases per property, a few seconds in all.

use std::time::Instant;

use flowgate::prefix::PrefixConfig;
use flowgate::{AgentReport, Dispatcher, DispatcherConfig};
use proptest::prelude::*;
use serde_json::Value;

use flowgate::admission::{Caller, FlowHeaders};

use crate::auth::ApiKeys;
use crate::reply::Refusal;

/// Keys the parsers look for, plus noise.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("model".to_string()),
        Just("messages".to_string()),
        Just("role".to_string()),
        Just("content".to_string()),
        Just("prompt".to_string()),
        Just("text".to_string()),
        Just("type".to_string()),
        Just("input".to_string()),
        "[a-z_]{1,10}",
    ]
}

fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        "\\PC{0,40}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::vec((key(), inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// A JSON object with every report field, each of the right type or not.
fn report_json() -> impl Strategy<Value = Value> {
    let field = |name: &'static str, good: BoxedStrategy<Value>| {
        prop_oneof![4 => good, 1 => json()].prop_map(move |v| (name, v))
    };
    let s = |s: &'static str| Just(Value::from(s)).boxed();
    (
        field("protocol_version", (0u32..3).prop_map(Value::from).boxed()),
        field(
            "agent_id",
            "[a-z0-9._-]{0,12}|\\PC{0,20}".prop_map(Value::from).boxed(),
        ),
        field(
            "backend",
            prop_oneof![s("llamacpp"), s("vllm"), s("sglang")].boxed(),
        ),
        field(
            "external_addr",
            "127\\.0\\.0\\.1:[0-9]{1,5}|\\PC{0,20}"
                .prop_map(Value::from)
                .boxed(),
        ),
        field(
            "health",
            prop_oneof![s("ready"), s("loading"), s("unreachable")].boxed(),
        ),
        field("slots_total", any::<u32>().prop_map(Value::from).boxed()),
        field("slots_busy", any::<u32>().prop_map(Value::from).boxed()),
        field(
            "requests_waiting",
            any::<u32>().prop_map(Value::from).boxed(),
        ),
        field("kv_cache_usage", any::<f64>().prop_map(Value::from).boxed()),
        field(
            "monitoring_interval_ms",
            any::<u64>().prop_map(Value::from).boxed(),
        ),
        field(
            "models",
            prop::collection::vec("\\PC{0,10}", 0..4)
                .prop_map(Value::from)
                .boxed(),
        ),
    )
        .prop_map(|fields| {
            let (a, b, c, d, e, f, g, h, i, j, k) = fields;
            let mut obj: serde_json::Map<String, Value> = [a, b, c, d, e, f, g, h, i, j, k]
                .into_iter()
                .map(|(name, v)| (name.to_string(), v))
                .collect();
            obj.insert("name".into(), Value::from("n"));
            obj.insert("draining".into(), Value::from(false));
            Value::Object(obj)
        })
}

fn bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..256)
}

proptest! {
    #[test]
    fn request_bodies_are_routed_or_refused_400(raw in bytes(), body in json()) {
        struct NoFleet;
        impl flowgate::admission::FleetView for NoFleet {
            fn is_served(&self, _: &str) -> bool { false }
            fn draw(&self) -> u64 { 0 }
            fn bytes_per_token(&self, _: Option<&str>) -> f64 { 4.0 }
        }
        let rules = flowgate::admission::AdmissionRules {
            prefix: PrefixConfig::default(),
            models: flowgate::models::ModelRules::builder()
                .default_model("served")
                .unwrap()
                .build()
                .unwrap(),
            ..Default::default()
        };
        for input in [raw, serde_json::to_vec(&body).unwrap()] {
            let facts = rules.inference(FlowHeaders::default(), Some(&input), Caller::Anonymous, &NoFleet);
            match facts {
                Err(refused) => prop_assert_eq!(Refusal::from(refused).status.as_u16(), 400),
                // Whatever body was accepted, the engine gets it with the
                // served model's name and nothing else changed.
                Ok(f) => {
                    let name = f.resolved.rewritten_name(&f.model).unwrap();
                    let out = flowgate::admission::with_model(&input, name).unwrap();
                    let mut sent: serde_json::Map<String, serde_json::Value> =
                        serde_json::from_slice(&out).unwrap();
                    prop_assert_eq!(sent.remove("model"), Some(serde_json::Value::from("served")));
                    let mut asked: serde_json::Map<String, serde_json::Value> =
                        serde_json::from_slice(&input).unwrap();
                    asked.remove("model");
                    prop_assert_eq!(sent, asked);
                }
            }
        }
    }

    #[test]
    fn flow_headers_classify_or_refuse(
        fairness in proptest::option::of(bytes()),
        objective in proptest::option::of(bytes()),
        priority in proptest::option::of(bytes()),
        ttl in proptest::option::of(bytes()),
        slo in proptest::option::of(bytes()),
        model in "\\PC{0,12}",
    ) {
        let config = crate::config::FileConfig::parse(
            "objectives:\n  batch: -1\nflowControl:\n  allowClientPriority: true\n",
        )
        .unwrap();
        let cli = <crate::config::Cli as clap::Parser>::parse_from(["balancer"]);
        let settings = crate::config::Settings::merge(cli, config).unwrap();
        let headers = FlowHeaders {
            fairness_id: fairness.as_deref(),
            objective: objective.as_deref(),
            priority: priority.as_deref(),
            ttl: ttl.as_deref(),
            llmd_slo_tpot: slo.as_deref(),
            ..FlowHeaders::default()
        };
        if let Ok((flow, _)) = settings.admission().flow(headers, &model, Caller::Anonymous) {
            prop_assert!(flowgate::flow::valid_fairness_id(&flow.fairness_id));
        }
        if let Ok(o) = settings.admission().objective(headers, &model, Caller::Anonymous) {
            prop_assert!(o.tpot_ms.is_none_or(|ms| ms >= 1));
        }
    }

    #[test]
    fn authorization_headers_never_panic(value in proptest::option::of(bytes())) {
        let keys = ApiKeys::parse("keys:\n  - key: k\n    tenant: t\n").unwrap();
        let _ = keys.authenticate(value.as_deref());
    }

    #[test]
    fn agent_reports_are_applied_or_refused(raw in bytes(), report in report_json()) {
        let mut d: Dispatcher<()> = Dispatcher::new(DispatcherConfig::default());
        let now = Instant::now();
        for input in [raw, serde_json::to_vec(&report).unwrap()] {
            if let Ok(r) = serde_json::from_slice::<AgentReport>(&input) {
                let _ = d.report(r, now);
            }
        }
        let _ = d.endpoints(now);
        let _ = d.dispatch(now);
    }
}
