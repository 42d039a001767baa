//! House rules on the crate's own source, read as text: no source file over
//! [`MAX_FILE_LINES`] lines of code and no function longer than [`MAX_FN_LINES`] lines
//! outside tests, no import cycle between a crate's top-level modules, and none between the
//! modules of one folder.
//!
//! The source of every crate of the workspace is walked from its root (`src/lib.rs`,
//! `gateway/src/lib.rs`, each program's `main.rs`) along `mod` declarations,
//! leaving out items under `#[cfg(test)]` and modules named `tests`. Comments, strings and
//! character literals are blanked before anything is looked at, so a brace or a `crate::` in
//! them counts for nothing. A function's length runs from its `fn` line to the line of its
//! closing brace, both included.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;
use std::path::Path;

/// The longest function body the house allows, in lines.
const MAX_FN_LINES: usize = 80;

/// The most lines of code one source file holds: blank lines, comments (doc comments
/// included) and tests aside.
const MAX_FILE_LINES: usize = 800;

#[test]
fn no_source_file_holds_more_than_800_lines_of_code() {
    let mut long: Vec<(usize, String)> = crate_files()
        .iter()
        .map(|f| {
            let lines = f.code.lines().filter(|l| !l.trim().is_empty()).count();
            (lines, f.path.clone())
        })
        .filter(|(lines, _)| *lines > MAX_FILE_LINES)
        .collect();
    long.sort_by_key(|(lines, _)| std::cmp::Reverse(*lines));
    let report: String = long
        .iter()
        .map(|(lines, path)| format!("  {lines:>5} lines  {path}\n"))
        .collect();
    assert!(
        long.is_empty(),
        "source files over {MAX_FILE_LINES} lines of code:\n{report}"
    );
}

#[test]
fn no_function_is_longer_than_80_lines() {
    let mut long: Vec<Function> = crate_files()
        .iter()
        .flat_map(functions)
        .filter(|f| f.lines > MAX_FN_LINES)
        .collect();
    long.sort_by_key(|f| std::cmp::Reverse(f.lines));
    let mut report = String::new();
    for f in &long {
        let _ = writeln!(
            report,
            "  {:>4} lines  {}:{}  fn {}",
            f.lines, f.file, f.line, f.name
        );
    }
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines outside tests:\n{report}"
    );
}

#[test]
fn top_level_modules_import_no_cycle() {
    let mut report = String::new();
    for (krate, files) in by_crate(crate_files()) {
        let reexports = root_reexports(&files);
        // edges[from][to] = where `from` names `to` first.
        let mut edges: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
        for file in &files {
            let Some(from) = file.module.first() else {
                continue;
            };
            for (target, line) in crate_references(file, &reexports) {
                if &target != from {
                    edges
                        .entry(from.clone())
                        .or_default()
                        .entry(target)
                        .or_insert_with(|| format!("{}:{line}", file.path));
                }
            }
        }
        report += &cycles_report(&krate, &edges);
    }
    assert!(
        report.is_empty(),
        "import cycles between top-level modules:\n{report}"
    );
}

#[test]
fn sibling_modules_import_no_cycle() {
    let mut report = String::new();
    for (krate, files) in by_crate(crate_files()) {
        for (parent, edges) in sibling_edges(&files) {
            report += &cycles_report(&format!("{krate}::{parent}"), &edges);
        }
    }
    assert!(
        report.is_empty(),
        "import cycles between the modules of one folder:\n{report}"
    );
}

/// The files of each crate (a library and a program are two), by crate.
fn by_crate(files: Vec<SourceFile>) -> BTreeMap<String, Vec<SourceFile>> {
    let mut crates: BTreeMap<String, Vec<SourceFile>> = BTreeMap::new();
    for file in files {
        crates.entry(file.krate.clone()).or_default().push(file);
    }
    crates
}

