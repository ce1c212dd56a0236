#!/usr/bin/env python3
"""Mutation proof for the loader's checks (RELIABILITY §0.7): disable one check at a time, rebuild, and require
test_loader to go red. Usage (from the repo root, with a configured build dir):
  python3 tests/unit/loader/mutate.py build-<you>
Restores every file it touches. Not part of ctest (it rebuilds ~25 times)."""
import subprocess, shutil, sys, tempfile, os
build = sys.argv[1] if len(sys.argv) > 1 else "build"
cmd = f"ninja -C {build} test_loader >/dev/null 2>&1 && ./{build}/tests/unit/loader/test_loader --gtest_brief=1 2>&1 | grep -c '^\\[  FAILED  \\]'"
backup = os.path.join(tempfile.mkdtemp(), "backup")
bad = 0
muts = [
 ("src/loader/safetensors.cpp", "h[0] == '{', \"{}: header must", "true, \"{}: header must"),
 ("src/loader/safetensors.cpp", "PG_CHECK(!only_blank,", "PG_CHECK(true || !only_blank,"),
 ("src/loader/safetensors.cpp", "PG_CHECK(es[f->by_name_[i - 1]].name != es[f->by_name_[i]].name,", "PG_CHECK(true,"),
 ("src/loader/safetensors.cpp", "PG_CHECK(!seen_metadata_,", "PG_CHECK(true,"),
 ("src/loader/safetensors.cpp", "PG_CHECK(cur_.end >= cur_.begin,", "PG_CHECK(true,"),
 ("src/loader/safetensors.cpp", "PG_CHECK(t.has_value(),", "if (!t) { st_ = state::in_entry; return true; } PG_CHECK(true,"),
 ("src/loader/checkpoint.cpp", "PG_CHECK(*total_size == c.total_,", "PG_CHECK(true,"),
 ("src/loader/checkpoint.cpp", "PG_CHECK(!(has_index && has_single),", "PG_CHECK(true,"),
 ("src/loader/safetensors.cpp", "PG_CHECK(nbits % 8 == 0,", "PG_CHECK(true,"),
 ("src/loader/safetensors.cpp", "PG_CHECK(cur_.end - cur_.begin == nbits / 8,", "PG_CHECK(true,"),
 ("src/loader/safetensors.cpp", "PG_CHECK(e.begin == pos,", "PG_CHECK(true,"),
 ("src/loader/safetensors.cpp", "PG_CHECK(e.begin >= pos,", "PG_CHECK(true,"),
 ("src/loader/safetensors.cpp", "PG_CHECK(pos == buffer_size,", "PG_CHECK(true,"),
 ("src/loader/safetensors.cpp", "PG_CHECK(n <= k_st_max_header,", "PG_CHECK(true,"),
 ("src/loader/safetensors.cpp", "PG_CHECK(n <= size - 8,", "PG_CHECK(true,"),
 ("src/loader/safetensors.cpp", "PG_CHECK(seen != nullptr,", "if (!seen) { st_ = state::field_dtype; return true; } PG_CHECK(true,"),
 ("src/loader/safetensors.cpp", "PG_CHECK(meta_.count(k) == 0,", "PG_CHECK(true,"),
 ("src/loader/checkpoint.cpp", "PG_CHECK(ok, \"{}: shard path escapes", "PG_CHECK(true, \"{}: shard path escapes"),
 ("src/loader/checkpoint.cpp", "PG_CHECK(it != weight_map.end(),", "if (it == weight_map.end()) {\n continue;\n }\n PG_CHECK(true,"),
 ("src/loader/checkpoint.cpp", "PG_CHECK(it->second == shard,", "PG_CHECK(true,"),
 ("src/loader/checkpoint.cpp", "PG_CHECK(c.index_.count(name) != 0,", "PG_CHECK(true,"),
 ("src/loader/checkpoint.cpp", "PG_CHECK(keys.back().insert(k).second,", "PG_CHECK(true,"),
]
for f, a, b in muts:
    src = open(f).read()
    assert src.count(a) == 1, a
    shutil.copy(f, backup)
    try:
        open(f, "w").write(src.replace(a, b))
        r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
        print(f"{r.stdout.strip() or 'build failed':>4} failing  <- {a[:60]}", flush=True)
    finally:
        shutil.copy(backup, f)
    try:
        red = int(r.stdout.strip() or "0") > 0
    except ValueError:
        red = False
    bad += 0 if red else 1
print("all mutations caught" if bad == 0 else f"{bad} mutation(s) NOT caught (or did not build)")
sys.exit(1 if bad else 0)
