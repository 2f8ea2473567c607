use super::*;
use crate::asyncq::job::DeadLetter;
use crate::asyncq::Gate;
use clap::Parser;
use std::path::Path;

fn cli(args: &[&str]) -> Cli {
    Cli::try_parse_from(std::iter::once("balancer").chain(args.iter().copied())).unwrap()
}

#[test]
fn an_open_management_port_needs_a_token_or_an_explicit_flag() {
    let open = ["--management-addr", "0.0.0.0:8060"];
    let err = Settings::merge(cli(&open), FileConfig::default()).unwrap_err();
    assert!(err.to_string().contains("--management-token"), "{err}");
    let with_token = cli(&[&open[..], &["--management-token", "t0k"]].concat());
    let s = Settings::merge(with_token, FileConfig::default()).unwrap();
    assert!(s.management_token.unwrap().matches(b"t0k"));
    let allowed = cli(&[&open[..], &["--allow-open-management"]].concat());
    let s = Settings::merge(allowed, FileConfig::default()).unwrap();
    assert!(s.management_token.is_none());
    let empty = cli(&["--management-token", " "]);
    let err = Settings::merge(empty, FileConfig::default()).unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");
}

#[test]
fn the_scale_up_webhook_needs_an_http_url() {
    let hook = |args: &[&str]| Settings::merge(cli(args), FileConfig::default());
    let s = hook(&["--scale-up-webhook", "http://10.0.0.1:9000/hook"]).unwrap();
    assert_eq!(
        s.scale_up_webhook,
        Some(("http://10.0.0.1:9000/hook".into(), Duration::from_secs(30)))
    );
    let s = hook(&[
        "--scale-up-webhook",
        "http://h:1",
        "--scale-up-webhook-interval",
        "2m",
    ])
    .unwrap();
    assert_eq!(s.scale_up_webhook.unwrap().1, Duration::from_secs(120));
    for bad in ["https://h/hook", "h:1", "http://", "http:///x"] {
        let err = hook(&["--scale-up-webhook", bad]).unwrap_err();
        assert!(err.to_string().contains("http://"), "{bad}: {err}");
    }
    let zero = [
        "--scale-up-webhook",
        "http://h:1",
        "--scale-up-webhook-interval",
        "0s",
    ];
    assert!(hook(&zero).is_err());
    // The same settings, and the security ones, from the config file.
    let file = FileConfig::parse(
        "scaleUpWebhook: http://h:1/x\nscaleUpWebhookInterval: 5s\n\
         managementToken: t0k\nallowOpenManagement: true\nmanagementAddr: 0.0.0.0:8060\n",
    )
    .unwrap();
    let s = Settings::merge(cli(&[]), file).unwrap();
    assert_eq!(
        s.scale_up_webhook,
        Some(("http://h:1/x".into(), Duration::from_secs(5)))
    );
    assert!(s.management_token.unwrap().matches(b"t0k"));
}

#[test]
fn defaults_match_the_documentation() {
    let s = Settings::merge(cli(&[]), FileConfig::default()).unwrap();
    assert_eq!(s.inference_addr.to_string(), "127.0.0.1:8061");
    assert_eq!(s.management_addr.to_string(), "127.0.0.1:8060");
    assert_eq!(s.dispatcher.flow.max_requests, 30);
    assert_eq!(s.dispatcher.flow.max_bytes, 256 << 20);
    assert_eq!(s.dispatcher.default_ttl, Duration::from_secs(10));
    assert_eq!(s.dispatcher.max_ttl, Duration::from_secs(60));
    assert_eq!(
        s.dispatcher.saturation,
        flowgate::SaturationConfig::default()
    );
    assert_eq!(
        s.dispatcher.flow.default_band.fairness,
        flowgate::FairnessPolicy::TokenFair
    );
    assert!(!s.priorities.allow_client_priority);
    assert_eq!(s.max_request_bytes, 16 << 20);
    assert_eq!(s.shutdown_grace_period, Duration::from_secs(30));
    assert_eq!(s.epp_addr, None, "EPP mode is off unless asked for");
    assert_eq!(s.upstream_idle_connections, 4096);
    assert_eq!(
        s.client_limits,
        ClientLimits {
            max_connections: 4096,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            max_header_bytes: 32 * 1024,
        }
    );
}

