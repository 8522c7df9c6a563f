//! The import graph of `engine/src`, checked so that it cannot drift back into one
//! circle (ARCHITECTURE.md, "Import circles").
//!
//! A module is a top-level file of `engine/src` or a top-level directory with its file
//! (`engine/`, `state/`, `plugin.rs` with `plugin/`); it imports another when its
//! non-test code names `crate::<other>`. A circle is a strongly connected set of
//! modules.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The largest import circle allowed inside `engine/src`.
const MAX_CIRCLE: usize = 3;

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without its comments and its inline test module.
fn code_of(text: &str) -> String {
    let text = text
        .split("#[cfg(test)]\nmod tests {")
        .next()
        .unwrap_or(text);
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Module -> the modules it names.
fn import_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let relative = file.strip_prefix(src).unwrap();
        let first = relative.components().next().unwrap().as_os_str();
        let module = first.to_str().unwrap().trim_end_matches(".rs").to_owned();
        if module == "lib" || file.file_name().is_some_and(|n| n == "tests.rs") {
            continue;
        }
        let code = code_of(&std::fs::read_to_string(file).unwrap());
        let names = graph.entry(module).or_default();
        for (at, _) in code.match_indices("crate::") {
            let rest = &code[at + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if !name.is_empty() {
                names.insert(name);
            }
        }
    }
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for (module, names) in &mut graph {
        names.retain(|n| n != module && modules.contains(n));
    }
    graph
}

/// The strongly connected sets of `graph` (Tarjan).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    struct Walk<'g> {
        graph: &'g BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        found: Vec<BTreeSet<String>>,
    }
    impl<'g> Walk<'g> {
        fn visit(&mut self, v: &'g str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in &self.graph[v] {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut set = BTreeSet::new();
                loop {
                    let w = self.stack.pop().unwrap();
                    self.on_stack.remove(w);
                    set.insert(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                self.found.push(set);
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.found
}

#[test]
fn no_import_circle_in_the_engine_spans_more_than_three_modules() {
    let graph = import_graph(&crate::root().join("engine/src"));
    assert!(
        graph.len() > 20 && graph.contains_key("engine") && graph.contains_key("state"),
        "the graph was not read: {:?}",
        graph.keys().collect::<Vec<_>>()
    );
    let too_large: Vec<_> = circles(&graph)
        .into_iter()
        .filter(|c| c.len() > MAX_CIRCLE)
        .collect();
    assert!(
        too_large.is_empty(),
        "modules of engine/src that import each other in a circle of more than {MAX_CIRCLE}: {too_large:?}"
    );
}

#[test]
fn the_circle_check_sees_a_circle() {
    // The check itself, on a graph with a circle of four and one of two.
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, to) in [
        ("a", "b"),
        ("b", "c"),
        ("c", "d"),
        ("d", "a"),
        ("e", "f"),
        ("f", "e"),
    ] {
        graph.entry(from.into()).or_default().insert(to.into());
        graph.entry(to.into()).or_default();
    }
    let mut sizes: Vec<usize> = circles(&graph).iter().map(BTreeSet::len).collect();
    sizes.sort_unstable();
    assert_eq!(sizes, [2, 4]);
}
