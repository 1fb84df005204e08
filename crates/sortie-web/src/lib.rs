//! The sortie dashboard: `web/` (React + Vite), built by this crate's build.rs with the host's npm and
//! embedded in the binary. [`router`] serves it: the built files by path, and `index.html` for every
//! other path (the app routes on the client), with content types and cache headers.

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, Method, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};

mod assets {
    include!(concat!(env!("OUT_DIR"), "/assets.rs"));
}

/// One embedded file of the dashboard.
pub fn asset(path: &str) -> Option<&'static [u8]> {
    assets::ASSETS
        .iter()
        .find(|(url, _)| *url == path)
        .map(|(_, bytes)| *bytes)
}

/// Every embedded file's URL path.
pub fn paths() -> impl Iterator<Item = &'static str> {
    assets::ASSETS.iter().map(|(url, _)| *url)
}

fn content_type(path: &str) -> &'static str {
    let extension = path.rsplit_once('.').map(|(_, ext)| ext).unwrap_or("");
    match extension {
        "html" => "text/html; charset=utf-8",
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "json" | "map" => "application/json",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "ico" => "image/x-icon",
        "woff2" => "font/woff2",
        "txt" => "text/plain; charset=utf-8",
        _ => "application/octet-stream",
    }
}

fn accepts_gzip(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|coding| {
            let mut fields = coding.split(';');
            let name = fields.next().unwrap_or("").trim();
            let refused = fields.any(|param| matches!(param.trim(), "q=0" | "q=0.0" | "q=0.00" | "q=0.000"));
            name.eq_ignore_ascii_case("gzip") && !refused
        })
}

/// A file, or its gzip twin (built beside it as `name.gz`) when the browser takes gzip.
fn respond_encoded(path: &str, bytes: &'static [u8], request: &Request<Body>) -> Response {
    let twin = asset(&format!("{path}.gz"));
    let mut response = match twin.filter(|_| accepts_gzip(request.headers())) {
        Some(gzipped) => {
            let mut response = respond(path, gzipped, request.method());
            response
                .headers_mut()
                .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
            response
        }
        None => respond(path, bytes, request.method()),
    };
    if twin.is_some() {
        response
            .headers_mut()
            .insert(header::VARY, HeaderValue::from_static("accept-encoding"));
    }
    response
}

fn respond(path: &str, bytes: &'static [u8], method: &Method) -> Response {
    // Vite names everything under /assets/ by its content hash: cache it for good. The rest (index.html
    // first) is revalidated every time so a new binary's app is picked up at once.
    let cache = if path.starts_with("/assets/") {
        "public, max-age=31536000, immutable"
    } else {
        "no-cache"
    };
    let body = if method == Method::HEAD {
        Body::empty()
    } else {
        Body::from(bytes)
    };
    let mut response = (StatusCode::OK, body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type(path)));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static(cache));
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    if path.ends_with(".html") {
        headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
        headers.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(
                "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'",
            ),
        );
    }
    response
}

/// Answers one request for the dashboard: a built file, `index.html` for an app route, 404 for a
/// missing file (a path with an extension), 405 for anything but GET and HEAD.
pub async fn serve(request: Request<Body>) -> Response {
    let method = request.method().clone();
    if method != Method::GET && method != Method::HEAD {
        return (StatusCode::METHOD_NOT_ALLOWED, "the dashboard only answers GET\n").into_response();
    }
    let path = request.uri().path();
    if let Some(bytes) = asset(path).filter(|_| path != "/") {
        return respond_encoded(path, bytes, &request);
    }
    let last = path.rsplit('/').next().unwrap_or("");
    if path.starts_with("/assets/") || last.contains('.') {
        return (StatusCode::NOT_FOUND, "no such file\n").into_response();
    }
    match asset("/index.html") {
        Some(index) => respond_encoded("/index.html", index, &request),
        None => (StatusCode::NOT_FOUND, "no dashboard in this build\n").into_response(),
    }
}

/// The dashboard as a router with only a fallback: merge it under an API, or use [`serve`] as the
/// API's fallback for paths that are not its own.
pub fn router() -> Router {
    Router::new().fallback(serve)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    async fn get(path: &str) -> (StatusCode, String, String, Vec<u8>) {
        get_with(path, &[]).await
    }

    async fn get_with(path: &str, headers: &[(&str, &str)]) -> (StatusCode, String, String, Vec<u8>) {
        let mut request = Request::get(path);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = serve(request.body(Body::empty()).expect("a request")).await;
        if let Some(encoding) = response.headers().get(header::CONTENT_ENCODING) {
            assert_eq!(encoding, "gzip");
            assert_eq!(response.headers().get(header::VARY).expect("vary"), "accept-encoding");
        }
        let status = response.status();
        let header = |name| {
            response
                .headers()
                .get(name)
                .map(|v: &HeaderValue| v.to_str().expect("ascii").to_owned())
                .unwrap_or_default()
        };
        let (kind, cache) = (header(header::CONTENT_TYPE), header(header::CACHE_CONTROL));
        let body = response
            .into_body()
            .collect()
            .await
            .expect("a body")
            .to_bytes()
            .to_vec();
        (status, kind, cache, body)
    }

    #[tokio::test]
    async fn index_for_app_routes_hashed_assets_cached_missing_files_404() {
        let (status, kind, cache, body) = get("/").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(kind, "text/html; charset=utf-8");
        assert_eq!(cache, "no-cache");
        let index = String::from_utf8(body).expect("utf-8");
        assert!(index.contains("<html") || index.contains("<!doctype"), "{index}");

        let (status, kind, _, app_route) = get("/sessions/ses_01ABC").await;
        assert_eq!((status, kind.as_str()), (StatusCode::OK, "text/html; charset=utf-8"));
        assert_eq!(String::from_utf8(app_route).expect("utf-8"), index);

        for path in paths().filter(|p| p.starts_with("/assets/")) {
            let (status, kind, cache, _) = get(path).await;
            assert_eq!(status, StatusCode::OK, "{path}");
            assert_eq!(cache, "public, max-age=31536000, immutable", "{path}");
            if path.ends_with(".js") {
                assert_eq!(kind, "text/javascript; charset=utf-8");
            }
        }
        assert_eq!(get("/assets/nope-123.js").await.0, StatusCode::NOT_FOUND);
        assert_eq!(get("/favicon-missing.png").await.0, StatusCode::NOT_FOUND);

        // Browsers that take gzip get the build's gzip twin of each script, stylesheet and page.
        let script = paths()
            .find(|p| p.starts_with("/assets/") && p.ends_with(".js"))
            .expect("a script");
        let (_, _, _, plain) = get(script).await;
        let (status, kind, _, gzipped) = get_with(script, &[("accept-encoding", "gzip, deflate, br")]).await;
        assert_eq!(
            (status, kind.as_str()),
            (StatusCode::OK, "text/javascript; charset=utf-8")
        );
        assert!(gzipped.len() < plain.len() / 2, "{} vs {}", gzipped.len(), plain.len());
        assert_eq!(&gzipped[..2], &[0x1f, 0x8b], "gzip magic");
        let (_, _, _, refused) = get_with(script, &[("accept-encoding", "gzip;q=0, br")]).await;
        assert_eq!(refused, plain);

        let post = serve(Request::post("/").body(Body::empty()).expect("a request")).await;
        assert_eq!(post.status(), StatusCode::METHOD_NOT_ALLOWED);
    }
}