#[test]
fn the_async_section_is_read_and_flags_win() {
    let file = FileConfig::parse(
        "async:\n  dir: /var/lib/flowgate\n  gate: always-open\n  maxDelivery: 3\n  \
         maxIdle: 2m\n  deadLetter: rear\n  priority: -50\n",
    )
    .unwrap();
    let s = Settings::merge(cli(&["--async-max-delivery", "7"]), file).unwrap();
    let a = s.async_queue.expect("on");
    assert_eq!(a.dir, PathBuf::from("/var/lib/flowgate"));
    assert_eq!(a.gate, Gate::AlwaysOpen);
    assert_eq!(a.queue.max_delivery, 7, "the flag wins");
    assert_eq!(a.queue.max_idle, Duration::from_secs(120));
    assert_eq!(a.queue.dead_letter, DeadLetter::Rear);
    assert_eq!(a.priority, -50);
    assert!(Settings::merge(cli(&[]), FileConfig::default())
        .unwrap()
        .async_queue
        .is_none());

    let err = FileConfig::parse("async:\n  gates: balancer\n").unwrap_err();
    assert!(err.to_string().contains("gates"), "{err}");
    let prom = FileConfig::parse("async:\n  dir: /tmp/q\n  gate: prometheus\n").unwrap();
    let err = Settings::merge(cli(&[]), prom).unwrap_err();
    assert!(err.to_string().contains("PromQL"), "{err}");
    let err =
        Settings::merge(cli(&["--queue-url", "http://x"]), FileConfig::default()).unwrap_err();
    assert!(err.to_string().contains("redis://"), "{err}");
}

#[test]
fn connection_limits_are_read_and_checked() {
    let file = FileConfig::parse("upstreamIdleConnections: 9000\n").unwrap();
    let s = Settings::merge(cli(&[]), file).unwrap();
    assert_eq!(s.upstream_idle_connections, 9000);
    let file = FileConfig::parse("maxConnections: 7\nclientHeaderTimeout: 2s\n").unwrap();
    let s = Settings::merge(cli(&["--client-body-timeout", "500ms"]), file).unwrap();
    assert_eq!(s.client_limits.max_connections, 7);
    assert_eq!(s.client_limits.header_timeout, Duration::from_secs(2));
    assert_eq!(s.client_limits.body_timeout, Duration::from_millis(500));
    for (args, want) in [
        (&["--max-connections", "0"][..], "max_connections"),
        (
            &["--upstream-idle-connections", "0"][..],
            "upstream_idle_connections",
        ),
        (
            &["--upstream-idle-connections", "99999999999"][..],
            "upstream_idle_connections",
        ),
        (&["--max-header-bytes", "100"][..], "max_header_bytes"),
        (&["--max-header-bytes", "2000000"][..], "max_header_bytes"),
        (
            &["--client-header-timeout", "0"][..],
            "client_header_timeout",
        ),
    ] {
        let err = Settings::merge(cli(args), FileConfig::default()).unwrap_err();
        assert!(err.to_string().contains(want), "{args:?}: {err}");
    }
}

#[test]
fn flags_override_the_file_which_overrides_defaults() {
    let file = FileConfig::parse("maxBufferedRequests: 5\nbufferedRequestTimeout: 250\n").unwrap();
    let s = Settings::merge(cli(&["--max-buffered-requests", "7"]), file).unwrap();
    assert_eq!(s.dispatcher.flow.max_requests, 7);
    assert_eq!(s.dispatcher.default_ttl, Duration::from_millis(250));
    let file = FileConfig::parse("eppAddr: 127.0.0.1:9002\n").unwrap();
    let s = Settings::merge(cli(&[]), file).unwrap();
    assert_eq!(s.epp_addr, Some("127.0.0.1:9002".parse().unwrap()));
}

