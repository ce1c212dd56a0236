// perigee synth --preset NAME --out DIR [--seed S]: a random-weight checkpoint in the published layout.
#include "command.h"
#include "model/synth.h"

#include <cstdio>

namespace perigee::cli {
namespace {

command_registrar reg{{"synth", "write a random-weight checkpoint of a preset geometry in the published layout",
    [](CLI::App & sub) {
        struct opts { std::string preset, out; uint64_t seed = 1; };
        auto o = std::make_shared<opts>();
        std::string names;
        for (const auto & p : synth_presets()) names += (names.empty() ? "" : ", ") + p;
        sub.add_option("--preset", o->preset, "one of: " + names)->required();
        sub.add_option("--out", o->out, "output directory")->required();
        sub.add_option("--seed", o->seed, "random seed")->capture_default_str();
        return std::function<int()>([o] {
            synth_write(o->preset, o->out, o->seed);
            std::printf("wrote %s (preset %s, seed %llu)\n", o->out.c_str(), o->preset.c_str(), (unsigned long long)o->seed);
            return 0;
        });
    }}};

} // namespace
} // namespace perigee::cli
