#!/usr/bin/env python3
"""The layer dependency rule (STYLE §3.2), checked on #include lines.

CMake enforces it for symbols (a layer links only the layers below it); this check also catches a
header-only include across the rule, which linking alone would not. Run from the repository root.
`--self-test` plants a forbidden include in memory and asserts the check reports it (the control).
"""
import os
import re
import sys

# layer -> layers it may include (besides itself). Mirrors the target_link_libraries in src/*/CMakeLists.txt.
ALLOWED = {
    "core": set(),
    "ir": {"core"},
    "loader": {"core"},
    "quant": {"core", "loader"},
    "model": {"core", "ir", "loader", "quant"},
    "backend": {"core", "ir", "quant"},
    "tokenizer": {"core"},
    "chat": {"core", "tokenizer"},
    "runtime": {"core", "ir", "loader", "quant", "model", "backend", "tokenizer", "chat"},
    "server": {"core", "runtime", "tokenizer", "chat", "model", "ir", "loader", "backend", "quant"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_\-]+)/')


def violations(files):
    bad = []
    for path, text in files:
        layer = path.split(os.sep)[1]
        for no, line in enumerate(text.splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            dep = m.group(1)
            if dep in ALLOWED and dep != layer and dep not in ALLOWED[layer]:
                bad.append(f"{path}:{no}: layer '{layer}' includes '{dep}/' ({line.strip()})")
    return bad


def source_files(root="src"):
    out = []
    for layer in sorted(os.listdir(root)):
        if layer not in ALLOWED:
            continue
        for d, _, names in os.walk(os.path.join(root, layer)):
            for n in names:
                if n.endswith((".h", ".cpp", ".cu", ".cuh")):
                    p = os.path.join(d, n)
                    with open(p, encoding="utf-8", errors="replace") as f:
                        out.append((p, f.read()))
    return out


def main():
    files = source_files()
    if "--self-test" in sys.argv:
        planted = files + [("src/model/planted.cpp", '#include "backend/backend.h"\n')]
        assert violations(planted), "control failed: a model -> backend include was not reported"
        assert not any("src/model/planted.cpp" in v for v in violations(files)), "control leaked"
        print("layering self-test: planted model->backend include reported (control ok)")
    bad = violations(files)
    for b in bad:
        print(b)
    print(f"layering: {len(files)} files checked, {len(bad)} violations")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