#[test]
fn unknown_keys_and_bad_values_are_clear_errors() {
    let err = FileConfig::parse("maxBuferedRequests: 5").unwrap_err();
    assert!(err.to_string().contains("unknown field"), "{err}");
    let err = FileConfig::parse("maxBufferedRequests: many").unwrap_err();
    assert!(err.to_string().contains("line 1"), "{err}");
    assert!(FileConfig::parse("").is_ok());
    let err = Settings::merge(
        cli(&[
            "--inference-addr",
            "127.0.0.1:9",
            "--management-addr",
            "127.0.0.1:9",
        ]),
        FileConfig::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("must differ"));
    let err = Settings::merge(
        cli(&["--epp-addr", "127.0.0.1:8061"]),
        FileConfig::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("epp_addr must differ"), "{err}");
    assert!(Settings::merge(cli(&["--max-request-bytes", "0"]), FileConfig::default()).is_err());
}

#[test]
fn flow_control_section_is_read_and_checked() {
    let file = FileConfig::parse(
        "flowControl:\n  maxRequests: 100\n  maxBytes: 1000000\n  defaultRequestTTL: 5s\n  \
         maxRequestTTL: 2m\n  defaultPriority: 1\n  priorityBands:\n  - priority: 10\n    \
         fairnessPolicyRef: global-strict-fairness-policy\n    orderingPolicyRef: edf\n  \
         - priority: -1\n    maxRequests: 20\n    maxBytes: 50000\n    maxTokens: 9000\n  \
         maxTokens: 100000\n  tenantWeights:\n    acme: 2\n  defaultBand:\n    fairnessPolicyRef: token-fair\n\
         saturationDetector:\n  queueDepthThreshold: 3\n  kvCacheUtilThreshold: 0.9\n  \
         metricsStalenessThreshold: 150ms\n  tokenBudget: 1.5\nobjectives:\n  chat: 10\n  batch: -1\n",
    )
    .unwrap();
    let s = Settings::merge(cli(&[]), file).unwrap();
    let d = &s.dispatcher;
    assert_eq!((d.flow.max_requests, d.flow.max_bytes), (100, 1_000_000));
    assert_eq!(d.default_ttl, Duration::from_secs(5));
    assert_eq!(d.max_ttl, Duration::from_secs(120));
    let high = d.flow.band(10);
    assert_eq!(high.fairness, flowgate::FairnessPolicy::GlobalStrict);
    assert_eq!(high.ordering, flowgate::OrderingPolicy::Edf);
    let low = d.flow.band(-1);
    assert_eq!((low.max_requests, low.max_bytes), (Some(20), Some(50_000)));
    assert_eq!(
        (low.max_tokens, d.flow.max_tokens),
        (Some(9000), Some(100_000))
    );
    assert_eq!(high.max_tokens, None);
    assert_eq!(d.saturation.token_budget, 1.5);
    assert_eq!(s.weights["acme"], 2);
    assert_eq!(
        d.flow.default_band.fairness,
        flowgate::FairnessPolicy::TokenFair
    );
    // A listed band without a policy takes the default band's.
    assert_eq!(low.fairness, flowgate::FairnessPolicy::TokenFair);
    assert_eq!(d.saturation.queue_depth_threshold, 3);
    assert_eq!(
        d.saturation.metrics_staleness_threshold,
        Duration::from_millis(150)
    );
    assert_eq!(s.priorities.objectives["batch"], -1);
    assert_eq!(s.priorities.default_priority, 1);
}

