//! The route list kept true: `ROUTES` against the router itself, and the route tables of
//! README.md and of the crate's documentation against `ROUTES`.
//!
//! axum cannot list a router's routes, so `ROUTES` is written by hand beside `app()` and
//! pinned from both sides: the paths `app()`'s source passes to `.route(` are exactly its
//! paths, and through `oneshot` every listed method of a path is served while every other
//! method of it is refused with 405.

use std::collections::BTreeSet;

use axum::http::{Method, StatusCode};
use probity_server::ROUTES;

use crate::{call_raw, root, state};

/// The methods probed on every path: those the router could serve.
const METHODS: [Method; 5] = [
    Method::GET,
    Method::POST,
    Method::PUT,
    Method::DELETE,
    Method::PATCH,
];

fn listed() -> BTreeSet<(String, String)> {
    ROUTES
        .iter()
        .map(|(m, p)| ((*m).to_owned(), (*p).to_owned()))
        .collect()
}

/// The distinct paths of `ROUTES`, in order.
fn listed_paths() -> Vec<&'static str> {
    let mut paths: Vec<&str> = Vec::new();
    for (_, path) in ROUTES {
        if !paths.contains(path) {
            paths.push(path);
        }
    }
    paths
}

/// The string literals that follow `.route(` in the body of `app()`, in order.
fn paths_in_app_source() -> Vec<String> {
    let source = std::fs::read_to_string(root().join("hooks/server/src/lib.rs")).unwrap();
    let start = source.find("pub fn app(").expect("lib.rs defines app()");
    let end = start + source[start..].find("\n}\n").expect("app() ends");
    let body = &source[start..end];
    body.split(".route(")
        .skip(1)
        .map(|call| {
            let call = call.trim_start();
            assert!(
                call.starts_with('"'),
                "a .route( call in app() whose path is not a string literal: {call:.60}"
            );
            call[1..].split('"').next().unwrap().to_owned()
        })
        .collect()
}

#[test]
fn routes_lists_every_path_app_routes() {
    assert_eq!(
        paths_in_app_source(),
        listed_paths(),
        "ROUTES (hooks/server/src/lib.rs) and the paths app() routes differ"
    );
}

#[tokio::test]
async fn app_serves_exactly_the_methods_routes_lists() {
    let state = state();
    let routes = listed();
    for path in listed_paths() {
        let uri = path.replace("{type}", "Node").replace("{id}", "gpu-a1");
        for method in METHODS {
            let (status, body) = call_raw(&state, method.clone(), &uri, Vec::new(), None).await;
            if routes.contains(&(method.to_string(), path.to_owned())) {
                // A handler may answer 404 for a missing entity; the fallback's is the
                // router's own.
                assert!(
                    status != StatusCode::METHOD_NOT_ALLOWED && body["error"] != "no such route",
                    "ROUTES lists {method} {path} but app() does not serve it: {status} {body}"
                );
            } else {
                assert_eq!(
                    status,
                    StatusCode::METHOD_NOT_ALLOWED,
                    "app() serves {method} {path}, which ROUTES does not list: {body}"
                );
            }
        }
    }
    let (status, body) = call_raw(&state, Method::GET, "/v1/nothing", Vec::new(), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert_eq!(body["error"], "no such route");
}

/// The (method, path) pairs of the markdown table whose header is `| route | what |`:
/// every backquoted `METHOD /path` of its first column, without a query string.
fn table(text: &str, line_prefix: &str) -> BTreeSet<(String, String)> {
    let lines = text
        .lines()
        .map(|l| l.strip_prefix(line_prefix).unwrap_or(l).trim())
        .skip_while(|l| *l != "| route | what |")
        .skip(2);
    let mut pairs = BTreeSet::new();
    for line in lines.take_while(|l| l.starts_with('|')) {
        let first = line.split('|').nth(1).unwrap();
        for quoted in first.split('`').skip(1).step_by(2) {
            let (method, path) = quoted
                .split_once(' ')
                .unwrap_or_else(|| panic!("not `METHOD /path`: `{quoted}` in {line}"));
            let path = path.split('?').next().unwrap();
            pairs.insert((method.to_owned(), path.to_owned()));
        }
    }
    assert!(!pairs.is_empty(), "no `| route | what |` table found");
    pairs
}

fn assert_table_is_routes(file: &str, line_prefix: &str) {
    let text = std::fs::read_to_string(root().join(file)).unwrap();
    let documented = table(&text, line_prefix);
    let routes = listed();
    let missing: Vec<_> = routes.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&routes).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{file}'s route table differs from the router: missing {missing:?}, not served {extra:?}"
    );
}

#[test]
fn readme_route_table_is_the_router() {
    assert_table_is_routes("README.md", "");
}

#[test]
fn crate_doc_route_table_is_the_router() {
    assert_table_is_routes("hooks/server/src/lib.rs", "//!");
}
