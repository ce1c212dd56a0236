// TEST-ONLY fault injection for the server fault drills (issue 9 item 4; tests/unit/server/
// test_server_drills.cpp). Never enabled in production: `perigee serve` installs it only when
// the hidden flag `--test-nan-token ID` is given (not listed in --help; a warning is printed).
#pragma once
#include "runtime/model-runner.h"

#include <cstdint>

namespace perigee::server {

// Poisons one sequence's logits with NaN through model_runner::logits_hook: a sequence whose
// prompt contains `trigger` (seen in any prefill chunk; a chunk at position 0 re-arms or disarms
// its slot) gets NaN in its logits row on its (after_rows + 1)-th sampled row, i.e. after
// `after_rows` tokens were generated. The engine then fails that request alone ("non-finite
// logits"). Runs on the engine thread only (the hook's caller), so it needs no lock.
void install_nan_drill(model_runner & r, int32_t trigger, int after_rows);

} // namespace perigee::server