#[test]
fn bad_flow_control_config_names_the_field() {
    let bad = |yaml: &str, want: &str| {
        let msg = match FileConfig::parse(yaml) {
            Err(e) => e.to_string(),
            Ok(file) => Settings::merge(cli(&[]), file).unwrap_err().to_string(),
        };
        assert!(msg.contains(want), "{yaml:?}: {msg}");
    };
    bad(
        "flowControl:\n  priorityBands:\n  - priority: 1\n    fairnessPolicyRef: lottery\n",
        "lottery",
    );
    bad(
        "flowControl:\n  priorityBands:\n  - priority: 1\n  - priority: 1\n",
        "flowControl.priorityBands[1].priority",
    );
    bad(
        "flowControl:\n  priorityBands:\n  - priority: 1\n    maxRequests: 0\n",
        "flowControl.priorityBands[0].maxRequests",
    );
    bad(
        "saturationDetector:\n  kvCacheUtilThreshold: 1.5\n",
        "saturationDetector.kvCacheUtilThreshold",
    );
    for budget in ["-0.5", "11", ".nan"] {
        bad(
            &format!("saturationDetector:\n  tokenBudget: {budget}\n"),
            "saturationDetector.tokenBudget",
        );
    }
    bad("flowControl:\n  maxTokens: 0\n", "flowControl.maxTokens");
    bad(
        "flowControl:\n  tenantWeights:\n    acme: 0\n",
        "flowControl.tenantWeights.acme",
    );
    bad(
        "flowControl:\n  tenantWeights:\n    \"a b\": 2\n",
        "not a valid fairness id",
    );
    bad(
        "flowControl:\n  defaultBand:\n    fairnessPolicyRef: tokens\n",
        "tokens",
    );
    bad(
        "flowControl:\n  priorityBands:\n  - priority: 1\n    maxTokens: 0\n",
        "flowControl.priorityBands[0].maxTokens",
    );
    bad(
        "flowControl:\n  defaultRequestTTL: 90s\n  maxRequestTTL: 1s\n",
        "flowControl.maxRequestTTL",
    );
    bad(
        "maxBufferedRequests: 3\nflowControl:\n  maxRequests: 4\n",
        "give only one",
    );
    bad("flowControl:\n  maxQueue: 4\n", "unknown field");
    bad(
        "saturationDetector:\n  metricsStalenessThreshold: soon\n",
        "duration",
    );
    bad(
        "scheduling:\n  scorers:\n    kvCache: -1\n",
        "scheduling.scorers.kvCache",
    );
    bad("scheduling:\n  scorers:\n    latency: 1\n", "unknown field");
    bad(
        "latencyObjectives:\n  objectives:\n    chat: {ttftMs: 0}\n",
        "latencyObjectives.objectives.chat: ttftMs must be 1 to 3600000",
    );
    bad(
        "latencyObjectives:\n  models:\n    m: {tpotMs: 3600001}\n",
        "latencyObjectives.models.m: tpotMs",
    );
    bad(
        "latencyObjectives:\n  models:\n    m: {ttft: 5}\n",
        "unknown field",
    );
    bad(
        "latencyObjectives:\n  models:\n    m: {ttftMs: -5}\n",
        "latencyObjectives",
    );
    bad(
        "scheduling:\n  prefixCache:\n    blockBytes: 0\n",
        "scheduling.prefixCache.blockBytes",
    );
    bad(
        "scheduling:\n  circuitBreaker:\n    backoff: 10s\n    maxBackoff: 1s\n",
        "scheduling.circuitBreaker.maxBackoff",
    );
    bad("scheduling:\n  retries: 9\n", "scheduling.retries");
    bad(
        "scheduling:\n  adapterReplicas: 65\n",
        "scheduling.adapterReplicas",
    );
    bad("scheduling:\n  keptSlots: 1025\n", "scheduling.keptSlots");
    bad("scheduling:\n  keptSlots: -1\n", "keptSlots");
    bad(
        "scheduling:\n  scorers:\n    adapter: -2\n",
        "scheduling.scorers.adapter",
    );
}

#[test]
fn scheduling_section_is_read() {
    let file = FileConfig::parse(
        "scheduling:\n  scorers:\n    prefixCache: 5\n    queue: 0\n  prefixCache:\n    \
         blockBytes: 128\n    capacityBlocks: 100\n  retries: 0\n  circuitBreaker:\n    \
         failures: 2\n    backoff: 1s\n  affinityHold: 50ms\n  keptSlots: 0\n",
    )
    .unwrap();
    let s = Settings::merge(cli(&[]), file).unwrap();
    let sc = &s.dispatcher.scheduling;
    assert_eq!(sc.scorers.prefix_cache, 5.0);
    assert_eq!(sc.scorers.queue, 0.0);
    assert_eq!(sc.scorers.free_slots, 2.0, "left out: default");
    assert_eq!(
        (sc.prefix.block_bytes, sc.prefix.capacity_blocks),
        (128, 100)
    );
    assert_eq!(s.retries, 0);
    assert_eq!(sc.breaker.failures, 2);
    assert_eq!(sc.breaker.backoff, Duration::from_secs(1));
    assert_eq!(sc.affinity_hold, Duration::from_millis(50));
    assert_eq!(sc.kept_slots, 0);
    assert_eq!(
        (sc.scorers.adapter, sc.adapter_replicas),
        (4.0, 1),
        "the LoRA defaults"
    );
    let d = Settings::merge(cli(&[]), FileConfig::default()).unwrap();
    assert_eq!(d.retries, 1);
    assert_eq!(
        d.dispatcher.scheduling.affinity_hold,
        Duration::from_secs(5)
    );
    assert_eq!(d.dispatcher.scheduling.kept_slots, 3);
}

