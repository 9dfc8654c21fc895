#!/usr/bin/env python3
"""Fail if building the workspace needs anything beyond the Rust toolchain.

Reads `cargo metadata` (the graph resolved for this host, dev and build
dependencies included) and refuses:
- crates that generate bindings or find system libraries at build time
  (bindgen, clang-sys, cmake, pkg-config, system-deps, vcpkg);
- any crate that links a native library (`links = ...`), except the
  ones below, whose `links` key names no system library.
A C compiler is allowed (`cc`): the Rust toolchain needs one to link.
"""
import json
import subprocess
import sys

FORBIDDEN = {"bindgen", "clang-sys", "cmake", "pkg-config", "system-deps", "vcpkg"}
# `links` keys that only keep two versions of a crate out of one build.
HARMLESS_LINKS = {"rayon-core"}

host = subprocess.run(
    ["rustc", "-vV"], capture_output=True, text=True, check=True
).stdout
host = next(l.split(": ", 1)[1] for l in host.splitlines() if l.startswith("host: "))
meta = json.loads(
    subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--locked", "--filter-platform", host],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
)
packages = {p["id"]: p for p in meta["packages"]}
nodes = meta["resolve"]["nodes"]
bad = []
for node in nodes:
    p = packages[node["id"]]
    links = p.get("links")
    if p["name"] in FORBIDDEN or (links and links not in HARMLESS_LINKS):
        users = sorted(
            packages[n["id"]]["name"]
            for n in nodes
            if any(d["pkg"] == node["id"] for d in n["deps"])
        )
        bad.append(f"{p['name']} {p['version']} (links: {links}; used by {', '.join(users)})")
if bad:
    print("the default build needs more than the Rust toolchain:", file=sys.stderr)
    for b in bad:
        print(f"  {b}", file=sys.stderr)
    sys.exit(1)
print(f"{len(nodes)} crates, none needing a system library or a bindings generator")