/// The cycles among the modules of `parent` (`edges[from][to]`: where `from` names `to`
/// first), each with the uses that make it; empty when there are none.
fn cycles_report(parent: &str, edges: &BTreeMap<String, BTreeMap<String, String>>) -> String {
    let mut report = String::new();
    for cycle in cycles(edges) {
        let _ = writeln!(report, "  in {parent}: {}", cycle.join(" <-> "));
        for from in &cycle {
            for to in &cycle {
                if let Some(at) = edges.get(from).and_then(|e| e.get(to)) {
                    let _ = writeln!(report, "    {from} uses {to} at {at}");
                }
            }
        }
    }
    report
}

/// For each module with child modules, which child uses which sibling (and where first):
/// through `crate::`, `super::` or `self::` paths, and names the parent re-exports from a
/// child.
fn sibling_edges(
    files: &[SourceFile],
) -> BTreeMap<String, BTreeMap<String, BTreeMap<String, String>>> {
    let children = |parent: &[String]| -> BTreeSet<String> {
        files
            .iter()
            .filter(|f| f.module.len() == parent.len() + 1 && f.module.starts_with(parent))
            .map(|f| f.module[parent.len()].clone())
            .collect()
    };
    let mut all = BTreeMap::new();
    for parent_file in files.iter().filter(|f| !f.module.is_empty()) {
        let parent = &parent_file.module;
        let kids = children(parent);
        if kids.len() < 2 {
            continue;
        }
        // Names the parent brings in from a child: `pub use self::slots::SlotLease`.
        let mut reexports = BTreeMap::new();
        for (path, _) in use_paths(&parent_file.code) {
            if let Some(abs) = absolute(parent, &path)
                && abs.len() > parent.len() + 1
                && abs.starts_with(parent)
                && kids.contains(&abs[parent.len()])
            {
                reexports.insert(abs[abs.len() - 1].clone(), abs[parent.len()].clone());
            }
        }
        let mut edges: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
        for file in files
            .iter()
            .filter(|f| f.module.len() > parent.len() && f.module.starts_with(parent))
        {
            let from = &file.module[parent.len()];
            for (path, line) in module_paths(file) {
                let Some(abs) = absolute(&file.module, &path) else {
                    continue;
                };
                if abs.len() <= parent.len() || !abs.starts_with(parent) {
                    continue;
                }
                let next = &abs[parent.len()];
                let to = if kids.contains(next) {
                    next.clone()
                } else if let Some(child) = reexports.get(next) {
                    child.clone()
                } else {
                    continue;
                };
                if &to != from {
                    edges
                        .entry(from.clone())
                        .or_default()
                        .entry(to)
                        .or_insert_with(|| format!("{}:{line}", file.path));
                }
            }
        }
        all.insert(parent.join("::"), edges);
    }
    all
}

/// `path` as named in module `module`, from the crate root; `None` for a path that does not
/// start at `crate`, `super` or `self`.
fn absolute(module: &[String], path: &[String]) -> Option<Vec<String>> {
    match path.first().map(String::as_str) {
        Some("crate") => Some(path[1..].to_vec()),
        Some("self") => Some([module, &path[1..]].concat()),
        Some("super") => {
            let ups = path.iter().take_while(|s| *s == "super").count();
            let base = module.len().checked_sub(ups)?;
            Some([&module[..base], &path[ups..]].concat())
        }
        _ => None,
    }
}