#[test]
fn sessions_section_is_read_and_checked() {
    let file = FileConfig::parse(
        "scheduling:\n  sessions:\n    keys: [X-Session-Id, session_id, prompt_cache_key]\n    \
         mode: hard\n    idleTimeout: 5m\n    maxSessions: 10\n",
    )
    .unwrap();
    let s = Settings::merge(cli(&[]), file).unwrap();
    let sessions = &s.dispatcher.scheduling.sessions;
    assert!(sessions.hard);
    assert_eq!(sessions.idle_timeout, Duration::from_secs(300));
    assert_eq!(sessions.max_sessions, 10);
    assert_eq!(
        s.admission().sessions.order,
        [
            flowgate::SessionSource::SessionIdHeader,
            flowgate::SessionSource::CodexHeader,
            flowgate::SessionSource::PromptCacheKey
        ]
    );
    let d = Settings::merge(cli(&[]), FileConfig::default()).unwrap();
    assert_eq!(d.admission().sessions, flowgate::SessionRules::default());
    assert_eq!(d.door_rules().explain, crate::rules::ExplainScores::Off);
    let always = FileConfig::parse("scheduling:\n  explain: always\n").unwrap();
    let always = Settings::merge(cli(&[]), always).unwrap();
    assert_eq!(
        always.door_rules().explain,
        crate::rules::ExplainScores::Always
    );
    assert!(FileConfig::parse("scheduling:\n  explain: yes\n").is_err());
    assert!(!d.dispatcher.scheduling.sessions.hard);
    let off = FileConfig::parse("scheduling:\n  sessions:\n    keys: []\n").unwrap();
    let off = Settings::merge(cli(&[]), off).unwrap();
    assert!(off.admission().sessions.order.is_empty());
    for (yaml, says) in [
        ("keys: [x-nope]", "x-nope"),
        ("keys: [session-id, session_id]", "twice"),
        ("maxSessions: 1000001", "at most 1000000"),
        ("idleTimeout: 0s", "idleTimeout"),
        ("mode: sticky", "mode"),
    ] {
        let text = format!("scheduling:\n  sessions:\n    {yaml}\n");
        let err = match FileConfig::parse(&text) {
            Err(e) => e.to_string(),
            Ok(f) => Settings::merge(cli(&[]), f).unwrap_err().to_string(),
        };
        assert!(err.contains(says), "{yaml}: {err}");
    }
}

#[test]
fn traces_need_an_endpoint_and_a_ratio_between_0_and_1() {
    use super::file::TracesSection;
    let none = super::traces(None, None, TracesSection::default()).unwrap();
    if std::env::var_os("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_none() {
        assert_eq!(none, None, "off without an endpoint");
    }
    let file = TracesSection {
        endpoint: Some("http://127.0.0.1:4318".into()),
        sample_ratio: Some(0.25),
    };
    let on = super::traces(None, None, file).unwrap().unwrap();
    if std::env::var_os("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_none() {
        assert_eq!(on.endpoint, "http://127.0.0.1:4318/v1/traces");
    }
    if std::env::var_os("OTEL_TRACES_SAMPLER").is_none() {
        assert_eq!(on.sample_ratio, 0.25);
        assert!(on.parent_based);
        let flag = super::traces(
            Some("http://c:1/x".into()),
            Some(1.0),
            TracesSection::default(),
        );
        assert_eq!(flag.unwrap().unwrap().sample_ratio, 1.0, "the flag wins");
        let bad = super::traces(
            Some("http://c:1".into()),
            Some(1.5),
            TracesSection::default(),
        );
        assert!(bad.unwrap_err().contains("between 0 and 1"));
    }
    assert!(super::traces(Some("c:4318".into()), None, TracesSection::default()).is_err());
}

