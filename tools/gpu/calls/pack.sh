#!/bin/bash
# usage: pack.sh BUILD_DIR bin1 bin2 ...   (names of executables found under BUILD_DIR)
set -e
cd "$(dirname "$0")/../../.."
B=$1; shift
rm -rf .gpu-carry-r1 && mkdir -p .gpu-carry-r1/bin .gpu-carry-r1/lib .gpu-pack
for n in "$@"; do f=$(find $B -name "$n" -type f -perm -u+x | head -1); [ -n "$f" ] || { echo "missing $n"; exit 1; }; cp "$f" .gpu-carry-r1/bin/; done
for l in libfmt.so.9 libgomp.so.1 libpcre2-8.so.0 libcpp-httplib.so.0.11 libbrotlidec.so.1 libbrotlienc.so.1 libbrotlicommon.so.1 libedit.so.2 libbsd.so.0 libmd.so.0; do
  p=$(ldconfig -p | awk -v l=$l '$1==l {print $NF; exit}'); cp -L "$p" .gpu-carry-r1/lib/; done
cp -L /usr/local/cuda/lib/libcupti.so.13 .gpu-carry-r1/lib/   # bench-cuda-decode --timeline: the CUPTI it was built against
strip .gpu-carry-r1/bin/* 2>/dev/null || true
(cd .gpu-carry-r1 && tar cf - bin lib | xz -T1 --lzma2=preset=6,dict=192MiB > ../.gpu-pack/carry.tar.xz)
ls -la .gpu-pack/carry.tar.xz