/// The checks themselves, on small pieces of source.
#[test]
fn the_checks_read_source_as_rust() {
    let code = blank(
        "fn a() {\n let s = \"}\"; // }\n let c = '}'; let r = r#\"{\"#;\n /* { */ }\n\
         #[cfg(test)]\nmod tests { fn long() {\n\n\n} }\nfn b<'a>(x: &'a str) -> impl Fn() { || {} }\n",
    );
    let file = SourceFile {
        path: "x.rs".into(),
        krate: "lib".into(),
        module: vec!["x".into()],
        code,
    };
    let found: Vec<(String, usize, usize)> = functions(&file)
        .into_iter()
        .map(|f| (f.name, f.line, f.lines))
        .collect();
    assert_eq!(found, [("a".into(), 1, 4), ("b".into(), 10, 1)]);

    let file = SourceFile {
        path: "src/store/x.rs".into(),
        krate: "lib".into(),
        module: vec!["store".into(), "x".into()],
        code: blank(
            "use super::y;\nuse crate::{job::Job, store::Z};\nuse super::super::gate::G;\n\
             fn f() { crate::Busy::new(); }\n",
        ),
    };
    let reexports = BTreeMap::from([("Busy".to_owned(), "tier_slot_limit".to_owned())]);
    let targets: BTreeSet<String> = crate_references(&file, &reexports)
        .into_iter()
        .map(|(t, _)| t)
        .collect();
    assert_eq!(
        targets,
        BTreeSet::from([
            "gate".into(),
            "job".into(),
            "store".into(),
            "tier_slot_limit".into()
        ])
    );

    let edges = BTreeMap::from([
        (
            "a".to_owned(),
            BTreeMap::from([("b".to_owned(), String::new())]),
        ),
        (
            "b".to_owned(),
            BTreeMap::from([("a".to_owned(), String::new())]),
        ),
        (
            "c".to_owned(),
            BTreeMap::from([("a".to_owned(), String::new())]),
        ),
    ]);
    assert_eq!(cycles(&edges), [vec!["a".to_owned(), "b".to_owned()]]);

    // Sibling modules: `super::` from a child, a parent's re-export, `crate::` paths.
    let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        absolute(&strings(&["store", "x"]), &strings(&["super", "y", "Z"])),
        Some(strings(&["store", "y", "Z"]))
    );
    assert_eq!(
        absolute(&strings(&["store"]), &strings(&["self", "y"])),
        Some(strings(&["store", "y"]))
    );
    assert_eq!(
        absolute(&strings(&["a"]), &strings(&["super", "super", "b"])),
        None
    );
    let file = |module: &[&str], code: &str| SourceFile {
        path: format!("src/{}.rs", module.join("/")),
        krate: "lib".into(),
        module: strings(module),
        code: blank(code),
    };
    let files = [
        file(&["p"], "mod x;\nmod y;\npub use self::y::Y;\n"),
        file(&["p", "x"], "use super::Y;\n"),
        file(&["p", "y"], "fn f() { crate::p::x::g(); }\n"),
    ];
    let edges = sibling_edges(&files);
    assert_eq!(cycles(&edges["p"]), [strings(&["x", "y"])]);
}

/// One source file of a crate, with comments and literals blanked.
struct SourceFile {
    /// Relative to the package root.
    path: String,
    /// `lib`, or the binary's name.
    krate: String,
    /// The module path inside the crate; empty for the crate root.
    module: Vec<String>,
    code: String,
}

struct Function {
    file: String,
    name: String,
    line: usize,
    lines: usize,
}

/// The library's public surface, as a list of its `pub` items, is the one in
/// `tests/public_api.txt`: an item added, removed or renamed fails here until the list
/// is written again (`FAIRGATE_BLESS_API=1 cargo test --test house`), so the surface changes
/// only on purpose and the diff of the list shows how. A `pub` method names its module, not
/// its type; `pub(crate)` items are not listed.
#[test]
fn the_public_api_changes_only_on_purpose() {
    let listed = public_api(&crate_files());
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/public_api.txt");
    if std::env::var_os("FAIRGATE_BLESS_API").is_some() {
        fs::write(&file, listed.join("\n") + "\n").expect("write tests/public_api.txt");
        return;
    }
    let kept = fs::read_to_string(&file).unwrap_or_default();
    let kept: BTreeSet<&str> = kept.lines().collect();
    let now: BTreeSet<&str> = listed.iter().map(String::as_str).collect();
    let added: Vec<_> = now.difference(&kept).collect();
    let removed: Vec<_> = kept.difference(&now).collect();
    assert!(
        added.is_empty() && removed.is_empty(),
        "the public API changed; if on purpose, FAIRGATE_BLESS_API=1 cargo test --test house\n\
         added:\n  {}\nremoved:\n  {}",
        added.iter().map(|s| **s).collect::<Vec<_>>().join("\n  "),
        removed.iter().map(|s| **s).collect::<Vec<_>>().join("\n  "),
    );
}