#[test]
fn the_drain_delay_is_read_and_bounded() {
    let d = Settings::merge(cli(&[]), FileConfig::default()).unwrap();
    assert_eq!(d.drain_delay, Duration::ZERO, "off unless asked");
    let file = FileConfig::parse("drainDelay: 5s\n").unwrap();
    assert_eq!(
        Settings::merge(cli(&[]), file).unwrap().drain_delay,
        Duration::from_secs(5)
    );
    let flag = Settings::merge(cli(&["--drain-delay", "250ms"]), FileConfig::default()).unwrap();
    assert_eq!(flag.drain_delay, Duration::from_millis(250));
    let long = FileConfig::parse("drainDelay: 11m\n").unwrap();
    let err = Settings::merge(cli(&[]), long).unwrap_err().to_string();
    assert!(err.contains("drainDelay"), "{err}");
}

#[test]
fn example_configs_load() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("balancer")
        {
            let file = FileConfig::load(&path).unwrap();
            Settings::merge(cli(&[]), file).unwrap();
            n += 1;
        }
    }
    assert!(n > 0, "config/ holds at least one balancer example");
}

#[test]
fn the_session_redis_url_comes_from_the_flag_or_the_file_and_is_checked() {
    let file = || FileConfig::parse("scheduling:\n  sessions:\n    redisUrl: redis://r:6379/1\n");
    let s = Settings::merge(cli(&[]), file().unwrap()).unwrap();
    assert_eq!(s.session_redis_url.as_deref(), Some("redis://r:6379/1"));
    let s = Settings::merge(
        cli(&["--sessions-redis-url", "rediss://s/0"]),
        file().unwrap(),
    )
    .unwrap();
    assert_eq!(
        s.session_redis_url.as_deref(),
        Some("rediss://s/0"),
        "the flag wins"
    );
    assert!(Settings::merge(cli(&[]), FileConfig::default())
        .unwrap()
        .session_redis_url
        .is_none());
    let err = Settings::merge(
        cli(&["--sessions-redis-url", "http://r"]),
        FileConfig::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("redis://"), "{err}");
}

#[test]
fn latency_objectives_are_defaults_by_objective_and_model() {
    let file = FileConfig::parse(
        "latencyObjectives:\n  objectives:\n    chat: {ttftMs: 500, tpotMs: 50}\n  models:\n    \
         m: {ttftMs: 2000}\n",
    )
    .unwrap();
    let s = Settings::merge(cli(&[]), file).unwrap();
    let o = &s.admission().objectives;
    assert_eq!(o.objectives["chat"].ttft_ms, Some(500));
    assert_eq!(o.objectives["chat"].tpot_ms, Some(50));
    assert_eq!(o.models["m"].ttft_ms, Some(2000));
    assert_eq!(o.models["m"].tpot_ms, None);
}

#[test]
fn tokenizers_come_from_the_file_and_the_flags_win() {
    let file = || FileConfig::parse("models:\n  tokenizers:\n    a: /m/a\n    b: /m/b\n");
    let s = Settings::merge(
        cli(&["--tokenizer", "b=/n/b", "--tokenizer", "c=/n/c"]),
        file().unwrap(),
    )
    .unwrap();
    let dirs: Vec<(&str, &Path)> = s
        .tokenizers
        .iter()
        .map(|(m, d)| (m.as_str(), d.as_path()))
        .collect();
    assert_eq!(
        dirs,
        [
            ("a", Path::new("/m/a")),
            ("b", Path::new("/n/b")),
            ("c", Path::new("/n/c"))
        ]
    );
    assert!(Cli::try_parse_from(["balancer", "--tokenizer", "no-directory"]).is_err());
    let err = Settings::merge(
        cli(&[]),
        FileConfig::parse("models:\n  tokenizers:\n    ' ': /m\n").unwrap(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("models.tokenizers"), "{err}");
}

#[test]
fn the_shipped_config_loads() {
    let text = include_str!("../../../config/balancer.yaml");
    let file = FileConfig::parse(text).unwrap();
    let s = Settings::merge(cli(&[]), file).unwrap();
    assert!(s
        .admission()
        .objectives
        .objectives
        .contains_key("interactive"));
}
