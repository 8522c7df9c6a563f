use super::*;

/// A shape is remembered only once the schema accepted it: a request the schema
/// refuses is refused each time, and one it accepts decides the same from memory.
#[test]
fn a_request_shape_is_remembered_only_once_the_schema_accepted_it() {
    let engine = crate::Engine::from_embedded_defaults().unwrap();
    let decide =
        |body: serde_json::Value| engine.decide(&crate::Request::from_json_value(&body).unwrap());
    let bad = serde_json::json!({"principal": "Workload::\"w\"", "action": "schedule",
        "resource": "Namespace::\"inference\""});
    for _ in 0..2 {
        let d = decide(bad.clone());
        assert!(d.errors[0].message.contains("invalid request"), "{d:?}");
    }
    let shapes = || engine.snapshot_now().bundle.valid_shapes.len();
    assert_eq!(shapes(), 0);
    let good = serde_json::json!({"principal": "Workload::\"w\"", "action": "schedule",
        "resource": "Node::\"n\""});
    let first = decide(good.clone());
    assert_eq!(shapes(), 1);
    let again = decide(good);
    assert_eq!(first.decision, again.decision);
    assert_eq!(
        format!("{:?}", first.reasons),
        format!("{:?}", again.reasons)
    );
    assert_eq!(format!("{:?}", first.errors), format!("{:?}", again.errors));
    assert_eq!(shapes(), 1);
}

#[test]
fn spans_skip_comments_and_strings() {
    let text = "// a; b\n@id(\"x;y\")\npermit(principal, action, resource);\n\nforbid(principal, action, resource) when { context.a == \"}\" };";
    let spans = policy_spans(text);
    assert_eq!(spans.len(), 2);
    assert!(text[spans[0].0..].starts_with("@id"));
    assert!(text[spans[1].0..].starts_with("forbid"));
    assert!(text[..spans[1].0 + spans[1].1].ends_with("};"));
}

#[test]
fn targets_parse() {
    assert_eq!(
        parse_target("resource.zone").unwrap(),
        TargetPath {
            root: TargetRoot::Resource,
            attrs: vec!["zone".into()]
        }
    );
    assert!(parse_target("context.x").is_err());
    assert!(parse_target("principal..a").is_err());
}

#[test]
fn message_placeholders_parse_and_braces_escape() {
    assert_eq!(
        MessageTemplate::parse("plain").unwrap(),
        MessageTemplate::Plain("plain".into())
    );
    let t = MessageTemplate::parse("model {resource.gpuModel} on {{x}}").unwrap();
    assert_eq!(
        t,
        MessageTemplate::Parts(vec![
            MessagePart::Text("model ".into()),
            MessagePart::Path(TargetPath {
                root: TargetRoot::Resource,
                attrs: vec!["gpuModel".into()]
            }),
            MessagePart::Text(" on {x}".into()),
        ])
    );
    assert!(MessageTemplate::parse("open {resource").is_err());
    assert!(MessageTemplate::parse("{action.x}").is_err());
    assert!(MessageTemplate::parse("stray }").is_err());
}