/// `module kind name` for every `pub` item of the library (`pub use` with its path), by the
/// module that defines it, sorted. The crate warns of an unreachable `pub` (`unreachable_pub`),
/// so each is reachable from outside: a private module's items through a re-export.
fn public_api(files: &[SourceFile]) -> Vec<String> {
    let mut items = Vec::new();
    for file in files.iter().filter(|f| f.krate == "lib") {
        let module = match file.module.join("::") {
            m if m.is_empty() => "fairgate".to_owned(),
            m => format!("fairgate::{m}"),
        };
        for (kind, name) in pub_words(&file.code) {
            items.push(format!("{module} {kind} {name}"));
        }
    }
    items.sort();
    items.dedup();
    items
}

/// The (kind, name) of each `pub` item in `code`: `fn`, `struct`, ..., `field` for a public
/// field, `use` with the path it re-exports.
fn pub_words(code: &str) -> Vec<(String, String)> {
    let words = words(code);
    let mut found = Vec::new();
    for (i, w) in words.iter().enumerate() {
        // `pub` alone: `pub(crate)` and `pub(super)` are not the crate's surface.
        if w.text != "pub" || code[w.end..].trim_start().starts_with('(') {
            continue;
        }
        let mut at = i + 1;
        while words.get(at).is_some_and(|k| {
            matches!(k.text, "async" | "unsafe" | "const" | "extern")
                && words
                    .get(at + 1)
                    .is_some_and(|n| matches!(n.text, "fn" | "unsafe" | "extern"))
        }) {
            at += 1;
        }
        let (Some(kind), Some(name)) = (words.get(at), words.get(at + 1)) else {
            continue;
        };
        match kind.text {
            "use" => {
                let end = code[kind.end..]
                    .find(';')
                    .map_or(code.len(), |e| kind.end + e);
                let path: String = code[kind.end..end].split_whitespace().collect();
                found.push(("use".to_owned(), path));
            }
            "fn" | "struct" | "enum" | "trait" | "type" | "const" | "static" | "mod" | "union"
            | "macro" => found.push((kind.text.to_owned(), name.text.to_owned())),
            _ if code[kind.end..].trim_start().starts_with(':') => {
                found.push(("field".to_owned(), kind.text.to_owned()));
            }
            _ => {}
        }
    }
    found
}

/// The crates of the workspace: a name for each (as the reports say it) and its root file.
const CRATES: [(&str, &str); 6] = [
    ("lib", "src/lib.rs"),
    ("fairgate_gateway", "gateway/src/lib.rs"),
    ("fairgate-gateway (bin)", "gateway/src/main.rs"),
    ("fairgate_simulator", "simulator/src/lib.rs"),
    ("fairgate-simulate (bin)", "simulator/src/main.rs"),
    ("fairgate-quickstart (bin)", "quickstart/src/main.rs"),
];

/// Every non-test source file of every crate of the workspace.
fn crate_files() -> Vec<SourceFile> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for (krate, path) in CRATES {
        walk(&root.join(path), krate, Vec::new(), &mut files);
    }
    files
}

/// Reads `path` as module `module` of `krate`, then the modules it declares in files.
fn walk(path: &Path, krate: &str, module: Vec<String>, files: &mut Vec<SourceFile>) {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let code = strip_tests(&blank(&text));
    // A file's child modules live beside it (`mod.rs`, `main.rs`, `lib.rs`) or in the folder of
    // its own name.
    let stem = path.file_stem().expect("a file").to_string_lossy();
    let dir = if matches!(&*stem, "mod" | "main" | "lib") || module.is_empty() {
        path.parent().expect("in a folder").to_path_buf()
    } else {
        path.parent().expect("in a folder").join(&*stem)
    };
    let children = declared_modules(&code);
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    files.push(SourceFile {
        path: path
            .strip_prefix(root)
            .unwrap_or(path)
            .display()
            .to_string(),
        krate: krate.to_owned(),
        module: module.clone(),
        code,
    });
    for child in children {
        let flat = dir.join(format!("{child}.rs"));
        let nested = dir.join(&child).join("mod.rs");
        let file = if flat.exists() { flat } else { nested };
        let mut path = module.clone();
        path.push(child);
        walk(&file, krate, path, files);
    }
}

