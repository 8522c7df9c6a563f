//! nft rules, matches and values written back in nft's words, for reports.

use crate::nft::{self, Expr, MatchOp, Operand, Value};

pub(crate) fn describe_rule(rule: &nft::Rule) -> String {
    let mut parts: Vec<String> = rule.exprs.iter().map(describe_expr).collect();
    if let Some(c) = &rule.comment {
        parts.push(format!("comment {c:?}"));
    }
    parts.join(" ")
}

fn describe_expr(e: &Expr) -> String {
    match e {
        Expr::Match(m) => describe_match(m),
        Expr::Accept => "accept".into(),
        Expr::Drop => "drop".into(),
        Expr::Reject { kind: Some(k) } => format!("reject with {k}"),
        Expr::Reject { kind: None } => "reject".into(),
        Expr::Jump { target } => format!("jump {target}"),
        Expr::Goto { target } => format!("goto {target}"),
        Expr::Return => "return".into(),
        Expr::Continue => "continue".into(),
        Expr::Queue => "queue".into(),
        Expr::Counter => "counter".into(),
        Expr::Log { prefix: Some(p) } => format!("log prefix {p:?}"),
        Expr::Log { prefix: None } => "log".into(),
        Expr::Stateful { name } | Expr::Statement { name } => name.clone(),
        Expr::Nat { kind } => kind.clone(),
        Expr::Vmap { key, .. } => format!("{} vmap {{ ... }}", describe_operand(key)),
        Expr::Xt { kind, name } => format!("xt {kind} {name}"),
        Expr::Opaque(json) => json.clone(),
    }
}

pub(crate) fn describe_match(m: &nft::Match) -> String {
    let op = match &m.op {
        MatchOp::Eq => "",
        MatchOp::Ne => "!= ",
        MatchOp::In => "",
        MatchOp::Lt => "< ",
        MatchOp::Gt => "> ",
        MatchOp::Le => "<= ",
        MatchOp::Ge => ">= ",
        MatchOp::Other(o) => o.as_str(),
    };
    format!(
        "{} {op}{}",
        describe_operand(&m.left),
        describe_value(&m.right)
    )
}

fn describe_operand(o: &Operand) -> String {
    match o {
        Operand::Payload { protocol, field } => format!("{protocol} {field}"),
        Operand::Meta { key } => format!("meta {key}"),
        Operand::Ct { key } => format!("ct {key}"),
        Operand::Fib { result, flags } => format!("fib {} {result}", flags.join(" . ")),
        Operand::Bitwise { op, left, right } => {
            format!("{} {op} {}", describe_operand(left), describe_value(right))
        }
        Operand::Concat(parts) => parts
            .iter()
            .map(describe_operand)
            .collect::<Vec<_>>()
            .join(" . "),
        Operand::Opaque(json) => json.clone(),
    }
}

pub(super) fn describe_value(v: &Value) -> String {
    match v {
        Value::Number(n) => n.to_string(),
        Value::Text(t) => t.clone(),
        Value::SetRef(s) => format!("@{s}"),
        Value::Range(a, b) => format!("{}-{}", describe_value(a), describe_value(b)),
        Value::Prefix { addr, len } => format!("{addr}/{len}"),
        Value::Set(items) => format!(
            "{{ {} }}",
            items
                .iter()
                .map(describe_value)
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Value::List(items) => items
            .iter()
            .map(describe_value)
            .collect::<Vec<_>>()
            .join(","),
        Value::Concat(items) => items
            .iter()
            .map(describe_value)
            .collect::<Vec<_>>()
            .join(" . "),
        Value::Opaque(json) => json.clone(),
    }
}
