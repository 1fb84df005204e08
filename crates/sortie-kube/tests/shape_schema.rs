//! What the worker applies at start — a shape's `SandboxTemplate` and `SandboxWarmPool`, and its link
//! `Service` — passes the real agent-sandbox v1beta1 and Kubernetes schemas (vendored in `deploy/crds/agent-sandbox`) strictly: a field the
//! controller does not know would be pruned by the apiserver and silently not apply, so it fails here.
//! The check is `deploy/validate.py`, the same that `scripts/test` runs on `deploy/`.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use sortie_kube::shape::{SandboxShape, link_service, template, warm_pool};

#[test]
fn a_shapes_template_and_pool_pass_the_agent_sandbox_schemas() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let has_validator = Command::new("python3")
        .args(["-c", "import kubernetes_validate"])
        .status()
        .is_ok_and(|status| status.success());
    if !has_validator {
        // scripts/test installs it (through .ci/run) and runs the validator on deploy/ before the tests.
        eprintln!(
            "skipped a_shapes_template_and_pool_pass_the_agent_sandbox_schemas: python3 -m pip install kubernetes-validate==1.37.0"
        );
        return;
    }
    let shape = SandboxShape {
        name: "sortie-worker-0-default".into(),
        image: "sortie-sandbox:dev".into(),
        runtime_class: Some("gvisor".into()),
        cpu: "2".into(),
        memory: "2Gi".into(),
        ephemeral_storage: "10Gi".into(),
        replicas: 2,
        service_account: "sortie-sandbox".into(),
        gateway_url: "http://10.96.0.12:7072".into(),
        gateway_pods: BTreeMap::from([
            ("app.kubernetes.io/name".into(), "sortie".into()),
            ("app.kubernetes.io/component".into(), "worker".into()),
        ]),
        gateway_port: 7072,
    };
    let dir = tempfile::tempdir().expect("temp");
    let service = link_service(&shape.name, "sortie-worker-0", 7072);
    let objects = serde_json::json!([template(&shape), warm_pool(&shape), service]);
    let file = dir.path().join("shape.json");
    std::fs::write(&file, objects.to_string()).expect("write");
    let checked = Command::new("python3")
        .arg(root.join("deploy/validate.py"))
        .arg("--json")
        .arg(&file)
        .output()
        .expect("python3");
    let said = String::from_utf8_lossy(&checked.stdout);
    assert!(
        checked.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&checked.stderr)
    );
    for object in [
        "SandboxTemplate/sortie-worker-0-default",
        "SandboxWarmPool/sortie-worker-0-default",
        "Service/sortie-worker-0-default-link",
    ] {
        assert!(
            said.contains(&format!("ok {object} (")),
            "{object} was not checked: {said}"
        );
    }
}