/// The names in `mod name;` declarations (modules in their own files).
fn declared_modules(code: &str) -> Vec<String> {
    let words = words(code);
    let mut names = Vec::new();
    for (i, w) in words.iter().enumerate() {
        if w.text == "mod"
            && let Some(name) = words.get(i + 1)
            && code[name.end..].trim_start().starts_with(';')
        {
            names.push(name.text.to_owned());
        }
    }
    names
}

/// Blanks comments, string and character literals, keeping every newline so that line numbers
/// hold.
fn blank(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let keep = |out: &mut String, c: char| out.push(if c == '\n' { '\n' } else { ' ' });
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let prev_ident = i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
                out.push(' ');
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    keep(&mut out, chars[i]);
                    i += 1;
                }
            }
        } else if (c == 'r' || (c == 'b' && next == Some('r')))
            && !prev_ident
            && raw_start(&chars, i).is_some()
        {
            let (hashes, open) = raw_start(&chars, i).expect("checked");
            out.push('"');
            for _ in i + 1..=open {
                out.push(' ');
            }
            i = open + 1;
            loop {
                if i >= chars.len() {
                    break;
                }
                if chars[i] == '"' && (1..=hashes).all(|h| chars.get(i + h) == Some(&'#')) {
                    out.push('"');
                    for _ in 0..hashes {
                        out.push(' ');
                    }
                    i += 1 + hashes;
                    break;
                }
                keep(&mut out, chars[i]);
                i += 1;
            }
        } else if c == '"' {
            out.push('"');
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    keep(&mut out, chars[i]);
                    i += 1;
                }
                if i < chars.len() {
                    keep(&mut out, chars[i]);
                    i += 1;
                }
            }
            out.push('"');
            i += 1;
        } else if c == '\'' && (next == Some('\\') || chars.get(i + 2) == Some(&'\'')) {
            // A character literal; a lifetime (`'a`) has no closing quote.
            out.push('\'');
            i += 1;
            if chars[i] == '\\' {
                // The escaped character, which may be a quote.
                out.push_str("  ");
                i += 2;
            }
            while i < chars.len() && chars[i] != '\'' {
                keep(&mut out, chars[i]);
                i += 1;
            }
            out.push('\'');
            i += 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// At a raw string's `r` (or `br`): how many `#` it has and where its opening quote is.
fn raw_start(chars: &[char], at: usize) -> Option<(usize, usize)> {
    let mut i = if chars[at] == 'b' { at + 2 } else { at + 1 };
    let mut hashes = 0;
    while chars.get(i) == Some(&'#') {
        hashes += 1;
        i += 1;
    }
    (chars.get(i) == Some(&'"')).then_some((hashes, i))
}

/// Blanks every item under `#[cfg(test)]` and every `mod tests`.
fn strip_tests(code: &str) -> String {
    let mut out: Vec<u8> = code.as_bytes().to_vec();
    let mut from = 0;
    loop {
        let attr = code[from..].find("#[cfg(test)]").map(|p| p + from);
        let module = words(&code[from..])
            .into_iter()
            .find(|w| w.text == "mod" && code[from + w.end..].trim_start().starts_with("tests"))
            .map(|w| w.start + from);
        let Some(start) = [attr, module].into_iter().flatten().min() else {
            break;
        };
        let past_attribute = if attr == Some(start) {
            start + "#[cfg(test)]".len()
        } else {
            start
        };
        let end = item_end(code, past_attribute);
        for b in &mut out[start..end] {
            if *b != b'\n' {
                *b = b' ';
            }
        }
        from = end;
    }
    String::from_utf8(out).expect("blanked whole bytes only")
}

/// The end of the item starting at or after `from`: past its matching `}` or its `;`.
fn item_end(code: &str, from: usize) -> usize {
    let bytes = code.as_bytes();
    let mut i = from;
    let mut parens = 0i32;
    while i < bytes.len() {
        match bytes[i] {
            b'(' | b'[' => parens += 1,
            b')' | b']' => parens -= 1,
            b';' if parens == 0 => return i + 1,
            b'{' if parens == 0 => return matching_brace(bytes, i) + 1,
            _ => {}
        }
        i += 1;
    }
    bytes.len()
}

/// The index of the `}` closing the `{` at `open`.
fn matching_brace(bytes: &[u8], open: usize) -> usize {
    let mut depth = 0;
    for (i, &b) in bytes.iter().enumerate().skip(open) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
    }
    bytes.len() - 1
}

