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

/// An action's slice holds its policies with their action constraints dropped (they
/// hold for every request the slice serves), and decides every request of that action
/// as the whole set does: the same decision, the same reasons, the same errors.
#[test]
fn an_actions_slice_without_action_constraints_decides_as_the_whole_set() {
    use cedar_policy::{Authorizer, Context, Entities, Request as CedarRequest};
    let schema = Schema::from_cedarschema_str(
        r#"entity User; entity Node;
        action a appliesTo { principal: User, resource: Node, context: { n: Long } };
        action b appliesTo { principal: User, resource: Node, context: { n: Long } };
        action c appliesTo { principal: User, resource: Node, context: { n: Long } };"#,
    )
    .unwrap()
    .0;
    let policies: PolicySet = r#"
        @id("p1") permit (principal, action in [Action::"a", Action::"b"], resource);
        @id("p2") permit (principal, action == Action::"c", resource) when { context.n > 0 };
        @id("f1") forbid (principal, action in [Action::"b", Action::"c"], resource) when { context.n > 5 };
        @id("f2") forbid (principal, action == Action::"a", resource) when { context.n + 9223372036854775807 > 0 };
        @id("f3") forbid (principal == User::"mallory", action, resource);
    "#
    .parse()
    .unwrap();
    let slices = slice_by_action(&policies, &schema);
    assert_eq!(slices.len(), 3);
    for (action, slice) in &slices {
        for p in slice.policies() {
            assert!(
                matches!(p.action_constraint(), ActionConstraint::Any),
                "{action}: {p}"
            );
        }
    }
    let describe = |r: &cedar_policy::Response| {
        let mut reasons: Vec<String> = r.diagnostics().reason().map(|id| id.to_string()).collect();
        reasons.sort();
        let mut errors: Vec<String> = r.diagnostics().errors().map(|e| e.to_string()).collect();
        errors.sort();
        format!("{:?} {reasons:?} {errors:?}", r.decision())
    };
    let mut compared = 0;
    for action in ["a", "b", "c"] {
        let action_uid: EntityUid = format!("Action::\"{action}\"").parse().unwrap();
        let slice = slices.get(&action_uid).unwrap();
        for principal in ["alice", "mallory"] {
            for n in [-1i64, 0, 1, 6, 9223372036854775807] {
                let request = CedarRequest::new(
                    format!("User::\"{principal}\"").parse().unwrap(),
                    action_uid.clone(),
                    "Node::\"n1\"".parse().unwrap(),
                    Context::from_json_value(serde_json::json!({"n": n}), None).unwrap(),
                    None,
                )
                .unwrap();
                let whole =
                    Authorizer::new().is_authorized(&request, &policies, &Entities::empty());
                let sliced = Authorizer::new().is_authorized(&request, slice, &Entities::empty());
                assert_eq!(
                    describe(&whole),
                    describe(&sliced),
                    "{action} {principal} {n}"
                );
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 30);
}
