//! Architecture invariant: the service's modules form no cycle.
//!
//! A module that imports another which imports it back cannot be read,
//! tested or moved alone; the layout (`src/lib.rs`) promises that a change
//! can be followed from the WAL to a guest's answer by reading the modules
//! in order. This test reads every `crate::` and `super::` path in
//! `src/` (comments excluded, `#[cfg(test)]` code included) and fails on a
//! cycle at any level: among the top-level modules, and among the children
//! of any one module (a parent and its own children are exempt: `mod.rs`
//! declares them, and they read the parent's types through `super::`).
//!
//! Written by hand, in std alone, rather than as `cargo modules
//! dependencies --acyclic` in CI: that tool builds from source on every
//! fresh CI machine (minutes on two cores) and then needs a nightly-free
//! rust-analyzer of a matching version; this test runs in milliseconds
//! inside `cargo test`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path below the crate root, e.g. `["http", "booking"]`.
type ModulePath = Vec<String>;

fn source_files(dir: &Path, found: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            source_files(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
}

/// `src/http/booking.rs` → `["http", "booking"]`; `src/http/mod.rs` → `["http"]`.
fn module_of(src: &Path, file: &Path) -> ModulePath {
    let relative = file.strip_prefix(src).expect("file under src");
    let mut parts: ModulePath = relative
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// The code of a line without its comment: a `//` outside a string literal
/// starts one (`"postgresql://..."` does not).
fn without_comment(line: &str) -> &str {
    let mut in_string = false;
    let mut previous = ' ';
    for (i, c) in line.char_indices() {
        match c {
            '"' if previous != '\\' => in_string = !in_string,
            '/' if !in_string && previous == '/' => return &line[..i - 1],
            _ => {}
        }
        previous = c;
    }
    line
}

/// The paths a `crate::` or `super::` reference names, braces expanded:
/// `crate::{a, b::{c, d}}` → `a`, `b::c`, `b::d`.
fn expand(group: &str) -> Vec<String> {
    let group = group.trim();
    let Some(open) = group.find('{') else {
        return vec![group.to_string()];
    };
    let prefix = &group[..open];
    let close = group.rfind('}').unwrap_or(group.len());
    let inner = &group[open + 1..close];
    let mut items = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&inner[start..]);
    items
        .into_iter()
        .filter(|item| !item.trim().is_empty())
        .flat_map(expand)
        .map(|tail| format!("{prefix}{tail}"))
        .collect()
}

/// Every `crate::…` and `super::…` reference in `code`, as written.
fn references(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    for anchor in ["crate::", "super::"] {
        let mut rest = code;
        while let Some(at) = rest.find(anchor) {
            let preceded_by_ident = rest[..at]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':');
            let tail = &rest[at + anchor.len()..];
            let mut end = 0;
            let mut depth = 0;
            for (i, c) in tail.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth > 0 => depth -= 1,
                    c if depth > 0 || c.is_alphanumeric() || c == '_' || c == ':' => {}
                    _ => break,
                }
                end = i + c.len_utf8();
            }
            if !preceded_by_ident {
                found.extend(
                    expand(&tail[..end])
                        .into_iter()
                        .map(|path| format!("{anchor}{path}")),
                );
            }
            rest = &tail[end..];
        }
    }
    found
}

/// The module a reference lands in: the longest known module on its path.
fn resolve(from: &ModulePath, reference: &str, known: &BTreeSet<ModulePath>) -> Option<ModulePath> {
    let mut segments: Vec<&str> = reference.split("::").filter(|s| !s.is_empty()).collect();
    let mut base: ModulePath = Vec::new();
    match segments.first() {
        Some(&"crate") => {
            segments.remove(0);
        }
        Some(&"super") => {
            base = from.clone();
            while segments.first() == Some(&"super") {
                segments.remove(0);
                base.pop();
            }
        }
        _ => return None,
    }
    let mut path = base;
    let mut landed = known.contains(&path).then(|| path.clone());
    for segment in segments {
        path.push(segment.to_string());
        if known.contains(&path) {
            landed = Some(path.clone());
        } else {
            break;
        }
    }
    landed
}

/// The child of `parent` that `module` sits in, if it sits below `parent`.
fn child_of(parent: &ModulePath, module: &ModulePath) -> Option<ModulePath> {
    (module.len() > parent.len() && module.starts_with(parent))
        .then(|| module[..=parent.len()].to_vec())
}

