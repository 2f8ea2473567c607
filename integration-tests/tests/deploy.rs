//! The deployment files in `deploy/` and the Dockerfile agree with each
//! other and with the binaries: every Kubernetes manifest parses, the names
//! and ports one file shares with another match (Services and the pods
//! they select, the agents' headless Service, the KEDA target, the
//! InferencePool's pods and endpoint picker), the probes name the
//! balancer's readiness and liveness routes, the balancer starts on the
//! ConfigMap's settings and exports the metrics KEDA queries, and the
//! agent accepts the sidecar's arguments. The front load balancers' configs
//! are run by `front.rs`.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::*;
use serde_json::Value;

fn repo_file(path: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every document of a multi-document YAML file.
fn manifests(path: &str) -> Vec<Value> {
    serde_saphyr::from_multiple::<Value>(&repo_file(path))
        .unwrap_or_else(|e| panic!("{path} does not parse: {e}"))
}

/// The one object of `kind` named `name` in `docs`.
fn object<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let found: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .collect();
    assert_eq!(found.len(), 1, "one {kind} {name}");
    found[0]
}

fn container<'a>(deployment: &'a Value, name: &str) -> &'a Value {
    deployment["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("container {name}"))
}

/// The port number of a container's port named `name`.
fn named_port(container: &Value, name: &str) -> u64 {
    container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("port {name}"))
}

/// Whether every label `selector` asks for is on the pods of `deployment`.
fn selects(selector: &Value, deployment: &Value) -> bool {
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    let selector = selector.as_object().unwrap();
    !selector.is_empty() && selector.iter().all(|(k, v)| &labels[k] == v)
}

/// The argument after `flag` in a container's args.
fn arg<'a>(container: &'a Value, flag: &str) -> &'a str {
    let args = container["args"].as_array().unwrap();
    let at = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("{flag} in {args:?}"));
    args[at + 1].as_str().unwrap()
}

fn port_of(addr: &str) -> u64 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

