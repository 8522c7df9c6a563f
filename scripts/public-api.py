#!/usr/bin/env python3
"""Counts the public names of the `probity` crate (ARCHITECTURE.md, "The public API").

    CARGO_TARGET_DIR=target/nightly cargo +nightly rustdoc -p probity --lib -- \
        -Z unstable-options --output-format json
    python3 scripts/public-api.py target/nightly/doc/probity.json [--list]

Walks the crate root's items and its public modules and re-exports, recursively, and
counts each name once per path: types, traits, functions, constants, statics, type
aliases and modules. Methods, associated items and fields are not counted; neither are
`#[doc(hidden)]` items, which rustdoc leaves out of its JSON. A glob re-export of
another crate (which the JSON cannot see into) is reported, so that it is not mistaken
for one name.
"""
import collections
import json
import sys


def kind(item):
    inner = item["inner"]
    return next(iter(inner)) if isinstance(inner, dict) else inner


def walk(index, paths, module_id, prefix, seen, out):
    if module_id in seen:
        return
    seen.add(module_id)
    for child_id in index[str(module_id)]["inner"]["module"]["items"]:
        child = index.get(str(child_id))
        if child is None:
            continue
        k = kind(child)
        if k == "impl":
            continue
        if k != "use":
            out[prefix + (child.get("name") or "?")] = k
            if k == "module":
                walk(index, paths, child_id, prefix + child["name"] + "::", seen, out)
            continue
        use = child["inner"]["use"]
        target = use.get("id")
        local = target is not None and str(target) in index
        if use.get("is_glob"):
            if local:
                walk(index, paths, target, prefix, seen, out)
            else:
                out[prefix + "*" + use["source"]] = "glob of another crate: expand it"
            continue
        if local:
            k = kind(index[str(target)])
            out[prefix + use["name"]] = k
            if k == "module":
                walk(index, paths, target, prefix + use["name"] + "::", seen, out)
        else:
            out[prefix + use["name"]] = paths.get(str(target), {}).get("kind", "external")


def main():
    doc = json.load(open(sys.argv[1]))
    names = collections.OrderedDict()
    walk(doc["index"], doc.get("paths", {}), doc["root"], "", set(), names)
    per_module = collections.Counter(
        n.split("::")[0] if "::" in n else "(root)" for n in names
    )
    print("total", len(names))
    for module, count in per_module.most_common():
        print(count, module)
    if "--list" in sys.argv[2:]:
        for name, k in names.items():
            print(k, name)
    if any(k.startswith("glob") for k in names.values()):
        sys.exit("a glob re-export of another crate is counted as one name: list its items")


if __name__ == "__main__":
    main()