struct Word<'a> {
    text: &'a str,
    start: usize,
    end: usize,
}

/// The identifiers and keywords in `code`, in order.
fn words(code: &str) -> Vec<Word<'_>> {
    let bytes = code.as_bytes();
    let is_ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut words = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if is_ident(bytes[i]) && (i == 0 || !is_ident(bytes[i - 1])) {
            let start = i;
            while i < bytes.len() && is_ident(bytes[i]) {
                i += 1;
            }
            // `'a` is a lifetime, not a word.
            if start == 0 || bytes[start - 1] != b'\'' {
                words.push(Word {
                    text: &code[start..i],
                    start,
                    end: i,
                });
            }
        } else {
            i += 1;
        }
    }
    words
}

fn line_of(code: &str, at: usize) -> usize {
    code[..at].bytes().filter(|&b| b == b'\n').count() + 1
}

/// Every function with a body in `file`, nested ones too.
fn functions(file: &SourceFile) -> Vec<Function> {
    let code = strip_tests(&file.code);
    let bytes = code.as_bytes();
    let words = words(&code);
    let mut found = Vec::new();
    for (i, w) in words.iter().enumerate() {
        // `fn name`; a pointer type (`fn(u8)`) has no name.
        let Some(name) = words.get(i + 1).filter(|_| w.text == "fn") else {
            continue;
        };
        if !code[w.end..name.start].trim().is_empty() {
            continue;
        }
        let mut parens = 0i32;
        let mut j = name.end;
        let open = loop {
            match bytes.get(j) {
                None => break None,
                Some(b'(' | b'[') => parens += 1,
                Some(b')' | b']') => parens -= 1,
                Some(b';') if parens == 0 => break None,
                Some(b'{') if parens == 0 => break Some(j),
                _ => {}
            }
            j += 1;
        };
        let Some(open) = open else { continue };
        let close = matching_brace(bytes, open);
        let line = line_of(&code, w.start);
        found.push(Function {
            file: file.path.clone(),
            name: name.text.to_owned(),
            line,
            lines: line_of(&code, close) - line + 1,
        });
    }
    found
}

/// Where each name the root re-exports (`pub use crate::module::Name`) is defined: the
/// top-level module, followed through that module's own re-exports from other modules.
fn root_reexports(files: &[SourceFile]) -> BTreeMap<String, String> {
    let imports = |module: &[String]| -> Vec<Vec<String>> {
        files
            .iter()
            .filter(|f| f.module == module)
            .flat_map(|f| use_paths(&f.code))
            .map(|(path, _)| path)
            .filter(|path| path.len() >= 3 && path[0] == "crate")
            .collect()
    };
    let mut names = BTreeMap::new();
    for path in imports(&[]) {
        let name = &path[path.len() - 1];
        let mut module = path[1].clone();
        // A module that re-exports the name from another names that one in its own `use`.
        for _ in 0..files.len() {
            let from = imports(std::slice::from_ref(&module))
                .into_iter()
                .find(|p| &p[p.len() - 1] == name && p[1] != module);
            match from {
                Some(p) => module = p[1].clone(),
                None => break,
            }
        }
        names.insert(name.clone(), module);
    }
    names
}

