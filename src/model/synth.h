// Random-weight checkpoints in the exact published layout (perigee synth): the presets' configs,
// every declared tensor filled by role with non-trivial values, MXFP4 experts quantized from random
// weights, sharded safetensors with an index, generation_config.json and vision stubs.
#pragma once
#include "model/config.h"

#include <string>
#include <vector>

namespace perigee {

std::vector<std::string> synth_presets();
// The preset's config.json text (the published form the real checkpoints use).
std::string synth_config_json(const std::string & preset);
// Writes DIR/config.json, generation_config.json, shards and the index. Progress on stderr past 1 GB.
void synth_write(const std::string & preset, const std::string & out_dir, uint64_t seed);

} // namespace perigee
