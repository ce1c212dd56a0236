#!/bin/sh
# Issue 3 item 6, end to end: `perigee synth` an MXFP4 k3-tiny tree, `perigee convert` it to NVFP4, and the
# engine's logits from both trees must be byte-identical. Control: the same comparison must fail on a copy of
# the NVFP4 tree whose weight_global_scale values were doubled.
# usage: convert_e2e.sh PERIGEE_BINARY WORK_DIR
set -eu
P="$1"
D="$2"
rm -rf "$D"
mkdir -p "$D"
"$P" synth --preset k3-tiny --out "$D/mx" --seed 11 >/dev/null
"$P" convert --in "$D/mx" --out "$D/nv" >/dev/null
IDS=3,1,4,1,5,9,2,6,5,3,5,8,9,7,9
"$P" logits --model "$D/mx" --ids $IDS >"$D/mx.json"
"$P" logits --model "$D/nv" --ids $IDS >"$D/nv.json"
cmp "$D/mx.json" "$D/nv.json" || { echo "FAIL: NVFP4 logits differ from MXFP4 logits"; exit 1; }
echo "ok: MXFP4 and NVFP4 trees give byte-identical logits"

# Control: double every global scale in a copy of the NVFP4 tree; the logits must now differ.
cp -r "$D/nv" "$D/bad"
python3 - "$D/bad" <<'PY'
import json, struct, sys, glob
n = 0
for path in glob.glob(sys.argv[1] + "/*.safetensors"):
    with open(path, "r+b") as f:
        hlen = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(hlen))
        for name, e in header.items():
            if name.endswith(".weight_global_scale"):
                off = 8 + hlen + e["data_offsets"][0]
                f.seek(off); (g,) = struct.unpack("<f", f.read(4))
                f.seek(off); f.write(struct.pack("<f", 2 * g)); n += 1
assert n > 0, "no weight_global_scale tensors found"
PY
"$P" logits --model "$D/bad" --ids $IDS >"$D/bad.json"
if cmp -s "$D/mx.json" "$D/bad.json"; then echo "FAIL: control (doubled global scales) was not detected"; exit 1; fi
echo "ok: control detected"