#[test]
fn the_dockerfile_builds_both_binaries_and_runs_them_as_a_user() {
    let dockerfile = repo_file("Dockerfile");
    let froms = dockerfile
        .lines()
        .filter(|l| l.starts_with("FROM "))
        .count();
    assert_eq!(froms, 2, "multi-stage: a build stage and a runtime stage");
    for needed in [
        "-p flowgate-balancer",
        "-p flowgate-agent",
        "--profile dist",
        "target/dist/balancer",
        "target/dist/agent",
        "ENTRYPOINT [\"balancer\"]",
    ] {
        assert!(dockerfile.contains(needed), "Dockerfile lacks {needed}");
    }
    let user = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER line");
    assert!(!["root", "0"].contains(&user.trim()), "runs as root");
    let ignore = repo_file(".dockerignore");
    assert!(
        ignore.lines().any(|l| l == "target"),
        "the build context skips target/"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubernetes_manifests_agree_on_names_ports_and_probes() {
    let balancer = manifests("deploy/kubernetes/balancer.yaml");
    let servers = manifests("deploy/kubernetes/model-server.yaml");
    let keda = manifests("deploy/kubernetes/keda.yaml");
    let pool = manifests("deploy/kubernetes/inference-pool.yaml");

    // The balancers: two replicas, probes on the inference port, a budget
    // that keeps one, and time to drain before the kubelet's SIGKILL.
    let deployment = object(&balancer, "Deployment", "flowgate-balancer");
    assert_eq!(deployment["spec"]["replicas"], 2);
    assert!(selects(
        &deployment["spec"]["selector"]["matchLabels"],
        deployment
    ));
    let b = container(deployment, "balancer");
    assert_eq!(b["readinessProbe"]["httpGet"]["path"], "/health/ready");
    assert_eq!(b["livenessProbe"]["httpGet"]["path"], "/health/live");
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(b[probe]["httpGet"]["port"], "inference", "{probe}");
    }
    let pdb = object(&balancer, "PodDisruptionBudget", "flowgate-balancer");
    assert!(selects(&pdb["spec"]["selector"]["matchLabels"], deployment));
    assert_eq!(pdb["spec"]["minAvailable"], 1);

    // The ConfigMap's settings: the ports the container names, and a
    // balancer that starts on them.
    let config_text = object(&balancer, "ConfigMap", "flowgate-balancer")["data"]["balancer.yaml"]
        .as_str()
        .unwrap();
    let config: Value = serde_saphyr::from_str(config_text).unwrap();
    for (key, port) in [
        ("inferenceAddr", "inference"),
        ("managementAddr", "management"),
        ("eppAddr", "epp"),
    ] {
        assert_eq!(
            port_of(config[key].as_str().unwrap()),
            named_port(b, port),
            "{key}"
        );
    }
    let drain: u64 = config["drainDelay"]
        .as_str()
        .unwrap()
        .trim_end_matches('s')
        .parse()
        .unwrap();
    let grace: u64 = arg(b, "--shutdown-grace-period").parse().unwrap();
    let termination = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        .as_u64()
        .unwrap();
    assert!(termination > drain + grace, "SIGKILL before the drain ends");
    let file = ConfigFile::new(config_text);
    let epp = format!("127.0.0.1:{}", free_port());
    // Loopback addresses in a test: the flags override the file's.
    let running = Balancer::start(&["--config", file.arg(), "--epp-addr", &epp]).await;

    // Services: clients, the agents' headless one, the EPP.
    let clients = object(&balancer, "Service", "flowgate");
    assert!(selects(&clients["spec"]["selector"], deployment));
    assert_eq!(clients["spec"]["ports"][0]["targetPort"], "inference");
    let headless = object(&balancer, "Service", "flowgate-balancers");
    assert!(selects(&headless["spec"]["selector"], deployment));
    assert_eq!(headless["spec"]["clusterIP"], "None");
    assert_eq!(headless["spec"]["publishNotReadyAddresses"], true);
    assert_eq!(headless["spec"]["ports"][0]["targetPort"], "management");
    let epp_service = object(&balancer, "Service", "flowgate-epp");
    assert!(selects(&epp_service["spec"]["selector"], deployment));
    assert_eq!(epp_service["spec"]["ports"][0]["targetPort"], "epp");

    // The model servers: the agent sidecar reports to the headless Service
    // and names the server's own port.
    let model = object(&servers, "Deployment", "smollm2-llama-server");
    let server = container(model, "llama-server");
    let server_port = named_port(server, "http");
    let agent = container(model, "agent");
    assert_eq!(agent["command"][0], "agent");
    let management = arg(agent, "--management-addr");
    assert_eq!(
        management,
        format!(
            "flowgate-balancers:{}",
            headless["spec"]["ports"][0]["port"]
        )
    );
    assert_eq!(port_of(arg(agent, "--backend-addr")), server_port);
    assert_eq!(port_of(arg(agent, "--external-addr")), server_port);
    assert_eq!(arg(server, "--port"), server_port.to_string());
    let token = &object(&balancer, "Secret", "flowgate-management")["metadata"]["name"];
    for c in [b, agent] {
        let env = c["env"].as_array().unwrap();
        let from = env
            .iter()
            .find(|e| e["name"] == "FLOWGATE_MANAGEMENT_TOKEN")
            .expect("the management token");
        assert_eq!(&from["valueFrom"]["secretKeyRef"]["name"], token);
    }
    // The agent takes the sidecar's arguments (a bad flag exits at once).
    let args: Vec<String> = agent["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().replace("$(POD_IP)", "127.0.0.1"))
        .collect();
    let mut sidecar = Proc::spawn("agent", &args);
    let exited = tokio::task::block_in_place(|| sidecar.wait_exit(Duration::from_millis(1500)));
    assert!(
        exited.is_none(),
        "the agent refused its arguments: {exited:?}"
    );

    // KEDA scales the model servers on gauges the balancer exports.
    let scaled = object(&keda, "ScaledObject", "smollm2-servers");
    assert_eq!(
        scaled["spec"]["scaleTargetRef"]["name"],
        "smollm2-llama-server"
    );
    assert_eq!(scaled["spec"]["minReplicaCount"], 0, "scale from zero");
    let alias = arg(server, "--alias");
    // A request for the model, no server yet: demand the gauges show.
    let (url, asked) = (running.url("/v1/chat/completions"), alias.to_string());
    let waiting = tokio::spawn(async move {
        let _ = client()
            .post(url)
            .json(&chat_for(Some(&asked), "hi"))
            .send()
            .await;
    });
    running.wait_buffered(1).await;
    let metrics = metrics_text(&running).await;
    waiting.abort();
    for trigger in scaled["spec"]["triggers"].as_array().unwrap() {
        let query = trigger["metadata"]["query"].as_str().unwrap();
        let name = query
            .trim_start_matches("sum(")
            .split(['{', ')'])
            .next()
            .unwrap();
        assert!(
            metrics.contains(&format!("# TYPE {name} gauge")),
            "the balancer exports no gauge {name}"
        );
        if query.contains("model=") {
            assert!(query.contains(&format!("model=\"{alias}\"")), "{query}");
        }
    }

    // The InferencePool: the model server pods, Flowgate as its picker.
    let inference_pool = object(&pool, "InferencePool", "smollm2");
    assert!(selects(
        &inference_pool["spec"]["selector"]["matchLabels"],
        model
    ));
    assert_eq!(
        inference_pool["spec"]["targetPorts"][0]["number"],
        server_port
    );
    let picker = &inference_pool["spec"]["endpointPickerRef"];
    assert_eq!(picker["name"], "flowgate-epp");
    assert_eq!(
        picker["port"]["number"],
        epp_service["spec"]["ports"][0]["port"]
    );
    let route = object(&pool, "HTTPRoute", "smollm2");
    let backend = &route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(backend["kind"], "InferencePool");
    assert_eq!(backend["name"], "smollm2");
}
