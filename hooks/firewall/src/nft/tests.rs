//! Parser tests on small dumps in the shape nftables 1.0.6 prints.

use super::*;

#[test]
fn parses_tables_chains_rules_and_sets() {
    let json = br#"{"nftables": [
            {"metainfo": {"version": "1.0.6", "json_schema_version": 1}},
            {"table": {"family": "inet", "name": "f", "handle": 1}},
            {"set": {"family": "inet", "name": "iv", "table": "f", "type": "inet_service",
                     "flags": ["interval"], "elem": [{"range": [8000, 8100]}, 9000]}},
            {"chain": {"family": "inet", "table": "f", "name": "input", "handle": 1,
                       "type": "filter", "hook": "input", "prio": 0, "policy": "drop"}},
            {"chain": {"family": "inet", "table": "f", "name": "sub", "handle": 2}},
            {"rule": {"family": "inet", "table": "f", "chain": "input", "handle": 3,
                      "comment": "ssh",
                      "expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "tcp", "field": "dport"}}, "right": "@iv"}},
                               {"counter": {"packets": 0, "bytes": 0}},
                               {"xt": {"type": "match", "name": "multiport"}},
                               {"frobnicate": {"x": 1}},
                               {"jump": {"target": "sub"}}]}},
            {"flowtable": {"family": "inet", "name": "ft", "table": "f"}}
        ]}"#;
    let rs = parse(json).unwrap();
    assert_eq!(
        rs.metainfo.as_ref().unwrap().version.as_deref(),
        Some("1.0.6")
    );
    assert_eq!(rs.chains[0].base.as_ref().unwrap().policy, Policy::Drop);
    assert!(rs.chains[1].base.is_none());
    let r = &rs.rules[0];
    assert_eq!(r.comment.as_deref(), Some("ssh"));
    assert!(matches!(&r.exprs[0], Expr::Match(m) if m.right == Value::SetRef("iv".into())));
    assert_eq!(r.exprs[1], Expr::Counter);
    assert!(matches!(&r.exprs[2], Expr::Xt { name, .. } if name == "multiport"));
    assert_eq!(r.exprs[3], Expr::Opaque(r#"{"frobnicate":{"x":1}}"#.into()));
    assert_eq!(
        r.exprs[4],
        Expr::Jump {
            target: "sub".into()
        }
    );
    let s = rs.set(TableFamily::Inet, "f", "iv").unwrap();
    assert_eq!(s.elements.len(), 2);
    assert!(rs.table_uses_xt(TableFamily::Inet, "f"));
    assert_eq!(rs.others[0].0, "flowtable");
}

#[test]
fn errors_say_where() {
    let e = parse(br#"{"nftables": [{"table": {"family": "inet"}}]}"#).unwrap_err();
    assert_eq!(
        e.to_string(),
        "nft JSON at /nftables/0/table: missing \"name\""
    );
    let e = parse(br#"{"nftables": [{"chain": {"family": "ipx", "table": "t", "name": "c"}}]}"#)
        .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("nft JSON at /nftables/0/chain/family: unknown family")
    );
    let e = parse(b"{\"nftables\": [\n  {\"table\": }]}").unwrap_err();
    assert!(matches!(e, NftParseError::Json { line: 2, .. }), "{e}");
    let e = parse_with_limit(&[b' '; 100], 10).unwrap_err();
    assert_eq!(
        e.to_string(),
        "nft JSON is 100 bytes, more than the limit of 10"
    );
}
