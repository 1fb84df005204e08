//! The dashboard's API types are generated from `web/openapi.json` (openapi-typescript); this test keeps
//! that copy equal to the document the server serves, so a changed field, optionality or enum in the API
//! fails here until the copy (and with it the generated types) is refreshed:
//!
//! ```sh
//! SORTIE_UPDATE_OPENAPI=1 cargo test -p sortie-server --test openapi && npm run gen:api --prefix web
//! ```

use std::path::PathBuf;

#[test]
fn the_dashboards_copy_of_the_openapi_document_is_current() {
    let snapshot = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../web/openapi.json");
    let served = serde_json::to_string_pretty(&sortie_server::openapi()).expect("the document serializes") + "\n";
    if std::env::var_os("SORTIE_UPDATE_OPENAPI").is_some_and(|v| v == "1") {
        std::fs::write(&snapshot, &served).expect("write web/openapi.json");
        return;
    }
    let copy = std::fs::read_to_string(&snapshot).unwrap_or_default();
    if copy != served {
        let line = copy
            .lines()
            .zip(served.lines())
            .position(|(a, b)| a != b)
            .map_or(copy.lines().count().min(served.lines().count()) + 1, |i| i + 1);
        panic!(
            "web/openapi.json differs from the server's OpenAPI document (first at line {line}: {:?} vs {:?}).\n\
             Refresh it and the dashboard's generated types:\n  \
             SORTIE_UPDATE_OPENAPI=1 cargo test -p sortie-server --test openapi && npm run gen:api --prefix web",
            copy.lines().nth(line - 1).unwrap_or("<end>"),
            served.lines().nth(line - 1).unwrap_or("<end>"),
        );
    }
}