/// A cycle in `edges`, as the modules along it, if there is one.
fn find_cycle(edges: &BTreeMap<ModulePath, BTreeSet<ModulePath>>) -> Option<Vec<ModulePath>> {
    fn visit(
        node: &ModulePath,
        edges: &BTreeMap<ModulePath, BTreeSet<ModulePath>>,
        on_path: &mut Vec<ModulePath>,
        done: &mut BTreeSet<ModulePath>,
    ) -> Option<Vec<ModulePath>> {
        if let Some(at) = on_path.iter().position(|n| n == node) {
            let mut cycle = on_path[at..].to_vec();
            cycle.push(node.clone());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        on_path.push(node.clone());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, on_path, done) {
                return Some(cycle);
            }
        }
        on_path.pop();
        done.insert(node.clone());
        None
    }
    let mut done = BTreeSet::new();
    edges
        .keys()
        .find_map(|node| visit(node, edges, &mut Vec::new(), &mut done))
}

/// Every module, and the modules each one's code names.
fn module_graph(src: &Path) -> BTreeMap<ModulePath, BTreeSet<ModulePath>> {
    let mut files = Vec::new();
    source_files(src, &mut files);
    let known: BTreeSet<ModulePath> = files.iter().map(|f| module_of(src, f)).collect();
    let mut graph = BTreeMap::new();
    for file in &files {
        let module = module_of(src, file);
        let text = std::fs::read_to_string(file).expect("read source");
        let code: String = text
            .lines()
            .map(without_comment)
            .collect::<Vec<_>>()
            .join("\n");
        let targets: BTreeSet<ModulePath> = references(&code)
            .iter()
            .filter_map(|r| resolve(&module, r, &known))
            .filter(|target| *target != module)
            .collect();
        graph.insert(module, targets);
    }
    graph
}

fn describe(cycle: &[ModulePath]) -> String {
    cycle
        .iter()
        .map(|m| format!("crate::{}", m.join("::")))
        .collect::<Vec<_>>()
        .join(" -> ")
}

#[test]
fn the_service_modules_form_no_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = module_graph(&src);
    assert!(graph.len() > 30, "read only {} modules", graph.len());
    let parents: BTreeSet<ModulePath> = graph
        .keys()
        .flat_map(|m| (0..m.len()).map(|n| m[..n].to_vec()))
        .collect();
    for parent in &parents {
        // The children of `parent`, each standing for everything below it.
        let mut edges: BTreeMap<ModulePath, BTreeSet<ModulePath>> = BTreeMap::new();
        for (from, targets) in &graph {
            let Some(from_child) = child_of(parent, from) else {
                continue;
            };
            for target in targets {
                if let Some(to_child) = child_of(parent, target)
                    && to_child != from_child
                {
                    edges
                        .entry(from_child.clone())
                        .or_default()
                        .insert(to_child);
                }
            }
        }
        if let Some(cycle) = find_cycle(&edges) {
            panic!("module cycle: {}", describe(&cycle));
        }
    }
}

#[test]
fn the_reader_sees_grouped_imports_and_skips_comments() {
    let code = "use crate::{config, model::{Stay, xids}};\n// crate::http is a comment\nlet url = \"postgresql://x\"; use super::guests::stay_rules;";
    let cleaned: String = code
        .lines()
        .map(without_comment)
        .collect::<Vec<_>>()
        .join("\n");
    let found = references(&cleaned);
    assert_eq!(
        found,
        vec![
            "crate::config",
            "crate::model::Stay",
            "crate::model::xids",
            "super::guests::stay_rules",
        ]
    );
    let known: BTreeSet<ModulePath> = [
        vec![],
        vec!["model".into()],
        vec!["model".into(), "xids".into()],
    ]
    .into_iter()
    .collect();
    let from: ModulePath = vec!["search".into()];
    assert_eq!(
        resolve(&from, "crate::model::xids::AppliedXids", &known),
        Some(vec!["model".to_string(), "xids".to_string()])
    );
    assert_eq!(
        resolve(&from, "crate::model::Stay", &known),
        Some(vec!["model".to_string()])
    );

    let a: ModulePath = vec!["a".into()];
    let b: ModulePath = vec!["b".into()];
    let acyclic = BTreeMap::from([(a.clone(), BTreeSet::from([b.clone()]))]);
    assert_eq!(find_cycle(&acyclic), None);
    let cyclic = BTreeMap::from([
        (a.clone(), BTreeSet::from([b.clone()])),
        (b.clone(), BTreeSet::from([a.clone()])),
    ]);
    assert_eq!(find_cycle(&cyclic), Some(vec![a.clone(), b, a]));
}
