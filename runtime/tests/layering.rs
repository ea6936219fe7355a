//! The runtime's top-level modules (`program`, `cpu`, `cuda`, `collective`, `trace`,
//! `kernels`, ...) must not use each other in a circle: each file's `crate::<module>`
//! paths give the edges, and the graph must have a topological order.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// `top-level module -> the modules its files name as crate::<m>`.
fn edges(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(p) = stack.pop() {
        for e in std::fs::read_dir(&p).expect("read runtime/src") {
            let path = e.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().and_then(|x| x.to_str()) != Some("rs") {
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src");
            let first = rel.components().next().expect("a component");
            let module = first
                .as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string();
            if module == "lib" {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("read a source file");
            let deps = out.entry(module.clone()).or_default();
            for (i, _) in text.match_indices("crate::") {
                let rest = &text[i + "crate::".len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() && name != module {
                    deps.insert(name);
                }
            }
        }
    }
    out
}

/// A circle of `g`, if it has one.
fn circle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(n) {
            Some(2) => return None,
            Some(1) => {
                let at = path.iter().position(|p| p == n).unwrap_or(0);
                let mut c = path[at..].to_vec();
                c.push(n.to_string());
                return Some(c);
            }
            _ => {}
        }
        state.insert(n.to_string(), 1);
        path.push(n.to_string());
        for d in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(d, g, state, path) {
                return Some(c);
            }
        }
        path.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in g.keys() {
        if let Some(c) = visit(n, g, &mut state, &mut Vec::new()) {
            return Some(c);
        }
    }
    None
}

#[test]
fn the_runtime_modules_use_each_other_in_no_circle() {
    let g = edges(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    for m in ["program", "cpu", "cuda", "collective", "trace", "kernels"] {
        assert!(g.contains_key(m), "no module {m} in runtime/src: {g:?}");
    }
    assert_eq!(circle(&g), None, "the runtime's modules: {g:?}");
    // the analyses and the collectives need no device
    for m in ["program", "collective", "trace", "kernels"] {
        assert!(!g[m].contains("cuda"), "{m} uses cuda: {:?}", g[m]);
    }
}

#[test]
fn the_circle_check_finds_a_circle() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.entry("a".into()).or_default().insert("b".into());
    g.entry("b".into()).or_default().insert("c".into());
    g.entry("c".into()).or_default().insert("a".into());
    let c = circle(&g).expect("a circle");
    assert_eq!(c.first(), c.last());
    assert_eq!(c.len(), 4);
}