/// The top-level modules `file` names, through `crate::`, `super::` or a root re-export,
/// each with a line that names it.
fn crate_references(
    file: &SourceFile,
    reexports: &BTreeMap<String, String>,
) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    let mut top = |segment: &str, line: usize| {
        let module = reexports.get(segment).map_or(segment, String::as_str);
        found.push((module.to_owned(), line));
    };
    for (path, line) in module_paths(file) {
        let ups = path.iter().take_while(|s| *s == "super").count();
        let first = match path.first().map(String::as_str) {
            Some("crate") => path.get(1),
            Some("super") if ups >= file.module.len() => path.get(ups),
            _ => None,
        };
        if let Some(segment) = first {
            top(segment, line);
        }
    }
    found
}

/// Every path `file` names from the crate's modules, each with its line: those its `use`
/// items bring in, and chains of words joined by `::` outside them
/// (`crate::store::Store::memory()`) that start at `crate`, `super` or `self`.
fn module_paths(file: &SourceFile) -> Vec<(Vec<String>, usize)> {
    let mut paths = use_paths(&file.code);
    let words = words(&file.code);
    for (i, w) in words.iter().enumerate() {
        let starts_chain = !file.code[..w.start].trim_end().ends_with("::");
        if !starts_chain || !matches!(w.text, "crate" | "super" | "self") {
            continue;
        }
        let mut path = vec![w.text.to_owned()];
        for pair in words[i..].windows(2) {
            if file.code[pair[0].end..pair[1].start].trim() != "::" {
                break;
            }
            path.push(pair[1].text.to_owned());
        }
        if path.len() > 1 {
            paths.push((path, line_of(&file.code, w.start)));
        }
    }
    paths
}

/// Every path a `use` item in `code` brings in, groups expanded, each with its line.
fn use_paths(code: &str) -> Vec<(Vec<String>, usize)> {
    let words = words(code);
    let mut paths = Vec::new();
    for w in &words {
        if w.text != "use" {
            continue;
        }
        let end = code[w.end..].find(';').map_or(code.len(), |p| w.end + p);
        let tree = code[w.end..end]
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .replace(" ::", "::")
            .replace(":: ", "::")
            .replace("{ ", "{")
            .replace(" }", "}")
            .replace(" ,", ",");
        let line = line_of(code, w.start);
        expand(&tree, &mut Vec::new(), &mut |p| paths.push((p, line)));
    }
    paths
}

/// Expands a use tree (`a::{b::C, d}`) into its paths.
fn expand(tree: &str, prefix: &mut Vec<String>, out: &mut dyn FnMut(Vec<String>)) {
    for part in split_top(tree, ',') {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        let depth = prefix.len();
        let mut rest = part;
        loop {
            if let Some(group) = rest.strip_prefix('{') {
                expand(group.strip_suffix('}').unwrap_or(group), prefix, out);
                break;
            }
            match rest.split_once("::") {
                Some((head, tail)) if !head.contains('{') => {
                    prefix.push(head.to_owned());
                    rest = tail;
                }
                _ => {
                    let name = rest.split(' ').next().unwrap_or(rest);
                    let mut path = prefix.clone();
                    path.push(name.to_owned());
                    out(path);
                    break;
                }
            }
        }
        prefix.truncate(depth);
    }
}

/// Splits at `sep` outside braces.
fn split_top(s: &str, sep: char) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            c if c == sep && depth == 0 => {
                parts.push(&s[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

/// The strongly connected groups of more than one module (Tarjan's algorithm), each sorted.
fn cycles(edges: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        edges: &'a BTreeMap<String, BTreeMap<String, String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        groups: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.edges.get(v).into_iter().flat_map(|e| e.keys()) {
                if !self.index.contains_key(w.as_str()) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w.as_str()]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w.as_str()) {
                    let low = self.low[v].min(self.index[w.as_str()]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut group = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    group.push(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                if group.len() > 1 {
                    group.sort();
                    self.groups.push(group);
                }
            }
        }
    }
    let mut walk = Walk {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        groups: Vec::new(),
    };
    for v in edges.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.groups.sort();
    walk.groups
}
